"""The trainer's own model seen as plain tensors for the rollout engine (one copy of the weights).

:func:`view_model` walks a transformers Qwen2 / Llama causal LM — bare, or wrapped by PEFT (LoRA on any of
the seven projections, ``modules_to_save`` norms), on an NVFP4 (:class:`NVFP4Linear`), bf16 / fp32
(``nn.Linear``) or NF4 (bitsandbytes) base — and returns, per decoder layer, its norms and projections as
references to the *same* tensors the trainer updates: packed NVFP4 buffers, dense weights, LoRA ``A``/``B``
parameters, norm weights. Nothing is copied here; the engine keeps only activation-dtype copies of the
(small) LoRA adapters, refreshed before every rollout (:meth:`Proj.sync`) — and, when asked (``nf4="dense"``), a
once-dequantized copy of a frozen NF4 base (:func:`dequantize_nf4`), which trades its memory for CUDA graphs.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from qerl.models.nvfp4_linear import NVFP4Linear
from qerl.rollout.sampling import NF4_WEIGHTS

ARCHITECTURES = ("qwen2", "llama")


class EngineUnsupported(ValueError):
    """The model (architecture, module type, adapter setup) is not one the engine runs."""


def padded_rank(r: int) -> int:
    """The rank the engine runs a (fused) adapter of total rank ``r`` at: zero-padded to a power of two >= 16 (the
    kernels' ``tl.dot`` needs R >= 16)."""
    return max(16, 1 << (r - 1).bit_length())


@dataclass
class Proj:
    """One projection ``y = x · Wᵀ + bias + s · (x · Aᵀ) · Bᵀ``, or several sibling projections fused along N
    (q/k/v, gate/up) whose base tensors are views of one buffer (:func:`fuse`).

    kind: ``nvfp4`` (``packed`` / ``scale`` / ``gscale`` through :func:`qerl.ops.nvfp4_lora_linear`), ``dense``
    (``weight`` through ``F.linear``) or ``module`` (the base module's own forward, e.g. bitsandbytes NF4;
    eager only). ``loras``: the PEFT LoRA layers of the parts (rows ``N`` each, in order; None where a part
    has no adapter). ``a [R, K]`` / ``b [N, R]`` are the engine's activation-dtype copies of the adapters —
    stacked A, block-diagonal B, rank zero-padded to a power of two >= 16 — at fixed addresses, so CUDA
    graphs read the current adapters; ``scale`` is folded into ``b`` when the parts' scalings differ."""

    kind: str
    module: nn.Module | None = None
    weight: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    packed: torch.Tensor | None = None
    scale: torch.Tensor | None = None
    gscale: torch.Tensor | None = None
    loras: list = field(default_factory=list)
    rows: list = field(default_factory=list)
    a: torch.Tensor | None = None
    b: torch.Tensor | None = None
    lora_scale: float = 0.0
    tiled: bool = False  # packed / scale in the tile-contiguous layout now (set_weight_layout)
    home: bool = False  # the layout the modules keep them in (NVFP4Linear.tiled), restore_weight_layout's target

    def sync(self, dtype: torch.dtype) -> None:
        """Copy the parts' active adapters into the engine's buffers (zeros where adapters are disabled)."""
        if not any(self.loras):
            return
        parts = []
        for lora in self.loras:
            if lora is None:
                parts.append(None)
                continue
            name = lora.active_adapters[0]
            off = lora.disable_adapters or lora.merged
            parts.append((lora.lora_A[name].weight, lora.lora_B[name].weight, float(lora.scaling[name]), off))
        r_sum = sum(p[0].shape[0] for p in parts if p)
        R = padded_rank(r_sum)
        K = next(p[0].shape[1] for p in parts if p)
        dev = next(p[0].device for p in parts if p)
        N = sum(self.rows)
        if self.a is None or self.a.shape != (R, K) or self.a.dtype != dtype:
            self.a = torch.zeros(R, K, dtype=dtype, device=dev)
            self.b = torch.zeros(N, R, dtype=dtype, device=dev)
        scales = {p[2] for p in parts if p}
        fold = len(scales) > 1  # different scalings: fold each into its block of B
        self.lora_scale = 1.0 if fold else scales.pop()
        r0 = n0 = 0
        with torch.no_grad():
            for n, p in zip(self.rows, parts):
                if p is not None:
                    la, lb, s, off = p
                    r = la.shape[0]
                    self.a[r0:r0 + r].copy_(la)
                    blk = self.b[n0:n0 + n, r0:r0 + r]
                    blk.zero_() if off else blk.copy_(lb * s if fold else lb)
                    r0 += r
                n0 += n

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        from qerl.ops import nvfp4_linear, nvfp4_lora_linear

        bias = None if self.bias is None else self.bias.to(x.dtype)
        if self.kind == "nvfp4":
            if self.a is None:
                return nvfp4_linear(x, self.packed, self.scale, self.gscale, bias, tiled=self.tiled)
            return nvfp4_lora_linear(x, self.packed, self.scale, self.gscale, bias, self.a, self.b, self.lora_scale,
                                     tiled=self.tiled)
        y = F.linear(x, self.weight, bias) if self.kind == "dense" else self.module(x)
        if self.a is None:
            return y
        x2, y2 = x.reshape(-1, x.shape[-1]), y.reshape(-1, y.shape[-1])
        # y + s · (x·Aᵀ)·Bᵀ with the add in the GEMM's epilogue (one launch, no rounded temporary)
        return torch.addmm(y2, F.linear(x2, self.a), self.b.t(), alpha=self.lora_scale).view(y.shape)


@dataclass
class Norm:
    """RMSNorm ``w · x̂`` (stock) or, with AQN noise ``Z`` drawn, ``(w + Z) · x̂`` in fp32 rounded once
    (:mod:`qerl.rl.aqn`). ``module`` is the active norm module (its noise: :func:`qerl.rl.aqn.active_noise`)."""

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
    qkv: Proj | None = None  # q/k/v fused (fuse=True and fusable), else None
    gate_up: Proj | None = None


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


@torch.no_grad()
def dequantize_nf4(mod: nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """The frozen weight of a bitsandbytes ``Linear4bit`` as a plain ``[N, K]`` tensor of ``dtype`` (the
    activations'), by bitsandbytes' own dequantization — with the module's compute dtype equal to ``dtype``, the
    values its forward multiplies by for more than one input row (its one-row GEMV path rounds differently). An
    engine-owned copy: the module keeps its packed weight."""
    import bitsandbytes.functional as bnbf

    return bnbf.dequantize_4bit(mod.weight.data, mod.weight.quant_state).to(dtype)


def _proj(mod: nn.Module, where: str, nf4: str = "eager", dtype: torch.dtype | None = None) -> Proj:
    lora = None
    if hasattr(mod, "base_layer") and hasattr(mod, "lora_A"):
        lora, mod = mod, mod.base_layer
        if len(lora.active_adapters) != 1:
            raise EngineUnsupported(f"{where}: {len(lora.active_adapters)} active adapters (the engine runs one)")
        name = lora.active_adapters[0]
        if lora.use_dora.get(name, False) or lora.lora_bias.get(name, False):
            raise EngineUnsupported(f"{where}: DoRA / LoRA bias adapters are not supported by the engine")
        if name not in lora.lora_A:  # this projection is not targeted by the adapter
            lora = None
    n = mod.out_features
    if isinstance(mod, NVFP4Linear):
        return Proj("nvfp4", mod, bias=mod.bias, packed=mod.weight_packed, scale=mod.weight_scale,
                    gscale=mod.weight_global_scale, loras=[lora], rows=[n], tiled=mod.tiled, home=mod.tiled)
    if type(mod) is nn.Linear:
        return Proj("dense", mod, weight=mod.weight, bias=mod.bias, loras=[lora], rows=[n])
    if type(mod).__name__ == "Linear4bit" and nf4 == "dense":
        return Proj("dense", None, weight=dequantize_nf4(mod, dtype), bias=mod.bias, loras=[lora], rows=[n])
    if type(mod).__name__ in ("Linear4bit", "Linear8bitLt"):
        return Proj("module", mod, loras=[lora], rows=[n])
    raise EngineUnsupported(f"{where}: module type {type(mod).__name__} is not supported by the engine")


def _fusable(ps: list[Proj]) -> bool:
    p0 = ps[0]
    if any(p.kind != p0.kind for p in ps) or p0.kind not in ("nvfp4", "dense"):
        return False
    if any((p.bias is None) != (p0.bias is None) for p in ps):
        return False
    if p0.kind == "dense":
        return all(not p.weight.requires_grad and p.weight.dtype == p0.weight.dtype for p in ps)
    return all(p.packed.shape[1] == p0.packed.shape[1] and torch.equal(p.gscale, p0.gscale) and p.tiled == p0.tiled
               for p in ps)  # (tiled parts have whole 64-row tiles: stacked, they are the fused weight's tiles)


def _rehome(mods: list[nn.Module], name: str, fused: torch.Tensor) -> torch.Tensor:
    """Copy ``mod.<name>`` of each module into ``fused`` (rows stacked) and make each a view of it."""
    n0 = 0
    for m in mods:
        old = getattr(m, name)
        n = old.shape[0]
        fused[n0:n0 + n].copy_(old)
        view = fused[n0:n0 + n]
        if isinstance(old, nn.Parameter):
            setattr(m, name, nn.Parameter(view, requires_grad=old.requires_grad))
        else:
            setattr(m, name, view)
        n0 += n
    return fused


@torch.no_grad()
def fuse(ps: list[Proj]) -> Proj | None:
    """One projection for siblings that read the same input (q/k/v, gate/up): their base tensors move into one
    buffer each (packed, scales, bias / weight, bias) and the modules keep *views* of it — still one copy of the
    weights, which the trainer's own forward keeps using unchanged. NVFP4 parts must share the global scale (as
    NVFP4 checkpoints do for these groups, vLLM's fusion). None when the parts cannot be fused."""
    if not _fusable(ps):
        return None
    mods = [p.module for p in ps]
    rows = [p.rows[0] for p in ps]
    N = sum(rows)
    out = Proj(ps[0].kind, None, loras=[p.loras[0] for p in ps], rows=rows)
    if any(m is None for m in mods):  # engine-owned dense weights (a dequantized NF4 base): stacked, no module views
        out.weight = torch.cat([p.weight for p in ps])
        out.bias = None if ps[0].bias is None else torch.cat([p.bias.detach() for p in ps])
        return out
    if ps[0].bias is not None:
        b = ps[0].bias
        out.bias = _rehome(mods, "bias", torch.empty(N, dtype=b.dtype, device=b.device))
    if out.kind == "nvfp4":
        p0 = ps[0]
        out.packed = _rehome(mods, "weight_packed", torch.empty(N, p0.packed.shape[1], dtype=p0.packed.dtype,
                                                               device=p0.packed.device))
        out.scale = _rehome(mods, "weight_scale", torch.empty(N, p0.scale.shape[1], dtype=p0.scale.dtype,
                                                             device=p0.scale.device))
        out.gscale = p0.gscale
        out.tiled = out.home = p0.tiled
    else:
        w = ps[0].weight
        out.weight = _rehome(mods, "weight", torch.empty(N, w.shape[1], dtype=w.dtype, device=w.device))
    for p, m in zip(ps, mods):  # the parts now read the views too: no Proj keeps the old buffers alive
        p.bias = m.bias
        if out.kind == "nvfp4":
            p.packed, p.scale = m.weight_packed, m.weight_scale
        else:
            p.weight = m.weight
    return out


@torch.no_grad()
def set_weight_layout(view: "ModelView", tiled: bool, keep=None) -> int:
    """Put the packed weights and scales of ``view``'s NVFP4 projections into the tile-contiguous layout
    (:mod:`qerl_kernels.layout`; ``tiled``) or back to row-major, **in place** — the modules' views, the fused
    buffers and the CUDA graphs' addresses stay — skipping projections without whole 64-row tiles and 128-wide K
    steps, and (tiling) those for which ``keep(N, K)`` is false. Until :func:`restore_weight_layout` the modules'
    own forward must not run (it reads the layout its module keeps, ``NVFP4Linear.tiled``): the engine switches
    around its generation only. Returns how many projections changed layout."""
    return _relay(view, lambda p: tiled, keep)


@torch.no_grad()
def restore_weight_layout(view: "ModelView") -> int:
    """Every NVFP4 projection of ``view`` back in the layout its modules keep (row-major, or tiled for an
    ``NVFP4Linear`` re-laid at load, :meth:`~qerl.models.nvfp4_linear.NVFP4Linear.set_layout`), in place. Returns
    how many changed."""
    return _relay(view, lambda p: p.home)


def _relay(view: "ModelView", want, keep=None) -> int:
    from qerl_kernels import layout

    n = 0
    for p in view.projs:
        if p.kind != "nvfp4":
            continue
        tiled = want(p)
        if p.tiled == tiled:
            continue
        N, kb = p.packed.shape
        if not layout.tileable(N, 2 * kb) or not (p.packed.is_contiguous() and p.scale.is_contiguous()):
            continue
        if tiled and keep is not None and not keep(N, 2 * kb):
            continue
        packed, scale = (layout.tile if tiled else layout.untile)(p.packed, p.scale)
        p.packed.copy_(packed)
        p.scale.copy_(scale)
        p.tiled = tiled
        n += 1
    return n


def _norm(mod: nn.Module, where: str) -> Norm:
    mod = _active(mod)
    if not type(mod).__name__.endswith("RMSNorm") or getattr(mod, "weight", None) is None:
        raise EngineUnsupported(f"{where}: expected an RMSNorm with a weight, got {type(mod).__name__}")
    return Norm(mod, float(getattr(mod, "variance_epsilon", getattr(mod, "eps", 1e-6))))


def check_head_dim(head_dim: int, device: torch.device) -> None:
    """Raise :class:`EngineUnsupported` where the engine's CUDA kernels cannot run this head dim: the decode
    attention (:mod:`qerl_kernels.decode_attention`) and the rotary / cache write (:mod:`qerl_kernels.rope_cache`)
    take a power of two >= 16 (64 and 128 in the Qwen2.5 / Llama 3 families; e.g. OpenLLaMA-3B's 100 does not
    fit). ``generate`` then falls back to the reference sampler with a warning instead of failing in the first
    decode step. On the CPU the engine's torch paths take any head dim."""
    if torch.device(device).type == "cuda" and (head_dim < 16 or head_dim & (head_dim - 1)):
        raise EngineUnsupported(f"head_dim {head_dim}: the engine's decode attention and rotary kernels take a power "
                                "of two >= 16")


def view_model(model: nn.Module, fuse_siblings: bool = False, nf4: str = "eager") -> ModelView:
    """The engine's view of ``model`` (see module docstring); raises :class:`EngineUnsupported` naming the
    part it cannot run. ``fuse_siblings``: q/k/v and gate/up as one projection each (:func:`fuse`). ``nf4``: an
    NF4 (bitsandbytes ``Linear4bit``) base runs through its modules (``eager``: dequantized on every call, no CUDA
    graphs) or as dense weights dequantized once here (``dense``, :func:`dequantize_nf4`: an engine-owned copy of
    the frozen base in its compute dtype, which CUDA graphs and sibling fusion then take like a bf16 base)."""
    if nf4 not in NF4_WEIGHTS:
        raise ValueError(f"nf4 must be one of {NF4_WEIGHTS}, got {nf4!r}")
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
    check_head_dim(head_dim, base.embed_tokens.weight.device)
    layers, projs = [], []
    for i, layer in enumerate(base.layers):
        at, mlp = layer.self_attn, layer.mlp
        where = f"model.layers.{i}"
        ps = {n: _proj(getattr(at if n in ("q", "k", "v", "o") else mlp, f"{n}_proj"), f"{where}.{n}_proj", nf4,
                       base.embed_tokens.weight.dtype)
              for n in ("q", "k", "v", "o", "gate", "up", "down")}
        lay = Layer(_norm(layer.input_layernorm, f"{where}.input_layernorm"),
                    _norm(layer.post_attention_layernorm, f"{where}.post_attention_layernorm"), **ps)
        if fuse_siblings:
            lay.qkv, lay.gate_up = fuse([ps["q"], ps["k"], ps["v"]]), fuse([ps["gate"], ps["up"]])
        used = [ps["o"], ps["down"]] + ([lay.qkv] if lay.qkv else [ps["q"], ps["k"], ps["v"]]) + (
            [lay.gate_up] if lay.gate_up else [ps["gate"], ps["up"]])
        projs += used
        layers.append(lay)
    emb = base.embed_tokens
    return ModelView(arch, layers, emb, _norm(base.norm, "model.norm"), lm.lm_head, rot.inv_freq,
                     float(getattr(rot, "attention_scaling", 1.0)), cfg.hidden_size, heads, kv, head_dim,
                     emb.weight.shape[0], emb.weight.dtype, emb.weight.device, projs)
