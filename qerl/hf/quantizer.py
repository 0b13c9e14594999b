"""``QerlNVFP4Config``: NVFP4 weights through ``transformers.AutoModelForCausalLM.from_pretrained``.

    from qerl.hf import QerlNVFP4Config
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=QerlNVFP4Config())

* ``path`` an NVFP4A16 compressed-tensors checkpoint (``qerl quantize``'s or llm-compressor's): its targeted
  Linears load as :class:`qerl.models.nvfp4_linear.NVFP4Linear`, packed (uint8 ``[N, K/2]`` + fp8 ``[N, K/16]`` +
  fp32 ``[1]`` per weight); no bf16 copy of a quantized weight is ever made.
* ``path`` a bf16 / fp32 checkpoint: each targeted weight is quantized as it is read (``scale_rule``,
  ``keep_bf16_last`` and ``ignore`` as in ``qerl quantize``; q/k/v and gate/up share one global scale, found in a
  first pass over the checkpoint's weights), so the packed tensors equal ``qerl quantize``'s bit for bit.
  Calibrated (AWQ) checkpoints come from ``qerl quantize --calibration awq``; they load through the first route.

``save_pretrained`` writes the compressed-tensors checkpoint itself (the module buffers carry its tensor names, and
``config.json`` its ``quantization_config``), which vLLM, compressed-tensors and ``qerl`` read. LoRA trains on the
loaded model through PEFT (:mod:`qerl.hf.peft_integration`); ``model.dequantize()`` gives the bf16 model.

Transformers refuses a quantization config of another class than the checkpoint's own (compressed-tensors), so
importing :mod:`qerl.hf` also teaches ``AutoHfQuantizer.merge_quantization_configs`` one case: a
``QerlNVFP4Config`` passed for an NVFP4 compressed-tensors checkpoint takes over its loading (the checkpoint's
``ignore`` list is kept). Every other case goes to transformers' own code unchanged.
"""
from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn
from transformers.core_model_loading import ConversionOps
from transformers.quantizers import HfQuantizer, register_quantization_config, register_quantizer
from transformers.quantizers.auto import AutoHfQuantizer
from transformers.utils.quantization_config import QuantizationConfigMixin

from qerl.models.nvfp4_linear import NVFP4Linear, dequantize_model
from qerl.quant import format as qformat
from qerl.quant import nvfp4

QUANT_METHOD = "qerl_nvfp4"
SCALE_RULES = nvfp4.SCALE_RULES  # (the registry qerl.quant.scale_rules)
WEIGHT_LAYOUTS = ("rows", "tiled", "auto")


#: the keys of a checkpoint's ``quantization_config`` block that transformers hands back to the constructor on load
CHECKPOINT_KEYS = frozenset({"quant_method", "format", "quantization_status", "config_groups", "kv_cache_scheme",
                             "global_compression_ratio", "sparsity_config", "transform_config", "version"})


def _names(param: str, value, default: list[str]) -> list[str]:
    """A list of module names: one string is one name (never its letters), anything but strings is refused."""
    if value is None:
        return list(default)
    if isinstance(value, str):
        return [value]
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) and v for v in value):
        raise TypeError(f"QerlNVFP4Config: {param} {value!r}: a list of module names or patterns (strings)")
    return list(value)


@register_quantization_config(QUANT_METHOD)
class QerlNVFP4Config(QuantizationConfigMixin):
    """Load a model's Linears as NVFP4 (4-bit float, 16-element fp8 blocks, an fp32 global scale; weights only).

    Args:
        scale_rule: a rule of :mod:`qerl.quant.scale_rules` -- ``max6`` (the paper's: each block's amax maps to 6),
            ``four-over-six`` (each block's scale chosen between 6 and 4 by its error) or a registered one; used
            when quantizing a bf16 checkpoint on load.
        keep_bf16_last: the last decoder layers left in bf16: a count (``>= 1``) or a fraction of the layers
            (``0 < x < 1``, rounded up); 0 quantizes every layer.
        ignore: module names, class names or ``re:`` patterns never quantized (compressed-tensors' ``ignore``);
            ``lm_head`` by default.
        targets: what is quantized (compressed-tensors' ``targets``), ``["Linear"]`` by default.
        weight_layout: how the loaded layers keep their packed weights in memory: ``rows`` (the checkpoint's
            row-major layout, the default), ``tiled`` (re-laid once at load into the tile-contiguous layout the
            rollout engine decodes from, :meth:`qerl.models.nvfp4_linear.NVFP4Linear.set_layout`; every layer with
            whole 64-row tiles and 128-wide K steps) or ``auto`` (``tiled`` for the layers on a CUDA device whose
            one-row decode keeps its kernel on tiles, ``rows`` elsewhere: :func:`tiles_on_load`). The kernels route
            each call by its M either way; ``save_pretrained``
            writes row-major. Not saved in the checkpoint.
    """

    def __init__(self, scale_rule: str = nvfp4.DEFAULT_RULE, keep_bf16_last: float = 0, ignore: list[str] | None = None,
                 targets: list[str] | None = None, weight_layout: str = "rows", **kwargs):
        self.quant_method = QUANT_METHOD
        if unknown := sorted(set(kwargs) - CHECKPOINT_KEYS):
            raise TypeError(f"QerlNVFP4Config: unknown keyword(s) {', '.join(unknown)} (its parameters: scale_rule, "
                            "keep_bf16_last, ignore, targets, weight_layout; NVFP4's block is fixed at 16)")
        if scale_rule not in SCALE_RULES:
            raise ValueError(f"QerlNVFP4Config: scale_rule {scale_rule!r}, expected one of {list(SCALE_RULES)}")
        if weight_layout not in WEIGHT_LAYOUTS:
            raise ValueError(f"QerlNVFP4Config: weight_layout {weight_layout!r}, expected one of "
                             f"{list(WEIGHT_LAYOUTS)}")
        self.weight_layout = weight_layout
        import math

        if isinstance(keep_bf16_last, bool) or not isinstance(keep_bf16_last, (int, float)) or \
                not math.isfinite(keep_bf16_last):
            raise ValueError(f"QerlNVFP4Config: keep_bf16_last {keep_bf16_last!r}: a layer count (0, 1, 2, ...) or a "
                             "fraction of the layers in (0, 1)")
        try:
            qformat.kept_layers(10**6, keep_bf16_last)  # the value's own checks (a count or a fraction)
        except ValueError as e:
            raise ValueError(f"QerlNVFP4Config: keep_bf16_last {keep_bf16_last!r}: "
                             f"{str(e).split(': ', 1)[-1]}") from None
        self.scale_rule = scale_rule
        self.keep_bf16_last = keep_bf16_last
        self.ignore = _names("ignore", ignore, ["lm_head"])
        qformat.check_patterns(self.ignore, "QerlNVFP4Config ignore")
        self.targets = _names("targets", targets, ["Linear"])

    def to_dict(self) -> dict[str, Any]:
        """The checkpoint's ``quantization_config`` (the compressed-tensors NVFP4A16 block): what
        ``save_pretrained`` writes, so a saved model is an ordinary NVFP4 checkpoint."""
        out = qformat.quantization_config(self.ignore)
        out["config_groups"]["group_0"]["targets"] = list(self.targets)
        return out

    def __repr__(self):
        return (f"QerlNVFP4Config(scale_rule={self.scale_rule!r}, keep_bf16_last={self.keep_bf16_last!r}, "
                f"ignore={self.ignore!r}, targets={self.targets!r}, weight_layout={self.weight_layout!r})")

    def to_json_string(self, use_diff: bool = True) -> str:
        import json

        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"


def tiles_on_load(mod, layout: str) -> bool:
    """Whether a loaded :class:`~qerl.models.nvfp4_linear.NVFP4Linear` is re-laid into the tile-contiguous layout:
    ``tiled``: every layer with whole tiles; ``auto``: those on a CUDA device whose one-row forward (``generate``'s
    decode step of one sequence) keeps its tuned kernel config on tiled weights (``qerl_kernels.ops.tiled_keeps``,
    the engine's rule). Where it would not, the row-major route is the decode kernel, which cannot read tiles, and
    the tiled route measured 0.83-0.93x of it (reports/layout, H200: 14B gate/up, 32B down); every other call
    measured 0.999-1.32x."""
    if layout == "rows" or not mod.can_tile():
        return False
    if layout == "tiled":
        return True
    w = mod.weight_packed
    if not w.is_cuda:
        return False
    from qerl_kernels.ops import tiled_keeps

    return tiled_keeps(1, mod.out_features, mod.in_features, w.device)


def lay_out(layers: list, layout: str) -> int:
    """Re-lay, in place, each :class:`~qerl.models.nvfp4_linear.NVFP4Linear` of ``layers`` that
    :func:`tiles_on_load` picks for ``layout``; returns how many were."""
    return sum(m.set_layout(True) for m in layers if tiles_on_load(m, layout))


class _QuantizeOnLoad(ConversionOps):
    """One checkpoint weight ``[N, K]`` -> its packed tensors, under the global scale of its fused group."""

    def __init__(self, quantizer: "QerlNVFP4HfQuantizer"):
        self.quantizer = quantizer

    def convert(self, input_dict, full_layer_name=None, model=None, missing_keys=None, **kwargs):
        (key, value), = input_dict.items()
        w = value[0] if isinstance(value, list) else value
        base = key.rpartition(".")[0]
        gs = self.quantizer.global_scales[base].to(w.device)
        packed, scale, _ = nvfp4.quantize(w, global_scale=gs, name=key, scale_rule=self.quantizer.quantization_config.scale_rule)
        if missing_keys is not None:
            missing_keys.discard(key)  # the placeholder is replaced by the packed tensors, not loaded
        return {f"{base}.weight_packed": packed, f"{base}.weight_scale": scale,
                f"{base}.weight_global_scale": gs.reshape(1).to(torch.float32).clone()}


@register_quantizer(QUANT_METHOD)
class QerlNVFP4HfQuantizer(HfQuantizer):
    """Transformers' hooks for :class:`QerlNVFP4Config` (see the module docstring)."""

    requires_calibration = False

    def __init__(self, quantization_config: QerlNVFP4Config, **kwargs):
        super().__init__(quantization_config, **kwargs)
        self.targets_found: list[str] = []
        self.global_scales: dict[str, torch.Tensor] = {}

    @property
    def quantized_element_size(self) -> float:
        return 0.5 + 1 / 16  # 4-bit values + one fp8 scale per 16

    def update_dtype(self, dtype):
        return torch.bfloat16 if dtype is None else dtype

    def param_needs_quantization(self, model, param_name: str, **kwargs) -> bool:
        module_name, _, tensor = param_name.rpartition(".")
        try:
            module = model.get_submodule(module_name)
        except AttributeError:
            return False
        return isinstance(module, NVFP4Linear) and tensor == "weight"

    def _targets(self, model) -> list[str]:
        cfg = self.quantization_config
        ignore = list(cfg.ignore)
        if cfg.keep_bf16_last and not self.pre_quantized:
            layers = int(getattr(model.config.get_text_config(), "num_hidden_layers", 0) or 0)
            extra = qformat.last_layers_pattern(layers, cfg.keep_bf16_last)
            if extra and extra not in ignore:
                ignore.append(extra)
                cfg.ignore = ignore  # what the saved checkpoint's ignore list says (a config used again: once)
        return [n for n, m in model.named_modules() if isinstance(m, nn.Linear)
                and qformat.is_target(n, [c.__name__ for c in type(m).__mro__], cfg.targets, ignore)]

    def _process_model_before_weight_loading(self, model, dtype=None, checkpoint_files=None, **kwargs):
        dtype = dtype or torch.bfloat16
        self.targets_found = self._targets(model)
        if not self.targets_found:
            raise ValueError(f"QerlNVFP4Config: no Linear matches targets={self.quantization_config.targets} "
                             f"outside ignore={self.quantization_config.ignore}")
        for name in self.targets_found:
            parent_name, _, leaf = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            old = getattr(parent, leaf)
            if old.in_features % nvfp4.BLOCK_SIZE:
                raise ValueError(f"QerlNVFP4Config: {name} has in_features {old.in_features}, not a multiple of "
                                 f"{nvfp4.BLOCK_SIZE}; add it to ignore")
            new = NVFP4Linear(old.in_features, old.out_features, old.bias is not None, device="meta", dtype=dtype)
            if not self.pre_quantized:  # the checkpoint's dense weight lands here, and is quantized on the way
                new.register_buffer("weight", torch.empty(old.out_features, old.in_features, dtype=dtype,
                                                          device="meta"))
            setattr(parent, leaf, new)
        if not self.pre_quantized:
            self.global_scales = _fused_global_scales(model, self.targets_found, checkpoint_files or [],
                                                      self.quantization_config.scale_rule)
        return model

    def get_quantize_ops(self):
        return _QuantizeOnLoad(self)

    def _process_model_after_weight_loading(self, model, **kwargs):
        left = []
        for name in self.targets_found:
            mod = model.get_submodule(name)
            mod._buffers.pop("weight", None)  # the on-load placeholder, if a weight never came
            if mod.weight_packed.is_meta:
                left.append(name)
        if left:
            raise ValueError(f"QerlNVFP4Config: {len(left)} quantized layer(s) got no weights from the checkpoint, "
                             f"e.g. {left[:3]}")
        lay_out([model.get_submodule(n) for n in self.targets_found],
                getattr(self.quantization_config, "weight_layout", "rows"))
        return model

    def _dequantize(self, model, dtype=None):
        return dequantize_model(model, dtype or torch.bfloat16)

    def is_serializable(self, safe_serialization=None) -> bool:
        return True

    @property
    def is_trainable(self) -> bool:
        return True  # LoRA adapters through PEFT; the packed base stays frozen


def _fused_global_scales(model, targets: list[str], checkpoint_files: list[str], scale_rule: str
                         ) -> dict[str, torch.Tensor]:
    """``{linear: global scale}``: one pass over the checkpoint's weights (:class:`qerl.checkpoint.TensorIndex`, one
    tensor in memory at a time); fused groups (q/k/v, gate/up) share :func:`qerl.quant.nvfp4.fused_global_scale`,
    as ``qerl quantize`` writes them."""
    from pathlib import Path

    from qerl.checkpoint import TensorIndex
    from qerl.models.arch import fused_groups

    dirs = {Path(f).parent for f in checkpoint_files}
    if len(dirs) != 1:
        raise ValueError(f"QerlNVFP4Config: quantizing on load reads one checkpoint directory; got {sorted(dirs)}")
    index = TensorIndex(dirs.pop())
    prefix = f"{getattr(model, 'base_model_prefix', '')}."

    def weight(name: str) -> torch.Tensor:
        key = next((k for k in (f"{name}.weight", f"{name.removeprefix(prefix)}.weight") if k in index), None)
        if key is None:
            raise ValueError(f"QerlNVFP4Config: {index.model_dir} has no {name}.weight")
        return index.get(key)

    out = {}
    for group in fused_groups(model.config.model_type, targets):
        gs = nvfp4.fused_global_scale((weight(n) for n in group), scale_rule)
        out.update(dict.fromkeys(group, gs))
    return out


def _take_over_compressed_tensors(original):
    """Wrap ``AutoHfQuantizer.merge_quantization_configs``: a :class:`QerlNVFP4Config` given for an NVFP4
    compressed-tensors checkpoint loads it (keeping the checkpoint's targets and ignore list)."""

    @functools.wraps(original)
    def merge(cls, quantization_config, quantization_config_from_args):
        if isinstance(quantization_config_from_args, QerlNVFP4Config) and isinstance(quantization_config, dict) \
                and quantization_config.get("quant_method") == qformat.QUANT_METHOD:
            parsed = qformat.parse_quantization_config(quantization_config, "config.json")
            cfg = quantization_config_from_args
            cfg.ignore, cfg.targets = list(parsed["ignore"]), list(parsed["targets"])
            return cfg
        return original.__func__(cls, quantization_config, quantization_config_from_args)

    merge._qerl = True
    return classmethod(merge)


if not getattr(AutoHfQuantizer.merge_quantization_configs, "_qerl", False):
    AutoHfQuantizer.merge_quantization_configs = _take_over_compressed_tensors(
        AutoHfQuantizer.__dict__["merge_quantization_configs"])
