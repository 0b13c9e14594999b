"""Rotary embedding of one decode step's q and k, and the k / v cache writes, in one launch (was three per layer:
the rotary kernel and two ``index_copy_``).

For row ``b`` (position ``pos_b``, cache row ``flat_b = slot_b · T + pos_b``) with ``cos_b, sin_b [D]`` (the
activation dtype, as transformers' rotary tables):

    q_out[b, h]      = q[b, h] · cos_b + rotate_half(q[b, h]) · sin_b          h < Hq
    k_cache[flat_b, h] = k[b, h] · cos_b + rotate_half(k[b, h]) · sin_b        h < Hkv
    v_cache[flat_b, h] = v[b, h]

``rotate_half(x) = (-x[D/2:], x[:D/2])``. Computed in fp32, rounded once to the activation dtype (what the
``torch.compile``'d rotary the engine ran before produces). Reference: :func:`reference` (plain torch, the engine's
eager path).

Shapes / dtypes: ``q [B, Hq, D]``, ``k`` / ``v [B, Hkv, D]`` (any row / head strides, unit last stride: views of the
fused q/k/v projection's output), ``cos`` / ``sin [B, D]``, ``k_cache`` / ``v_cache [R, Hkv, D]`` contiguous (the
slot cache viewed as rows), ``flat [B]`` int64 -> ``q_out [B, Hq, D]`` contiguous. No host sync (CUDA graphs). Inside
:func:`qerl_kernels.launch.chain` a programmatic dependent launch.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from qerl_kernels import launch


def reference(q, k, v, cos, sin, k_cache, v_cache, flat):
    """The definition in torch (fp32 math, one rounding); writes the caches, returns ``q_out``."""
    c, s = cos.float()[:, None, :], sin.float()[:, None, :]

    def rope(x):
        xf = x.float()
        h = xf.shape[-1] // 2
        return (xf * c + torch.cat((-xf[..., h:], xf[..., :h]), -1) * s).to(x.dtype)

    k_cache.index_copy_(0, flat, rope(k))
    v_cache.index_copy_(0, flat, v)
    return rope(q)


@triton.jit
def _rope_cache_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, kc_ptr, vc_ptr, flat_ptr, qo_ptr,
                       sqb, sqh, skb, skh, svb, svh, scb, Hq, Hkv, D: tl.constexpr, HB: tl.constexpr,
                       PDL: tl.constexpr = False):
    """Program (row b, head block j): heads ``j·HB … `` of the ``Hq + Hkv`` rotated heads (q first, then k with
    their v copied along). ``PDL``: a programmatic dependent in the decode step's launch chain (releases the next
    launch, then waits for the previous grid before its first load)."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    b = tl.program_id(0)
    hs = tl.program_id(1) * HB + tl.arange(0, HB)
    d = tl.arange(0, D)
    half = D // 2
    rot = tl.where(d < half, d + half, d - half)  # rotate_half's source column
    sign = tl.where(d < half, -1.0, 1.0)
    c = tl.load(cos_ptr + b * scb + d).to(tl.float32)[None, :]
    s = tl.load(sin_ptr + b * scb + d).to(tl.float32)[None, :]
    b64 = b.to(tl.int64)
    is_q = hs < Hq
    is_k = (hs >= Hq) & (hs < Hq + Hkv)
    hq = tl.where(is_q, hs, 0)
    hk = tl.where(is_k, hs - Hq, 0)
    src = tl.where(is_q[:, None], q_ptr + b64 * sqb + hq[:, None] * sqh, k_ptr + b64 * skb + hk[:, None] * skh)
    live = (is_q | is_k)[:, None]
    x = tl.load(src + d[None, :], mask=live, other=0.0)
    xr = tl.load(src + rot[None, :], mask=live, other=0.0)
    y = (x.to(tl.float32) * c + sign[None, :] * xr.to(tl.float32) * s).to(x.dtype)
    tl.store(qo_ptr + (b64 * Hq + hq[:, None]) * D + d[None, :], y, mask=is_q[:, None])
    row = tl.load(flat_ptr + b)
    dst = (row * Hkv + hk[:, None]) * D + d[None, :]
    tl.store(kc_ptr + dst, y, mask=is_k[:, None])
    vv = tl.load(v_ptr + b64 * svb + hk[:, None] * svh + d[None, :], mask=is_k[:, None], other=0.0)
    tl.store(vc_ptr + dst, vv, mask=is_k[:, None])


def rope_cache_write(q, k, v, cos, sin, k_cache, v_cache, flat, heads_per_program: int = 8):
    """See module docstring; returns ``q_out``."""
    B, Hq, D = q.shape
    Hkv = k.shape[1]
    if D & (D - 1) or q.stride(2) != 1 or k.stride(2) != 1 or v.stride(2) != 1 or cos.stride(1) != 1:
        raise ValueError(f"rope_cache_write: head_dim must be a power of two with unit stride, got q {tuple(q.shape)} "
                         f"strides {q.stride()}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()) or k_cache.shape[1:] != (Hkv, D):
        raise ValueError(f"rope_cache_write: caches must be contiguous [rows, {Hkv}, {D}], got "
                         f"{tuple(k_cache.shape)}")
    out = torch.empty((B, Hq, D), device=q.device, dtype=q.dtype)
    HB = min(heads_per_program, triton.next_power_of_2(Hq + Hkv))
    grid = (B, launch.cdiv(Hq + Hkv, HB))
    pdl = launch.chained() and q.is_cuda
    _rope_cache_kernel[grid](q, k, v, cos, sin, k_cache, v_cache, flat, out, q.stride(0), q.stride(1), k.stride(0),
                             k.stride(1), v.stride(0), v.stride(1), cos.stride(0), Hq, Hkv, D=D, HB=HB, PDL=pdl,
                             num_warps=4, **({"launch_pdl": True} if pdl else {}))
    return out
