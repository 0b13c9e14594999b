"""The decoder forward the engine runs: prefill (many tokens per row, SDPA) and one decode step (one token
per row, attention over the slot KV cache), both on :class:`~qerl.rollout.engine.model_view.ModelView`.

Op for op what transformers' Qwen2 / Llama eager forward computes (RMSNorm in fp32 then ``w · x̂`` in the
activation dtype, rotary embedding with cos/sin rounded to the activation dtype, SiLU-gated MLP, residual
adds in the activation dtype), so greedy decoding matches ``transformers.generate``. With AQN noise drawn,
a norm computes ``(w + Z) · x̂`` in fp32 and rounds once, exactly as :mod:`qerl.rl.aqn`'s patched forward.

KV cache: ``k[layer]`` / ``v[layer]`` ``[S, T, Hkv, D]`` (S slots, T positions); row ``b`` lives in slot
``slot[b]`` and its token at position ``p`` is stored at ``[slot[b], p]``.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from qerl.ops.logits import module_logits
from qerl.rollout.engine.model_view import ModelView, Norm


def rope_tables(view: ModelView, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos / sin ``[positions, D]`` in the activation dtype, as transformers' rotary embedding makes them."""
    inv = view.inv_freq.float().to(view.device)
    t = torch.arange(positions, device=view.device, dtype=torch.float32)
    freqs = t[:, None] * inv[None, :]
    emb = torch.cat((freqs, freqs), -1)
    return ((emb.cos() * view.attention_scaling).to(view.dtype), (emb.sin() * view.attention_scaling).to(view.dtype))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), -1)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + _rotate_half(x) * sin


def _rms(w: torch.Tensor, h: torch.Tensor, eps: float) -> torch.Tensor:
    hf = h.float()
    hf = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
    return w * hf.to(h.dtype)


def _rms_noisy(w: torch.Tensor, z: torch.Tensor, h: torch.Tensor, eps: float) -> torch.Tensor:
    hf = h.float()
    hf = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
    return ((w.float() + z) * hf).to(h.dtype)


def _rope_qk(q, k, cos, sin):
    return rope(q, cos, sin), rope(k, cos, sin)


def _add_rms(h: torch.Tensor, d: torch.Tensor, w: torch.Tensor, eps: float):
    """Residual add then RMSNorm: ``(h + d, rms(h + d))`` (one kernel when compiled)."""
    s = h + d
    return s, _rms(w, s, eps)


def _add_rms_noisy(h: torch.Tensor, d: torch.Tensor, w: torch.Tensor, z: torch.Tensor, eps: float):
    s = h + d
    return s, _rms_noisy(w, z, s, eps)


def _silu_mul(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    return F.silu(g) * u


def _rope_write(q, k, v, cos, sin, k_rows, v_rows, flat, rope_qk=_rope_qk):
    """One decode step's rotary on ``q [B, Hq, D]`` / ``k [B, Hkv, D]`` (``cos`` / ``sin [B, D]``) and the k / v
    cache writes at rows ``flat [B]`` of ``k_rows`` / ``v_rows [R, Hkv, D]``; returns the rotated q (eager torch,
    the activation dtype op by op: the reference of ``qerl_kernels.rope_cache``; ``rope_qk``: the compiled rotary
    where the kernel does not run)."""
    q, k = rope_qk(q, k, cos[:, None, :], sin[:, None, :])
    k_rows.index_copy_(0, flat, k)
    v_rows.index_copy_(0, flat, v)
    return q


class Elementwise:
    """The elementwise parts of a layer (RMSNorm, residual add + RMSNorm, rotary embedding, SiLU gate): eager
    torch (several kernels each), or the same functions through ``torch.compile`` (one fused Triton kernel
    each: on CUDA a decode step is ~35 kernels per layer shorter); compiled on CUDA, the norms and the gate are
    :mod:`qerl_kernels.norm`'s launches (:data:`NORM_KERNELS`). ``rope_write`` (a decode step's rotary + k / v
    cache writes): compiled, the one-launch Triton kernel :mod:`qerl_kernels.rope_cache` (fp32 math, one rounding,
    as the compiled rotary) where it imports, else the compiled rotary and two ``index_copy_``."""

    def __init__(self, compiled: bool = False, norm_kernels: bool | None = None):
        """``norm_kernels``: the norms and the gate through :mod:`qerl_kernels.norm` on CUDA (default: when compiled
        and :data:`NORM_KERNELS` is on). Those launches are forward-only; a call on tensors autograd tracks takes
        the compiled function (which has a backward) in any case."""
        fns = (_rms, _rms_noisy, _rope_qk, _add_rms, _add_rms_noisy, _silu_mul)
        if compiled:
            fns = tuple(torch.compile(f, dynamic=True, fullgraph=True) for f in fns)
        self.rms, self.rms_noisy, self.rope_qk, self.add_rms, self.add_rms_noisy, self.silu_mul = fns
        self.norm_kernels = False
        if compiled and (NORM_KERNELS[0] if norm_kernels is None else norm_kernels):
            self._norm_kernels()
        self.rope_write = _rope_write
        if compiled:
            rope_qk = self.rope_qk

            def _compiled_rope_write(q, k, v, cos, sin, k_rows, v_rows, flat):
                kernel = _rope_kernel() if q.is_cuda else None
                if kernel is not None:
                    return kernel(q, k, v, cos, sin, k_rows, v_rows, flat)
                return _rope_write(q, k, v, cos, sin, k_rows, v_rows, flat, rope_qk)

            self.rope_write = _compiled_rope_write
        self.compiled = compiled

    def _norm_kernels(self) -> None:
        """On CUDA tensors, the norms and the SiLU gate through :mod:`qerl_kernels.norm` (one Triton launch each,
        able to join the decode step's launch chain) instead of the compiled functions (kept elsewhere)."""
        k = _norm_module()
        if k is None:
            return
        rms, rms_noisy, add_rms, add_rms_noisy, silu_mul = (self.rms, self.rms_noisy, self.add_rms,
                                                            self.add_rms_noisy, self.silu_mul)
        ok = _kernel_ok
        self.rms = lambda w, h, eps: k.rms_norm(h, w, eps) if ok(h, w) else rms(w, h, eps)
        self.rms_noisy = (lambda w, z, h, eps: k.rms_norm(h, w, eps, z=z) if ok(h, w, z)
                          else rms_noisy(w, z, h, eps))
        self.add_rms = lambda h, d, w, eps: k.rms_norm(h, w, eps, d=d) if ok(h, d, w) else add_rms(h, d, w, eps)
        self.add_rms_noisy = (lambda h, d, w, z, eps: k.rms_norm(h, w, eps, d=d, z=z) if ok(h, d, w, z)
                              else add_rms_noisy(h, d, w, z, eps))
        self.silu_mul = lambda g, u: k.silu_mul(g, u) if ok(g, u) else silu_mul(g, u)
        self.norm_kernels = True


#: the devices whose tensors :mod:`qerl_kernels.norm` takes (a test widens it to run the routing on CPU)
KERNEL_DEVICES = ("cuda",)


def _kernel_ok(*ts: torch.Tensor) -> bool:
    """Whether a norm / gate call may take the Triton launch: every tensor on a kernel device with a unit last
    stride, and none that autograd tracks — the launches have no backward, so a tracked call (the update phase)
    takes the compiled function, whose gradient is the eager one's."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in ts):
        return False
    return all(t.device.type in KERNEL_DEVICES and t.stride(-1) == 1 for t in ts)


#: compiled engines run the norms and the SiLU gate on CUDA through :mod:`qerl_kernels.norm` (False: the
#: ``torch.compile``'d functions, Inductor kernels, which end the decode step's launch chain three times a layer)
NORM_KERNELS = [True]


@functools.cache
def _norm_module():
    """:mod:`qerl_kernels.norm`, or None where the kernels do not import (looked up once)."""
    try:
        from qerl_kernels import norm
    except ImportError:
        return None
    return norm


@functools.cache
def _rope_kernel():
    """``qerl_kernels.rope_cache.rope_cache_write``, or None where the kernels do not import (looked up once)."""
    try:
        from qerl_kernels.rope_cache import rope_cache_write
    except ImportError:
        return None
    return rope_cache_write


EAGER = Elementwise(False)


def norm(n: Norm, h: torch.Tensor, noisy: bool, ew: Elementwise = EAGER) -> torch.Tensor:
    if noisy and n.noise is not None:
        return ew.rms_noisy(n.weight, n.noise, h, n.eps)
    return ew.rms(n.weight, h, n.eps)


def add_norm(n: Norm, h: torch.Tensor, d: torch.Tensor, noisy: bool, ew: Elementwise = EAGER):
    """``(h + d, norm(h + d))``: the residual add fused with the next norm."""
    if noisy and n.noise is not None:
        return ew.add_rms_noisy(h, d, n.weight, n.noise, n.eps)
    return ew.add_rms(h, d, n.weight, n.eps)


def _mlp(layer, x: torch.Tensor, ew: Elementwise = EAGER) -> torch.Tensor:
    if layer.gate_up is not None:
        g, u = layer.gate_up(x).split(layer.gate_up.rows, -1)
        return layer.down(ew.silu_mul(g, u))
    return layer.down(ew.silu_mul(layer.gate(x), layer.up(x)))


def _qkv(layer, x: torch.Tensor):
    if layer.qkv is not None:
        return layer.qkv(x).split(layer.qkv.rows, -1)
    return layer.q(x), layer.k(x), layer.v(x)


def _head(view: ModelView, h: torch.Tensor) -> torch.Tensor:
    """fp32 logits ``[B, V]``: the lm_head GEMM with fp32 output, as the trainer's recomputation computes
    them (:func:`qerl.ops.logits.module_logits`), so the two log-probs differ only by the layers' rounding."""
    return module_logits(view.lm_head, h)


def prefill(view: ModelView, kc: list, vc: list, cos, sin, ids: torch.Tensor, lengths: torch.Tensor,
            slots: torch.Tensor, noisy: bool, ew: Elementwise = EAGER) -> torch.Tensor:
    """``ids [B, P]`` right-padded prompts (row b real for ``lengths[b]`` tokens) into ``slots [B]``;
    returns the fp32 logits ``[B, V]`` at each row's last prompt token. Padded positions write junk K/V
    beyond each row's length, which decoding overwrites before anything reads it."""
    B, P = ids.shape
    H, D, Hq, Hkv = view.hidden, view.head_dim, view.heads, view.kv_heads
    h = view.embed(ids)
    c, s = cos[:P][None, :, None, :], sin[:P][None, :, None, :]
    for i, layer in enumerate(view.layers):
        q, k, v = _qkv(layer, norm(layer.input_norm, h, noisy, ew))
        q, k = ew.rope_qk(q.reshape(B, P, Hq, D), k.reshape(B, P, Hkv, D), c, s)
        v = v.reshape(B, P, Hkv, D)
        kc[i][slots, :P] = k
        vc[i][slots, :P] = v
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                           scale=D ** -0.5, enable_gqa=Hq != Hkv)
        h = h + layer.o(a.transpose(1, 2).reshape(B, P, Hq * D))
        h = h + _mlp(layer, norm(layer.post_norm, h, noisy, ew), ew)
    last = h[torch.arange(B, device=h.device), lengths - 1]
    return _head(view, norm(view.final_norm, last, noisy, ew))


def decode_step(view: ModelView, kc: list, vc: list, cos, sin, tok: torch.Tensor, pos: torch.Tensor,
                slot: torch.Tensor, noisy: bool, attention, ew: Elementwise = EAGER) -> torch.Tensor:
    """One token per row: ``tok [B]`` at position ``pos [B]`` of slot ``slot [B]``; writes its K/V and
    returns the fp32 logits ``[B, V]`` of the next token. ``attention(q, k_cache, v_cache, slot, lengths,
    scale)`` is the decode attention (Triton flash-decoding or the torch reference)."""
    B = tok.shape[0]
    D, Hq, Hkv = view.head_dim, view.heads, view.kv_heads
    h = view.embed(tok)
    c, s = cos[pos], sin[pos]
    lengths = pos + 1
    layers = view.layers
    flat = slot * kc[0].shape[1] + pos  # each row's cache row (slot, position) in every layer
    x = norm(layers[0].input_norm, h, noisy, ew)
    for i, layer in enumerate(layers):
        q, k, v = _qkv(layer, x)
        q = ew.rope_write(q.reshape(B, Hq, D), k.reshape(B, Hkv, D), v.reshape(B, Hkv, D), c, s,
                          kc[i].view(-1, Hkv, D), vc[i].view(-1, Hkv, D), flat)
        a = attention(q, kc[i], vc[i], slot, lengths, D ** -0.5)
        h, x = add_norm(layer.post_norm, h, layer.o(a.reshape(B, Hq * D)), noisy, ew)
        nxt = layers[i + 1].input_norm if i + 1 < len(layers) else view.final_norm
        h, x = add_norm(nxt, h, _mlp(layer, x, ew), noisy, ew)
    return _head(view, x)
