"""``load_policy``: a transformers causal LM on a bf16, NVFP4 or NF4 base.

* ``base="nvfp4"`` reads a compressed-tensors ``nvfp4-pack-quantized`` checkpoint (ours or
  llm-compressor's, global scales fused or not): targeted Linears become :class:`NVFP4Linear`
  holding only the packed tensors; everything else loads as usual. Streaming, tensor by tensor.
  A bf16 checkpoint is quantized on the fly (calibration-free, as ``qerl quantize`` does).
* ``base="bf16"`` loads a dense checkpoint; given an NVFP4 checkpoint it returns the
  dequantized model (the "dequantized base" for PEFT comparisons).
* ``base="nf4"`` loads a dense checkpoint through bitsandbytes 4-bit NF4 (the QLoRA baseline).
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from qerl.checkpoint import CheckpointError, TensorIndex, read_json
from qerl.models.arch import check_supported, fused_groups
from qerl.models.nvfp4_linear import NVFP4Linear, dequantize_model, replace_linears
from qerl.quant import nvfp4
from qerl.quant.format import PACKED_SUFFIXES, is_target, parse_quantization_config

BASES = ("nvfp4", "bf16", "nf4")


def load_policy(path: str | Path, base: str = "nvfp4", device: str | torch.device = "cpu",
                dtype: torch.dtype = torch.bfloat16, revision: str | None = None):
    """Load a causal LM for training/rollouts. See the module docstring for the bases."""
    from qerl.models.source import resolve_model_dir

    if base not in BASES:
        raise ValueError(f"load_policy: base={base!r} is not one of {BASES}")
    src = resolve_model_dir(path, revision)
    cfg = read_json(src / "config.json")
    check_supported(cfg.get("model_type"), f"{src}/config.json")
    qcfg = parse_quantization_config(cfg.get("quantization_config"), f"{src}/config.json")
    index = TensorIndex(src)  # every shard's header read: a truncated or foreign file is named before transformers
    from qerl.models.check import check_weights

    check_weights(src, cfg, index, quantized=qcfg is not None)  # shapes / dtype against config.json, named
    if base == "nf4":
        if qcfg is not None:
            raise CheckpointError(f"{src}: base='nf4' needs a dense (bf16) checkpoint; this one is NVFP4")
        return _load_nf4(src, device, dtype)
    if qcfg is None:
        dense = check_finite(_load_dense(src, device if base == "bf16" else "cpu", dtype), src)
        return dense if base == "bf16" else quantize_model(dense, cfg["model_type"]).to(device)
    model = check_finite(_load_nvfp4(src, cfg, qcfg, dtype).to(device), src)
    return dequantize_model(model, dtype) if base == "bf16" else model


def check_finite(model: nn.Module, src: Path) -> nn.Module:
    """Every floating-point parameter and buffer of a loaded ``model`` is finite; else a :class:`CheckpointError`
    naming ``src`` and the first tensor holding NaN or inf (a damaged checkpoint, or one saved from a diverged run,
    would otherwise be evaluated or trained on as if it were a model)."""
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if t.is_floating_point() and t.numel():
            x = t.float() if t.element_size() == 1 else t  # (float8 scales: isfinite wants a wider type)
            if not bool(torch.isfinite(x).all()):
                raise CheckpointError(f"{src}: tensor {name} holds NaN or inf: the checkpoint is damaged (or was saved "
                                      "from a diverged run); it cannot be evaluated or trained on")
    return model


def _load_dense(src: Path, device, dtype):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=dtype)
    return model.to(device)


def _load_nf4(src: Path, device, dtype):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    bnb = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                             bnb_4bit_compute_dtype=dtype, bnb_4bit_use_double_quant=True)
    model = AutoModelForCausalLM.from_pretrained(src, quantization_config=bnb, dtype=dtype,
                                                 device_map={"": str(device)})
    import bitsandbytes

    for m in model.modules():
        if isinstance(m, bitsandbytes.nn.Linear4bit):
            # bitsandbytes 0.50 on AVX512-BF16 CPUs repacks the weight for inference the first time
            # it runs in eval mode, after which backward fails; RL alternates eval (rollouts) and
            # train (updates), so keep the trainable layout.
            m.support_avx512bf16_for_cpu = False
    return model


def _skeleton(src: Path, dtype):
    """An empty (meta-device) model of ``src``'s config, without its quantization_config."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(src)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # we handle it; keep transformers' quantizers out
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def _load_nvfp4(src: Path, cfg: dict, qcfg: dict, dtype):
    model = _skeleton(src, dtype)
    targets = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)
               and is_target(n, [c.__name__ for c in type(m).__mro__], qcfg["targets"], qcfg["ignore"])]
    index = TensorIndex(src)
    replace_linears(model, targets, dtype)
    expected = set(model.state_dict().keys())
    tied = getattr(model.config, "tie_word_embeddings", False)
    missing = [k for k in expected if k not in index and not (tied and k == "lm_head.weight")
               and not k.endswith("rotary_emb.inv_freq")]
    if missing:
        raise CheckpointError(f"{src}: checkpoint is missing {len(missing)} tensor(s), e.g. {sorted(missing)[:5]}")
    unexpected = [k for k in index.names() if k not in expected]
    if unexpected:
        raise CheckpointError(
            f"{src}: checkpoint has tensors the model does not expect, e.g. {sorted(unexpected)[:5]} "
            "(wrong architecture, or a quantization scheme qerl does not read)"
        )
    for name in targets:
        mod: NVFP4Linear = model.get_submodule(name)
        packed, scale, gs = (index.get(f"{name}.{s}") for s in PACKED_SUFFIXES)
        try:
            if gs.dtype != torch.float32 or tuple(gs.shape) != (1,):
                raise nvfp4.NVFP4Error(f"weight_global_scale must be float32 [1], got {gs.dtype} {tuple(gs.shape)}")
            gs = nvfp4.check_global_scale(gs, f"{name}.weight_global_scale", reject_reciprocal=True)
            mod.load_packed(packed, scale, gs, index.get(f"{name}.bias") if mod.bias is not None else None)
        except nvfp4.NVFP4Error as e:
            raise CheckpointError(f"{src}: tensor {name}: {e}") from None
    quantized = {f"{n}.{s}" for n in targets for s in (*PACKED_SUFFIXES, "bias")}
    dense = {k: index.get(k) for k in expected if k not in quantized and k in index}
    params = dict(model.named_parameters())
    for k, t in dense.items():
        want = params.get(k)
        if want is not None and tuple(want.shape) != tuple(t.shape):
            raise CheckpointError(f"{src}: tensor {k!r} has shape {tuple(t.shape)}, expected {tuple(want.shape)}")
    model.load_state_dict({k: v.to(dtype) for k, v in dense.items()}, strict=False, assign=True)
    if tied:
        model.tie_weights()
    _materialize_buffers(model)
    model.eval()
    return model


def _materialize_buffers(model: nn.Module) -> None:
    """Rebuild modules whose non-persistent buffers (rotary ``inv_freq``) are still on meta."""
    for name, mod in list(model.named_modules()):
        if any(b.is_meta for b in mod.buffers(recurse=False)) and hasattr(mod, "inv_freq"):
            parent_name, _, leaf = name.rpartition(".")
            with torch.device("cpu"):
                fresh = type(mod)(config=mod.config)
            setattr(model.get_submodule(parent_name) if parent_name else model, leaf, fresh)
    still = [n for n, b in model.named_buffers() if b.is_meta] + [n for n, p in model.named_parameters() if p.is_meta]
    if still:
        raise CheckpointError(f"model tensors were not loaded: {still[:5]}")


def quantize_model(model: nn.Module, model_type: str, ignore: tuple[str, ...] = ("lm_head",)) -> nn.Module:
    """Quantize a dense model's Linears in place (fused q/k/v and gate/up global scales)."""
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)
             and is_target(n, [c.__name__ for c in type(m).__mro__], ["Linear"], ignore)]
    for group in fused_groups(model_type, names):
        mods = [model.get_submodule(n) for n in group]
        gs = nvfp4.fused_global_scale(m.weight for m in mods)
        for n, m in zip(group, mods):
            parent_name, _, leaf = n.rpartition(".")
            setattr(model.get_submodule(parent_name), leaf, NVFP4Linear.from_linear(m, gs))
    return model
