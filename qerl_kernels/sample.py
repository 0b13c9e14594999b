"""Fused Gumbel-max sampling over fp32 logits: the rollout engine's draw in two launches instead of ~25.

The definition (:func:`qerl.rollout.sampling.sample` without top-k / top-p, the reference this kernel is
checked against): for row ``b`` at generation step ``t_b``,

    u_v  = (hash(seed_b, t_b, v) >> 9 + 0.5) · 2^-23          (counter-based uniforms, 23 bits, in (0, 1))
    g_v  = -log(-log u_v)                                     (Gumbel noise)
    tok  = argmax_v (logits_v · τ + g_v)                      (first index on ties; T = 0: argmax_v logits_v)
    lp   = log_softmax(logits · τ)_tok                         (T = 0: log_softmax(logits)_tok)

with ``τ = float32(1 / T)`` — an exact draw from ``softmax(logits / T)`` (Gumbel 1954; the paper's rollouts sample at
T = 1 without filters, so every rollout step takes this path; checked on an H100: 0 token mismatches in 15,792 draws,
``python -m qerl.bench.engine_check --sampler``). The torch definition runs it as ~25 kernels over
``[B, V]`` tensors, int64 for the hash (7B, V = 152,064: ~17 µs per row on an H100, 1.1 ms of a 64-row decode
step). Here: programs over (row, vocabulary chunk) stream the chunk once — hash, Gumbel noise, running
argmax and an online log-sum-exp — and leave a partial ``(best value, its index, max, sum of exp)`` per chunk;
:func:`_sample_combine_kernel` merges a row's chunks (in chunk order, so ties go to the first index as in
``torch.argmax``) and reads the chosen token's logit for its log-prob.

Exactness: the hash is 32-bit unsigned arithmetic (the torch definition's int64 values masked to 32 bits are the
same numbers), the uint → fp32 conversion and the Gumbel logs round as torch's (``libdevice.log`` is CUDA's
``logf``), ``logits · τ`` is one fp32 product as torch's: the tokens are torch's; the log-prob differs from
torch's ``log_softmax`` by the order of its sums (a few fp32 ulps).

Shapes / dtypes: ``logits [B, V]`` fp32 (unit column stride), ``seed [B]`` int64 (values < 2^32), ``step`` int64
``[B]`` or a 0-d tensor (one step for all rows) -> ``(tok [B] int64, lp [B] fp32)``. No host sync: capturable in
a CUDA graph (the engine's decode step).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from qerl_kernels import launch
from qerl_kernels.nvfp4_wgmma import _sms

BLOCK = 1024  # vocabulary entries per loop iteration of a program


@triton.jit
def _mix(x):
    """The 32-bit avalanche hash of :func:`qerl.rollout.sampling._mix` (uint32 in, uint32 out)."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x5BD1E995
    return x ^ (x >> 16)


@triton.jit
def _log(x, LIBDEVICE: tl.constexpr):
    """Natural log: CUDA's ``logf`` (what torch's ``log`` runs) on the GPU; ``tl.log`` in the CPU interpreter
    (which has no libdevice)."""
    if LIBDEVICE:
        return libdevice.log(x)
    else:
        return tl.log(x)


@triton.jit
def _sample_partial_kernel(logits_ptr, stride_b, seed_ptr, step_ptr, stride_step, pv_ptr, pi_ptr, pm_ptr, ps_ptr,
                    V, CHUNK, NC, inv_t, GREEDY: tl.constexpr, BLOCK: tl.constexpr,
                    LIBDEVICE: tl.constexpr):
    """Program (row b, chunk c): entries ``c·CHUNK … min(V, (c+1)·CHUNK) - 1`` -> partial ``[b, c]``:
    best ``logits · τ + g`` and its first index, max of ``logits · τ`` and ``Σ exp(logits · τ - max)``."""
    b = tl.program_id(0)
    c = tl.program_id(1)
    seed = tl.load(seed_ptr + b).to(tl.uint32)
    step = tl.load(step_ptr + b * stride_step).to(tl.uint32)
    key = _mix(seed ^ _mix(step * 0x9E37 + 0x632B))
    mul = key * 0x10001
    lo = c * CHUNK
    hi = tl.minimum(V, lo + CHUNK)
    best = tl.full([], float("-inf"), tl.float32)
    best_i = tl.full([], 0, tl.int32) + lo
    m = tl.full([], float("-inf"), tl.float32)
    s = tl.full([], 0.0, tl.float32)
    row = logits_ptr + b.to(tl.int64) * stride_b
    for start in range(lo, hi, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < hi
        x = tl.load(row + offs, mask=mask, other=float("-inf"))
        if GREEDY:
            scaled = x
            val = x
        else:
            scaled = x * inv_t
            h = _mix(offs.to(tl.uint32) + mul)
            u = ((h >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07  # · 2^-23
            val = scaled - _log(-_log(u, LIBDEVICE), LIBDEVICE)
            val = tl.where(mask, val, float("-inf"))
        bm = tl.max(val, axis=0)
        bi = tl.argmax(val, axis=0, tie_break_left=True)
        take = bm > best  # strictly: an earlier block keeps a tie
        best_i = tl.where(take, start + bi, best_i)
        best = tl.where(take, bm, best)
        m_new = tl.maximum(m, tl.max(scaled, axis=0))
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        s = s * tl.exp(m - shift) + tl.sum(tl.exp(scaled - shift), axis=0)
        m = m_new
    o = b * NC + c
    tl.store(pv_ptr + o, best)
    tl.store(pi_ptr + o, best_i)
    tl.store(pm_ptr + o, m)
    tl.store(ps_ptr + o, s)


@triton.jit
def _sample_combine_kernel(logits_ptr, stride_b, pv_ptr, pi_ptr, pm_ptr, ps_ptr, tok_ptr, lp_ptr, NC, inv_t,
                    GREEDY: tl.constexpr, NCP: tl.constexpr):
    """Row b: its ``NC`` partials -> the token (first chunk on ties) and ``logits_tok · τ - logsumexp``."""
    b = tl.program_id(0)
    c = tl.arange(0, NCP)
    mask = c < NC
    pv = tl.load(pv_ptr + b * NC + c, mask=mask, other=float("-inf"))
    pi = tl.load(pi_ptr + b * NC + c, mask=mask, other=0)
    pm = tl.load(pm_ptr + b * NC + c, mask=mask, other=float("-inf"))
    ps = tl.load(ps_ptr + b * NC + c, mask=mask, other=0.0)
    j = tl.argmax(pv, axis=0, tie_break_left=True)
    tok = tl.sum(tl.where(c == j, pi, 0), axis=0)
    m = tl.max(pm, axis=0)
    shift = tl.where(m == float("-inf"), 0.0, m)
    total = tl.sum(tl.where(mask, ps * tl.exp(pm - shift), 0.0), axis=0)
    x = tl.load(logits_ptr + b.to(tl.int64) * stride_b + tok)
    if GREEDY:
        scaled = x
    else:
        scaled = x * inv_t
    tl.store(tok_ptr + b, tok.to(tl.int64))
    tl.store(lp_ptr + b, scaled - shift - tl.log(total))


def chunks_for(B: int, V: int, programs: int, block: int = BLOCK) -> int:
    """Vocabulary chunks per row so that ``B · chunks`` programs reach ``programs`` (each chunk a whole number
    of ``block``s, at least one)."""
    blocks = launch.cdiv(V, block)
    return max(1, min(blocks, launch.cdiv(programs, max(1, B))))


def gumbel_sample(logits: torch.Tensor, seed: torch.Tensor, step: torch.Tensor, temperature: float, *,
                  chunks: int | None = None, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """See module docstring. ``chunks``: vocabulary chunks per row (default: enough programs for two per SM on
    CUDA, 4 elsewhere)."""
    if logits.dim() != 2 or logits.dtype != torch.float32 or logits.stride(1) != 1:
        raise ValueError(f"gumbel_sample: logits must be [B, V] fp32 with unit column stride, got "
                         f"{tuple(logits.shape)} {logits.dtype} strides {logits.stride()}")
    if temperature < 0:
        raise ValueError(f"gumbel_sample: temperature must be >= 0, got {temperature}")
    B, V = logits.shape
    dev = logits.device
    if seed.shape != (B,):
        raise ValueError(f"gumbel_sample: seed must be [B] = [{B}], got {tuple(seed.shape)}")
    if step.dim() == 0:
        step_t, stride_step = step.reshape(1), 0
    elif step.shape == (B,):
        step_t, stride_step = step, step.stride(0)
    else:
        raise ValueError(f"gumbel_sample: step must be a 0-d tensor or [B] = [{B}], got {tuple(step.shape)}")
    if chunks is None:
        programs = 2 * _sms(dev) if dev.type == "cuda" else 4
        chunks = chunks_for(B, V, programs, block)
    chunk = launch.cdiv(launch.cdiv(V, chunks), block) * block
    NC = launch.cdiv(V, chunk)
    pv = torch.empty(B * NC, device=dev, dtype=torch.float32)
    pi = torch.empty(B * NC, device=dev, dtype=torch.int32)
    pm = torch.empty_like(pv)
    ps = torch.empty_like(pv)
    tok = torch.empty(B, device=dev, dtype=torch.int64)
    lp = torch.empty(B, device=dev, dtype=torch.float32)
    greedy = temperature == 0
    inv_t = 1.0 if greedy else 1.0 / float(temperature)  # an fp32 argument: float32(1 / T), as the definition
    _sample_partial_kernel[(B, NC)](logits, logits.stride(0), seed, step_t, stride_step, pv, pi, pm, ps, V, chunk, NC,
                                    inv_t, GREEDY=greedy, BLOCK=block,
                                    LIBDEVICE=os.environ.get("TRITON_INTERPRET", "0") != "1", num_warps=4)
    _sample_combine_kernel[(B,)](logits, logits.stride(0), pv, pi, pm, ps, tok, lp, NC, inv_t, GREEDY=greedy,
                                 NCP=max(2, triton.next_power_of_2(NC)), num_warps=1)
    return tok, lp
