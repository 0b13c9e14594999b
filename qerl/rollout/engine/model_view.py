"""The trainer's own model seen as plain tensors for the rollout engine (one copy of the weights).

:func:`view_model` walks a transformers Qwen2 / Llama causal LM — bare, or wrapped by PEFT (LoRA on any of
the seven projections, ``modules_to_save`` norms), on an NVFP4 (:class:`NVFP4Linear`), bf16 / fp32
(``nn.Linear``) or NF4 (bitsandbytes) base — and returns, per decoder layer, its norms and projections as
references to the *same* tensors the trainer updates: packed NVFP4 buffers, dense weights, LoRA ``A``/``B``
parameters, norm weights. Nothing is copied here; the engine keeps only activation-dtype copies of the
(small) LoRA adapters, refreshed before every rollout (:meth:`Proj.sync`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from qerl.models.nvfp4_linear import NVFP4Linear

ARCHITECTURES = ("qwen2", "llama")


class EngineUnsupported(ValueError):
    """The model (architecture, module type, adapter setup) is not one the engine runs."""


@dataclass
class Proj:
    """One projection ``y = base(x) + s · (x · Aᵀ) · Bᵀ``.

    kind: ``nvfp4`` (packed buffers through :func:`qerl.ops.nvfp4_lora_linear`), ``dense`` (``weight``
    through ``F.linear``) or ``module`` (the base module's own forward, e.g. bitsandbytes NF4; eager only).
    ``lora_a [R, K]`` / ``lora_b [N, R]`` are the trainer's parameters (fp32 masters); ``a`` / ``b`` are the
    engine's activation-dtype copies (static addresses, so CUDA graphs read the current adapters)."""

    kind: str
    module: nn.Module
    weight: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    lora: nn.Module | None = None  # the PEFT LoRA layer (for its active adapter / disable state)
    a: torch.Tensor | None = None
    b: torch.Tensor | None = None
    scale: float = 0.0

    def sync(self, dtype: torch.dtype) -> None:
        """Copy the active adapter into the engine's buffers (zeros when adapters are disabled)."""
        if self.lora is None:
            return
        name = self.lora.active_adapters[0]
        la, lb = self.lora.lora_A[name].weight, self.lora.lora_B[name].weight
        if self.a is None or self.a.shape != la.shape or self.a.dtype != dtype or self.a.device != la.device:
            self.a = torch.empty(la.shape, dtype=dtype, device=la.device)
            self.b = torch.empty(lb.shape, dtype=dtype, device=lb.device)
        self.scale = float(self.lora.scaling[name])
        with torch.no_grad():
            self.a.copy_(la)
            if self.lora.disable_adapters or self.lora.merged:
                self.b.zero_()
            else:
                self.b.copy_(lb)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        from qerl.ops import nvfp4_linear, nvfp4_lora_linear

        m = self.module
        if self.kind == "nvfp4":
            bias = None if m.bias is None else m.bias.to(x.dtype)
            if self.a is None:
                return nvfp4_linear(x, m.weight_packed, m.weight_scale, m.weight_global_scale, bias)
            return nvfp4_lora_linear(x, m.weight_packed, m.weight_scale, m.weight_global_scale, bias,
                                     self.a, self.b, self.scale)
        y = F.linear(x, self.weight, self.bias) if self.kind == "dense" else m(x)
        if self.a is None:
            return y
        return y + F.linear(F.linear(x, self.a), self.b) * self.scale


@dataclass
class Norm:
    """RMSNorm ``w · x̂`` (stock) or, with AQN noise ``Z`` drawn, ``(w + Z) · x̂`` in fp32 rounded once
    (:mod:`qerl.rl.aqn`). ``module`` is the active norm module (``_aqn_noise`` is read from it)."""

    module: nn.Module
    eps: float
    noise: torch.Tensor | None = None  # engine buffer, fp32 [hidden]

    @property
    def weight(self) -> torch.Tensor:
        return self.module.weight


@dataclass
class Layer:
    input_norm: Norm
    post_norm: Norm
    q: Proj
    k: Proj
    v: Proj
    o: Proj
    gate: Proj
    up: Proj
    down: Proj


@dataclass
class ModelView:
    arch: str
    layers: list[Layer]
    embed: nn.Module
    final_norm: Norm
    lm_head: nn.Module
    inv_freq: torch.Tensor
    attention_scaling: float
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    dtype: torch.dtype
    device: torch.device
    projs: list[Proj] = field(default_factory=list)

    @property
    def graphable(self) -> bool:
        """CUDA graphs need every projection on plain tensors (no module calls such as bitsandbytes') and, for
        NVFP4, on the kernels (bf16 / fp16 activations; fp32 runs the reference, which validates on the host)."""
        return all(p.kind == "dense" or (p.kind == "nvfp4" and self.dtype != torch.float32) for p in self.projs)


def _unwrap_causal_lm(model: nn.Module) -> nn.Module:
    if hasattr(model, "get_base_model"):  # peft.PeftModel
        return model.get_base_model()
    return model


def _active(mod: nn.Module) -> nn.Module:
    """A PEFT ``ModulesToSaveWrapper`` resolves to the copy its forward would use."""
    if hasattr(mod, "modules_to_save") and hasattr(mod, "original_module"):
        if getattr(mod, "disable_adapters", False) or not mod.active_adapters:
            return mod.original_module
        return mod.modules_to_save[mod.active_adapters[0]]
    return mod


def _proj(mod: nn.Module, where: str) -> Proj:
    lora = None
    if hasattr(mod, "base_layer") and hasattr(mod, "lora_A"):
        lora, mod = mod, mod.base_layer
        if len(lora.active_adapters) != 1:
            raise EngineUnsupported(f"{where}: {len(lora.active_adapters)} active adapters (the engine runs one)")
        name = lora.active_adapters[0]
        if lora.use_dora.get(name, False) or lora.lora_bias.get(name, False):
            raise EngineUnsupported(f"{where}: DoRA / LoRA bias adapters are not supported by the engine")
    if isinstance(mod, NVFP4Linear):
        p = Proj("nvfp4", mod, lora=lora)
    elif type(mod) is nn.Linear:
        p = Proj("dense", mod, weight=mod.weight, bias=mod.bias, lora=lora)
    elif type(mod).__name__ in ("Linear4bit", "Linear8bitLt"):
        p = Proj("module", mod, lora=lora)
    else:
        raise EngineUnsupported(f"{where}: module type {type(mod).__name__} is not supported by the engine")
    return p


def _norm(mod: nn.Module, where: str) -> Norm:
    mod = _active(mod)
    if not type(mod).__name__.endswith("RMSNorm") or getattr(mod, "weight", None) is None:
        raise EngineUnsupported(f"{where}: expected an RMSNorm with a weight, got {type(mod).__name__}")
    return Norm(mod, float(getattr(mod, "variance_epsilon", getattr(mod, "eps", 1e-6))))


def view_model(model: nn.Module) -> ModelView:
    """The engine's view of ``model`` (see module docstring); raises :class:`EngineUnsupported` naming the
    part it cannot run."""
    lm = _unwrap_causal_lm(model)
    cfg = getattr(lm, "config", None)
    arch = getattr(cfg, "model_type", None)
    if arch not in ARCHITECTURES:
        raise EngineUnsupported(f"model_type {arch!r}: the rollout engine runs {ARCHITECTURES}")
    if getattr(cfg, "use_sliding_window", False) and getattr(cfg, "sliding_window", None):
        raise EngineUnsupported("sliding-window attention is not supported by the rollout engine")
    if getattr(cfg, "hidden_act", "silu") != "silu":
        raise EngineUnsupported(f"hidden_act {cfg.hidden_act!r}: the rollout engine runs silu MLPs")
    base = lm.model
    rot = getattr(base, "rotary_emb", None)
    if rot is None or not hasattr(rot, "inv_freq"):
        raise EngineUnsupported("the model has no rotary_emb.inv_freq (unknown rotary embedding)")
    if getattr(rot, "rope_type", "default") not in ("default", "llama3", "linear"):
        raise EngineUnsupported(f"rope_type {rot.rope_type!r} (position-dependent scaling) is not supported")
    heads, kv = cfg.num_attention_heads, getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    layers, projs = [], []
    for i, layer in enumerate(base.layers):
        at, mlp = layer.self_attn, layer.mlp
        where = f"model.layers.{i}"
        ps = {n: _proj(getattr(at if n in ("q", "k", "v", "o") else mlp, f"{n}_proj"), f"{where}.{n}_proj")
              for n in ("q", "k", "v", "o", "gate", "up", "down")}
        projs += ps.values()
        layers.append(Layer(_norm(layer.input_layernorm, f"{where}.input_layernorm"),
                            _norm(layer.post_attention_layernorm, f"{where}.post_attention_layernorm"), **ps))
    emb = base.embed_tokens
    return ModelView(arch, layers, emb, _norm(base.norm, "model.norm"), lm.lm_head, rot.inv_freq,
                     float(getattr(rot, "attention_scaling", 1.0)), cfg.hidden_size, heads, kv, head_dim,
                     emb.weight.shape[0], emb.weight.dtype, emb.weight.device, projs)
