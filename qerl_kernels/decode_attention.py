"""Decode attention over a slot KV cache (flash-decoding, split-K, grouped-query).

One new query token per row attends to the first ``lengths[b]`` positions of its cache slot:

    out[b, h] = softmax(q[b, h] · K[slot[b], :len_b, h // G]ᵀ · scale) · V[slot[b], :len_b, h // G]

Shapes / dtypes:
  ``q``       [B, Hq, D]            bf16 / fp16 / fp32 (the query of the new token, rotary applied)
  ``k_cache`` [S, T, Hkv, D]        same dtype; ``v_cache`` likewise (S slots, T positions)
  ``slot``    [B] int64             cache slot of each row; ``lengths`` [B] int64 (1 <= len <= T)
  returns     [B, Hq, D]            q's dtype; G = Hq / Hkv query heads share one KV head (GQA).

Hardware: any CUDA GPU Triton supports (fp32 accumulation; the ``q·Kᵀ`` and ``p·V`` products on tensor
cores through ``tl.dot`` with the G query heads of a KV head padded to 16 rows). Work split: programs over
(row, KV head, split); each split covers ``ceil(T / SPLITS)`` positions and returns a partial
(max, sum, weighted V) that :func:`_attn_combine_kernel` merges — the flash-decoding scheme, so a batch of a few rows
still fills the GPU. Programs whose range starts past ``len_b`` exit at once: a step costs what the
sequences' *current* lengths read, not the cache's capacity. ``lengths`` and ``slot`` are device tensors
read by the kernel, so one CUDA graph serves every step. Inside :func:`qerl_kernels.launch.chain` both launches are
programmatic dependents (each releases the next launch at its start and waits for the previous grid first).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from qerl_kernels import launch


def reference(q, k_cache, v_cache, slot, lengths, scale: float):
    """The definition in plain torch (gathers the rows' slots: a copy, fine for tests and the CPU)."""
    B, Hq, D = q.shape
    Hkv = k_cache.shape[2]
    G = Hq // Hkv
    k = k_cache[slot].float()  # [B, T, Hkv, D]
    v = v_cache[slot].float()
    qg = q.float().view(B, Hkv, G, D)
    s = torch.einsum("bhgd,bthd->bhgt", qg, k) * scale
    T = k.shape[1]
    keep = torch.arange(T, device=q.device)[None, :] < lengths[:, None]  # [B, T]
    s = s.masked_fill(~keep[:, None, None, :], float("-inf"))
    p = s.softmax(-1)
    return torch.einsum("bhgt,bthd->bhgd", p, v).reshape(B, Hq, D).to(q.dtype)


@triton.jit
def _attn_partial_kernel(q_ptr, k_ptr, v_ptr, slot_ptr, len_ptr, m_ptr, l_ptr, acc_ptr,
                    scale, CHUNK,
                    sq_b, sq_h, sk_s, sk_t, sk_h, sv_s, sv_t, sv_h,
                    Hq, SPLITS,
                    G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BN: tl.constexpr, FP32_DOT: tl.constexpr,
                    IEEE: tl.constexpr, PDL: tl.constexpr = False):
    if PDL:  # a programmatic dependent in the decode step's launch chain: release the next, wait for the previous
        gdc_launch_dependents()
        gdc_wait()
    b = tl.program_id(0)
    hk = tl.program_id(1)
    sp = tl.program_id(2)
    length = tl.load(len_ptr + b)
    slot = tl.load(slot_ptr + b)
    start = sp * CHUNK
    end = tl.minimum(start + CHUNK, length)
    g = tl.arange(0, GP)  # query heads of this KV head (padded to GP rows)
    d = tl.arange(0, D)
    gmask = g < G
    heads = hk * G + g
    out_row = (b * Hq + heads) * SPLITS + sp  # [GP] rows of the partial buffers
    if start >= length:  # nothing to read: an empty partial
        tl.store(m_ptr + out_row, tl.full([GP], float("-inf"), tl.float32), mask=gmask)
        tl.store(l_ptr + out_row, tl.zeros([GP], tl.float32), mask=gmask)
        return
    q = tl.load(q_ptr + b * sq_b + heads[:, None] * sq_h + d[None, :], mask=gmask[:, None], other=0.0)  # [GP, D]
    if FP32_DOT:  # the CPU interpreter multiplies bf16 bits in tl.dot (platform.md)
        q = q.to(tl.float32)
    m = tl.full([GP], float("-inf"), tl.float32)
    l = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    kbase = k_ptr + slot.to(tl.int64) * sk_s + hk * sk_h
    vbase = v_ptr + slot.to(tl.int64) * sv_s + hk * sv_h
    for t0 in range(start, end, BN):
        t = t0 + tl.arange(0, BN)
        tmask = t < end
        k = tl.load(kbase + t[:, None] * sk_t + d[None, :], mask=tmask[:, None], other=0.0)  # [BN, D]
        v = tl.load(vbase + t[:, None] * sv_t + d[None, :], mask=tmask[:, None], other=0.0)
        if FP32_DOT:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        if IEEE:  # fp32 activations: full-precision products (no TF32), as torch's fp32 attention
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # [GP, BN] fp32
        else:
            s = tl.dot(q, tl.trans(k)) * scale
        s = tl.where(tmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new
    tl.store(m_ptr + out_row, m, mask=gmask)
    tl.store(l_ptr + out_row, l, mask=gmask)
    tl.store(acc_ptr + out_row[:, None] * D + d[None, :], acc, mask=gmask[:, None])


@triton.jit
def _attn_combine_kernel(m_ptr, l_ptr, acc_ptr, out_ptr, SPLITS, so_b, so_h, Hq,
                    SP: tl.constexpr, D: tl.constexpr, PDL: tl.constexpr = False):
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, SP)
    d = tl.arange(0, D)
    smask = s < SPLITS
    row = (b * Hq + h) * SPLITS + s
    m = tl.load(m_ptr + row, mask=smask, other=float("-inf"))
    l = tl.load(l_ptr + row, mask=smask, other=0.0)
    mx = tl.max(m, 0)
    w = tl.where(smask & (m > float("-inf")), tl.exp(m - mx), 0.0)  # split 0 always holds position 0
    acc = tl.load(acc_ptr + row[:, None] * D + d[None, :], mask=(smask & (m > float("-inf")))[:, None], other=0.0)
    o = tl.sum(acc * w[:, None], 0) / tl.sum(l * w, 0)
    tl.store(out_ptr + b * so_b + h * so_h + d, o.to(out_ptr.dtype.element_ty))


def splits_for(batch: int, kv_heads: int, max_len: int, sms: int = 132, block: int = 64) -> int:
    """Splits so that rows × KV heads × splits covers ~2 waves of the SMs, at most one per ``block``
    positions of the cache (a short cache is never cut finer than a tile)."""
    want = max(1, math.ceil(2 * sms / max(1, batch * kv_heads)))
    return max(1, min(want, math.ceil(max_len / block), 64))


def decode_attention(q, k_cache, v_cache, slot, lengths, scale: float, splits: int | None = None,
                     block: int = 64, num_warps: int = 4, num_stages: int | None = None) -> torch.Tensor:
    """Flash-decoding attention (see module docstring). ``splits`` defaults to :func:`splits_for`; ``num_warps`` /
    ``num_stages``: the partial kernel's (Triton's default pipeline depth when None)."""
    B, Hq, D = q.shape
    S, T, Hkv, Dk = k_cache.shape
    if Dk != D or Hq % Hkv or v_cache.shape != k_cache.shape or D & (D - 1) or D < 16:
        raise ValueError(f"decode_attention: q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}, v_cache "
                         f"{tuple(v_cache.shape)}: need Hq % Hkv == 0, matching caches and a power-of-two D >= 16")
    if k_cache.stride(3) != 1 or v_cache.stride(3) != 1 or q.stride(2) != 1:
        raise ValueError("decode_attention: the head dimension of q and the caches must be contiguous")
    G = Hq // Hkv
    if splits is None:
        sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 4
        splits = splits_for(B, Hkv, T, sms, block)
    chunk = math.ceil(T / splits)
    chunk = math.ceil(chunk / block) * block
    splits = math.ceil(T / chunk)
    m = torch.empty(B * Hq * splits, device=q.device, dtype=torch.float32)
    l = torch.empty_like(m)
    acc = torch.empty(B * Hq * splits, D, device=q.device, dtype=torch.float32)
    out = torch.empty(B, Hq, D, device=q.device, dtype=q.dtype)
    interp = not q.is_cuda
    pdl = launch.chained() and not interp
    chain = {"launch_pdl": True} if pdl else {}
    _attn_partial_kernel[(B, Hkv, splits)](
        q, k_cache, v_cache, slot, lengths, m, l, acc, scale, chunk,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), Hq, splits,
        G=G, GP=max(16, triton.next_power_of_2(G)), D=D, BN=block, FP32_DOT=interp,
        IEEE=q.dtype == torch.float32 or interp, PDL=pdl, num_warps=num_warps,
        **({"num_stages": num_stages} if num_stages else {}), **chain)
    _attn_combine_kernel[(B, Hq)](m, l, acc, out, splits, out.stride(0), out.stride(1), Hq,
                                  SP=max(2, triton.next_power_of_2(splits)), D=D, PDL=pdl, num_warps=1, **chain)
    return out
