"""LoRA on any policy base (bf16, NF4, NVFP4) through PEFT, in PEFT's on-disk format.

``y = base(x) + (alpha / r) · B(A(dropout(x)))`` with ``A [r, K]``, ``B [N, r]`` trained (fp32
master weights), the base frozen. On an NVFP4 base the LoRA layer is :class:`LoraNVFP4Linear`, a
PEFT ``lora.Linear`` registered for :class:`NVFP4Linear` through PEFT's custom-module API: adapters
save as ``adapter_config.json`` + ``adapter_model.safetensors`` with PEFT's key names, so
``peft.PeftModel.from_pretrained`` on the bf16 (or dequantized) base reproduces our logits.

Training compute (:func:`lean_lora_delta`): the fp32 master adapters are applied in the activation dtype, so a
bf16 model keeps no fp32 copy of any projection input for the backward (PEFT's forward casts ``x`` to the
adapters' fp32); dense LoRA layers get the same forward through :func:`make_lean`.

Paper: rank 32 on the seven projections; reference code: rank 16, alpha 16, and it also trains the
RMSNorm weights (``train_norms``, off by default).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

import qerl.ops
from qerl.models.arch import PROJECTIONS
from qerl.models.nvfp4_linear import NVFP4Linear

NORM_SUFFIXES = ("input_layernorm", "post_attention_layernorm")


@dataclass(frozen=True)
class LoraSettings:
    """LoRA hyperparameters.

    r: rank (paper 32; ablation 16/32/64/128). alpha: scale numerator, the update is
    ``alpha / r · B A`` (reference code 16 at r = 16). dropout: on the LoRA input (0 in the paper).
    targets: projection names. train_norms: also train the RMSNorm weights (reference code).
    """

    r: int = 32
    alpha: float = 32.0
    dropout: float = 0.0
    targets: tuple[str, ...] = PROJECTIONS
    train_norms: bool = False

    def __post_init__(self):
        if not isinstance(self.r, int) or self.r < 1:
            raise ValueError(f"lora.r must be a positive integer, got {self.r!r}")
        if not self.alpha > 0:
            raise ValueError(f"lora.alpha must be > 0, got {self.alpha!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"lora.dropout must be in [0, 1), got {self.dropout!r}")
        if not self.targets:
            raise ValueError("lora.targets must name at least one projection")
        unknown = [t for t in self.targets if t not in PROJECTIONS]
        if unknown:
            raise ValueError(f"lora.targets: {unknown} are not projections of the supported architectures; "
                             f"choose from {list(PROJECTIONS)}")


class AdapterCasts:
    """Activation-dtype copies of a LoRA layer's fp32 adapters (what the GPU kernels read), reused only inside a
    :func:`frozen_adapters` block: there the caller promises that no optimizer step runs, so a copy is made once
    per adapter and dtype (again after an in-place change: version counter). Outside a block every call casts —
    an optimizer may write parameters without moving their version counters (bitsandbytes' 8-bit AdamW writes
    raw memory), so nothing outside the caller knows when a copy goes stale."""

    _qerl_casts: dict | None = None  # the open block's copies: {name: (key, A, B)}; None outside a block

    def _cast(self, name: str, a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype):
        """``(A, B)`` of adapter ``name`` in ``dtype`` (detached)."""
        cache = self._qerl_casts
        if cache is None:
            return a.detach().to(dtype), b.detach().to(dtype)
        key = (a._version, b._version, a.data_ptr(), b.data_ptr(), dtype)
        if name not in cache or cache[name][0] != key:
            cache[name] = (key, a.detach().to(dtype), b.detach().to(dtype))
        return cache[name][1], cache[name][2]


@contextlib.contextmanager
def frozen_adapters(model, modules: list | None = None):
    """A block in which ``model``'s adapters do not change (a rollout, a no-grad log-prob pass, the forward /
    backward of one update's micro-batches before its optimizer step): the fused NVFP4 LoRA layers cast their
    fp32 adapters to the activation dtype once instead of per call (:class:`AdapterCasts`). Nested blocks share
    the outermost one's copies; leaving the outermost drops them. ``modules``: ``list(model.modules())`` where the
    caller walked them already."""
    opened = [m for m in (model.modules() if modules is None else modules)
              if isinstance(m, AdapterCasts) and m._qerl_casts is None]
    for m in opened:
        m._qerl_casts = {}
    try:
        yield model
    finally:
        for m in opened:
            m._qerl_casts = None


# devices whose kernels want bf16/fp16 adapters (fp32 adapters are cast there, once per frozen_adapters block)
_CAST_DEVICES = {"cuda"}


def _lean_adapter(layer, x: torch.Tensor, args, kwargs):
    """``(A, B, dropout, scaling)`` of ``layer``'s one active plain adapter when its fp32 master weights should
    be applied in the activation dtype (bf16 / fp16 ``x``), else None (PEFT's own forward then runs)."""
    if args or kwargs or layer.disable_adapters or layer.merged or len(layer.active_adapters) != 1:
        return None
    name = layer.active_adapters[0]
    if (name not in layer.lora_A or layer.use_dora.get(name, False) or layer.lora_bias.get(name, False)
            or name in getattr(layer, "lora_variant", {})):
        return None
    a, b = layer.lora_A[name].weight, layer.lora_B[name].weight
    if x.dtype not in (torch.bfloat16, torch.float16) or a.dtype == x.dtype:
        return None
    return a, b, layer.lora_dropout[name], layer.scaling[name]


def lean_lora_delta(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, dropout, scaling: float) -> torch.Tensor:
    """``s · (drop(x) · Aᵀ) · Bᵀ`` with fp32 masters ``A [r, K]``, ``B [N, r]`` cast to ``x.dtype`` (differentiably:
    their gradients arrive in fp32). PEFT instead casts ``x`` to fp32, so autograd keeps an fp32 copy of every
    projection's input (q, k and v each their own) and runs the adapters' GEMMs in fp32; here the saved input is
    the bf16 ``x`` the base layer already holds, and ``x · Aᵀ`` (``[.., r]``) is the only new activation."""
    return F.linear(F.linear(dropout(x), a.to(x.dtype)), b.to(x.dtype)) * scaling


def _lean_dense_cls():
    from peft.tuners.lora.layer import Linear as PeftLoraLinear

    class LeanLoraLinear(PeftLoraLinear):
        """PEFT's LoRA ``Linear`` over a dense base whose fp32 adapters compute in the activation dtype
        (:func:`lean_lora_delta`); any other case is PEFT's ``forward``. Same parameters and state dict."""

        def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
            lean = _lean_adapter(self, x, args, kwargs)
            if lean is None:
                return super().forward(x, *args, **kwargs)
            return self.base_layer(x) + lean_lora_delta(x, *lean)

    return LeanLoraLinear


def make_lean(peft_model):
    """Switch PEFT's plain dense LoRA layers (exactly ``peft.tuners.lora.layer.Linear``, not its bitsandbytes
    or other subclasses) to :func:`_lean_dense_cls` in place; NVFP4 layers are lean already. Returns the model."""
    from peft.tuners.lora.layer import Linear as PeftLoraLinear

    lean = _lean_dense_cls()
    for mod in peft_model.modules():
        if type(mod) is PeftLoraLinear:
            mod.__class__ = lean
    return peft_model


def _lora_linear_cls():
    from peft.tuners.lora.layer import Linear as PeftLoraLinear

    class LoraNVFP4Linear(AdapterCasts, PeftLoraLinear):
        """PEFT LoRA layer over an :class:`NVFP4Linear` base (which is never merged into).

        Without autograd (rollouts, evaluation) and with one plain LoRA adapter active (no DoRA, no
        LoRA bias, no dropout in effect, no per-row ``adapter_names``), ``forward`` is one call of
        :func:`qerl.ops.nvfp4_lora_linear`: on the GPU one kernel launch for base + LoRA instead of
        PEFT's four (base, A, B, add), with bf16 copies of the fp32 adapters made once per
        :func:`frozen_adapters` block. With autograd (training) and fp32 masters on bf16/fp16 activations, no dropout in effect:
        one :func:`qerl.ops.nvfp4_lora_train` node (base + LoRA forward in one backend call, ``dX`` with its LoRA
        term in one). Everything else is PEFT's own ``forward``."""

        def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
            fused = None if args or kwargs.get("adapter_names") is not None else self._fused_adapter(x)
            if fused is None:
                lean = _lean_adapter(self, x, args, kwargs)
                if lean is not None:  # training: adapters in bf16 from fp32 masters
                    a, b, dropout, scaling = lean
                    if isinstance(dropout, torch.nn.Identity) or not self.training:  # one autograd node
                        base = self.get_base_layer()
                        dense = getattr(base, "dense", None)  # (kept inside a dense_base block: the update phase)
                        return qerl.ops.nvfp4_lora_train(
                            x, base.weight_packed, base.weight_scale, base.weight_global_scale, base.bias, a, b,
                            scaling, casts=self._cast(self.active_adapters[0], a, b, x.dtype),
                            dense=dense if dense is not None and dense.dtype == x.dtype else None, tiled=base.tiled)
                    return self.base_layer(x) + lean_lora_delta(x, *lean)  # base through the seam, dropout
                return super().forward(x, *args, **kwargs)
            base = self.get_base_layer()
            a, b, s = fused
            bias = None if base.bias is None else base.bias.to(x.dtype)
            return qerl.ops.nvfp4_lora_linear(x, base.weight_packed, base.weight_scale, base.weight_global_scale, bias,
                                              a, b, s, tiled=base.tiled)

        def _fused_adapter(self, x: torch.Tensor):
            """``(A, B, scaling)`` of the one active adapter when the fused call computes exactly what
            PEFT would, else None. On CUDA A and B are bf16/fp16 copies (the kernels' operand dtype,
            :class:`AdapterCasts`)."""
            if torch.is_grad_enabled() or self.disable_adapters or self.merged or len(self.active_adapters) != 1:
                return None
            name = self.active_adapters[0]
            if (name not in self.lora_A or self.use_dora.get(name, False) or self.lora_bias.get(name, False)
                    or (self.training and not isinstance(self.lora_dropout[name], torch.nn.Identity))):
                return None
            a, b = self.lora_A[name].weight, self.lora_B[name].weight
            if x.device.type not in _CAST_DEVICES or a.dtype == x.dtype:
                return a, b, self.scaling[name]
            return *self._cast(name, a, b, x.dtype), self.scaling[name]

        def _get_in_out_features(self, module):
            return module.in_features, module.out_features

        def _get_base_layer_device_and_dtype(self, base_layer):
            return base_layer.weight_packed.device, base_layer.compute_dtype

        def merge(self, *args, **kwargs):
            raise RuntimeError(
                "cannot merge LoRA into an NVFP4 base in place (the packed base stays frozen and bit-identical): "
                "save the adapter, then `qerl export-merged --base BASE --adapter ADAPTER --output DIR` writes the "
                "merged bf16 model (or qerl.lora.export_merged)"
            )

    return LoraNVFP4Linear


def lora_config(settings: LoraSettings, base_model_path: str | None = None):
    """The ``peft.LoraConfig`` for ``settings`` (NVFP4 layers registered as custom modules)."""
    from peft import LoraConfig

    norms = list(NORM_SUFFIXES) if settings.train_norms else None
    config = LoraConfig(r=settings.r, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
                        target_modules=list(settings.targets), modules_to_save=norms,
                        bias="none", task_type="CAUSAL_LM", base_model_name_or_path=base_model_path)
    config._register_custom_module({NVFP4Linear: _lora_linear_cls()})
    return config


def apply_lora(model, settings: LoraSettings = LoraSettings()):
    """Wrap ``model`` in a ``peft.PeftModel`` with fresh LoRA adapters (B = 0: output unchanged)."""
    from peft import get_peft_model

    config = lora_config(settings, getattr(model.config, "_name_or_path", None))
    peft_model = get_peft_model(model, config)
    return make_lean(peft_model)


def load_adapter(model, adapter_dir: str | Path, is_trainable: bool = False):
    """Attach a saved PEFT adapter to ``model`` (any base: bf16, NF4 or NVFP4)."""
    from peft import LoraConfig, PeftModel

    adapter_dir = Path(adapter_dir)
    if not (adapter_dir / "adapter_config.json").exists():
        raise FileNotFoundError(f"{adapter_dir}: no adapter_config.json (not a PEFT adapter directory)")
    _check_adapter_files(adapter_dir)
    config = LoraConfig.from_pretrained(str(adapter_dir))
    config._register_custom_module({NVFP4Linear: _lora_linear_cls()})
    _check_base(adapter_dir, model)
    try:
        peft_model = PeftModel.from_pretrained(model, str(adapter_dir), config=config, is_trainable=is_trainable)
    except RuntimeError as e:  # torch's load_state_dict: "size mismatch for ...", one line per tensor
        lines = [x.strip() for x in str(e).splitlines() if "size mismatch" in x]
        if not lines:
            raise
        from qerl.checkpoint import CheckpointError

        raise CheckpointError(f"{adapter_dir}: an adapter of another model ({len(lines)} tensor(s) of other shapes, "
                              f"e.g. {lines[0]})") from None
    _check_all_loaded(adapter_dir, peft_model)
    return make_lean(peft_model)


def _check_adapter_files(adapter_dir: Path) -> None:
    """The adapter's weights are there and whole before PEFT reads them (a missing file would send the local path
    to the hub; a cut one surfaces as a safetensors traceback): checked against the directory's manifest
    (:mod:`qerl.owned`) where it has one, else by reading the safetensors header."""
    from safetensors import safe_open

    from qerl import owned
    from qerl.checkpoint import CheckpointError

    weights = adapter_dir / "adapter_model.safetensors"
    if not weights.is_file():
        if (adapter_dir / "adapter_model.bin").is_file():
            return
        raise CheckpointError(f"{adapter_dir}: no adapter_model.safetensors (the adapter's weights); the directory "
                              "is incomplete")
    if bad := owned.modified(adapter_dir):
        raise CheckpointError(f"{adapter_dir}: {', '.join(bad[:3])} no longer match what was written "
                              "(qerl_files.json): truncated or replaced")
    try:
        with safe_open(str(weights), framework="pt") as f:
            f.keys()
    except Exception as e:  # safetensors' own error types (header too small, invalid JSON, ...)
        raise CheckpointError(f"{weights}: unreadable ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                              "); truncated or empty?") from None


#: written beside a saved adapter: the base it was trained on (PEFT records only a path)
BASE_RECORD = "qerl_adapter.json"
_BASE_KEYS = ("model_type", "num_hidden_layers", "hidden_size", "intermediate_size", "vocab_size")


def base_record(model) -> dict:
    cfg = model.config
    return {k: getattr(cfg, k, None) for k in _BASE_KEYS}


def _check_base(adapter_dir: Path, model) -> None:
    """An adapter saved by qerl names its base's architecture and sizes; another base (a Llama of the same sizes,
    fewer layers) is refused before loading — PEFT would load what fits and warn about the rest."""
    import json

    from qerl.checkpoint import CheckpointError

    record = adapter_dir / BASE_RECORD
    if not record.is_file():
        return
    saved, mine = json.loads(record.read_text()), base_record(model)
    diff = [k for k in _BASE_KEYS if saved.get(k) is not None and mine.get(k) is not None and saved[k] != mine[k]]
    if diff:
        shown = ", ".join(f"{k} {saved[k]} vs {mine[k]}" for k in diff)
        raise CheckpointError(f"{adapter_dir}: an adapter of another model (trained on a base with {shown} of this "
                              "base)")


def _check_all_loaded(adapter_dir: Path, peft_model) -> None:
    """Every tensor of the adapter file found its module (a base with fewer layers leaves some without one)."""
    from safetensors import safe_open

    from qerl.checkpoint import CheckpointError

    f = adapter_dir / "adapter_model.safetensors"
    if not f.is_file():
        return
    with safe_open(str(f), "pt") as h:
        keys = list(h.keys())
    have = {n.replace(".default", "") for n, _ in peft_model.named_parameters() if "lora_" in n}
    lost = [k for k in keys if k not in have]
    if lost:
        raise CheckpointError(f"{adapter_dir}: an adapter of another model ({len(lost)} of its {len(keys)} tensors "
                              f"have no module in this base, e.g. {lost[0]})")


def save_adapter(peft_model, output: str | Path) -> Path:
    """Save adapters in PEFT format, atomically (temp directory, then rename)."""
    from qerl.checkpoint import atomic_directory

    import json

    output = Path(output)
    with atomic_directory(output, force=True) as tmp:
        peft_model.save_pretrained(str(tmp))
        base = peft_model.get_base_model() if hasattr(peft_model, "get_base_model") else peft_model
        (tmp / BASE_RECORD).write_text(json.dumps(base_record(base), indent=1) + "\n")
    return output


def export_merged(base: str | Path, adapter_dir: str | Path, output: str | Path,
                  dtype: torch.dtype = torch.bfloat16, force: bool = False) -> Path:
    """Merge an adapter into its base and save a dense model (bf16 by default).

    An NVFP4 base is dequantized first, so the merged model is exactly what the policy computed
    (dequantized base + LoRA), in a checkpoint any tool reads.
    """
    from qerl.checkpoint import CheckpointError, atomic_directory, is_nonempty_dir
    from qerl.models import load_policy
    from qerl.models.source import resolve_model_dir

    if is_nonempty_dir(Path(output)) and not force:  # (before the merge's work, not after it)
        raise CheckpointError(f"{output}: already exists and is not empty (use --force to replace)")
    src = resolve_model_dir(base)
    model = load_policy(src, base="bf16", dtype=dtype)
    merged = load_adapter(model, adapter_dir).merge_and_unload()
    merged.config.__dict__.pop("quantization_config", None)
    with atomic_directory(Path(output), force=force) as tmp:
        merged.save_pretrained(str(tmp))
        for f in Path(src).iterdir():
            if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "chat_template",
                                  "generation_config")):
                (tmp / f.name).write_bytes(f.read_bytes())
    return Path(output)


def trainable_parameters(model) -> dict[str, int]:
    """``{"trainable": n, "total": m}`` parameter counts (packed NVFP4 buffers count as 0)."""
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {"trainable": trainable, "total": total}
