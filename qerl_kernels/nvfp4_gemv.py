"""NVFP4 forward GEMV for decode sizes (1, 2 or 4 activation rows per program): CUDA-core FMAs, no
tensor cores, no shared memory. On the H200 the register-fragment MMA kernel (:mod:`.nvfp4_mmv`) beat it
on every tuned shape; it stays as MMV's fallback (unaligned rows, K % 32 != 0) and, through its
``FAST=False`` twin, as the path the CPU interpreter runs for MMV configs.

``y [M, N] = x [M, K] · Ŵᵀ (+ bias) (+ s · xa [M, R] · Bᵀ)`` with ``Ŵ = e2m1 · scale / gs`` read
straight from the packed compressed-tensors layout (``packed uint8 [N, K/2]``, ``scale`` E4M3
``[N, K/16]``, ``gs`` fp32 ``[1]``; ``../shared/docs/nvfp4.md``).

Why a second kernel: at decode sizes the tensor-core tiles of :mod:`.nvfp4_matmul` spend their
time moving the dequantized bf16 tile through shared memory into the MMA's fragment layout
(ncu on an H200: L1/TEX 91% busy, DRAM 19%). Here every thread keeps the weights it loads: it reads
whole 32-bit words (8 weights of one row), decodes them in registers and multiplies them with the
matching activations on the FMA pipes; the reduction over K stays in registers (one ``[BN, BK/8]``
accumulator per activation row) until one cross-thread sum at the end. Cost per weight: ~2.5 integer/bf16x2 instructions to decode,
one bf16->fp32 move, one FMA per activation row — which is why this path is for small M only.

Decoding one word ``q`` (nibble j = weight k = 8w + j; Marlin's ``dequant.h`` trick): the nibbles at
bits 12..15 and 28..31 become the bf16 pair ``(e2m1_3, e2m1_7) · 2^-126`` with
``(q & 0x80008000) | ((q & 0x70007000) >> 6)`` (sign -> bit 15, magnitude -> bits 6..8; the 0.5 code is
a bf16 subnormal), one ``mul.bf16x2`` by ``2^126`` makes it exact, then ``q <<= 4`` brings weights
(2, 6), (1, 5), (0, 4). The 16-weight group's partial sum is multiplied by its E4M3 scale in fp32 and
``1/gs`` is applied once per output (paper Eq. 1, ``Ŵ = FP4 · S_FP8 · S_FP32``): no weight is ever
rounded. ``FAST=False`` computes the same numbers with plain Triton arithmetic (``TRITON_INTERPRET``).
The readable reference is :func:`qerl.ops.linear.reference_forward`.
"""
from __future__ import annotations

import triton
import triton.language as tl

from qerl_kernels.nvfp4_matmul import _e2m1_to_f32, _e4m3_to_f32


# nibbles (3 - i, 7 - i) of word $4 -> bf16x2 pair $i times the bf16x2 $5 (also used by nvfp4_wgmma)
WORD_PAIRS_PTX = tl.constexpr("""
        {
        .reg .b32 q, t, u;
        mov.b32 q, $4;
        and.b32 t, q, 0x70007000; shr.u32 t, t, 6; and.b32 u, q, 0x80008000; or.b32 t, t, u; mul.rn.bf16x2 $0, t, $5;
        shl.b32 q, q, 4;
        and.b32 t, q, 0x70007000; shr.u32 t, t, 6; and.b32 u, q, 0x80008000; or.b32 t, t, u; mul.rn.bf16x2 $1, t, $5;
        shl.b32 q, q, 4;
        and.b32 t, q, 0x70007000; shr.u32 t, t, 6; and.b32 u, q, 0x80008000; or.b32 t, t, u; mul.rn.bf16x2 $2, t, $5;
        shl.b32 q, q, 4;
        and.b32 t, q, 0x70007000; shr.u32 t, t, 6; and.b32 u, q, 0x80008000; or.b32 t, t, u; mul.rn.bf16x2 $3, t, $5;
        }
        """)


@triton.jit
def _word_pairs(q, c):
    """int32 words (8 nibbles each) -> 4 int32 bf16x2 pairs: nibbles (3, 7), (2, 6), (1, 5), (0, 4) as
    exact e2m1 values (low half, high half)."""
    return tl.inline_asm_elementwise(
        asm=WORD_PAIRS_PTX,
        constraints="=r,=r,=r,=r,r,r",
        args=[q, c], dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1)


@triton.jit
def _pair(pairs, q, i: tl.constexpr, FAST: tl.constexpr):
    """fp32 (weight 3-i, weight 7-i) of every word ``q`` (int32 [...])."""
    if FAST:
        p = pairs[i]
        lo = (p << 16).to(tl.float32, bitcast=True)
        hi = (p & -65536).to(tl.float32, bitcast=True)
    else:
        lo = _e2m1_to_f32((q >> (4 * (3 - i))) & 15)
        hi = _e2m1_to_f32((q >> (4 * (7 - i))) & 15)
    return lo, hi


@triton.jit
def _row_part(part, lo, hi, xw, i: tl.constexpr, xmask, FIRST: tl.constexpr):
    """``part [BN, BW] (+)= lo · x[8w + 3 - i] + hi · x[8w + 7 - i]`` for one activation row
    (``xw [BW]``: pointers to x[8w] of the row)."""
    xl = tl.load(xw + (3 - i), mask=xmask, other=0.0).to(tl.float32)[None, :]
    xh = tl.load(xw + (7 - i), mask=xmask, other=0.0).to(tl.float32)[None, :]
    if FIRST:
        return lo * xl + hi * xh
    return part + lo * xl + hi * xh


@triton.jit
def _row_partial(acc, rn, m, M, N, part_ptr, pid_s):
    """Split reduction, step 1: this program's fp32 partial of row m -> ``part[pid_s, m, :]``."""
    tl.store(part_ptr + pid_s * M * N + m * N + rn, tl.sum(acc, axis=1), mask=(rn < N) & (m < M))


@triton.jit
def _row_out(acc, rn, m, M, N, part_ptr, gs, bias_ptr, xa_ptr, lb_ptr, out_ptr, stride_om, lora_scale, SPLIT,
             HAS_BIAS: tl.constexpr, R: tl.constexpr, USE_SPLIT: tl.constexpr):
    """Epilogue of one activation row: sum over words (or over the splits' partials), 1/gs, bias,
    LoRA ``s · xa[m] · Bᵀ``, store."""
    omask = (rn < N) & (m < M)
    if USE_SPLIT:
        y = tl.zeros((rn.shape[0],), dtype=tl.float32)
        for j in range(SPLIT):
            y += tl.load(part_ptr + j * M * N + m * N + rn, mask=omask, other=0.0, cache_modifier=".cg")
    else:
        y = tl.sum(acc, axis=1)  # [BN]
    y = y / gs
    if HAS_BIAS:
        y += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
    if R > 0:
        rr = tl.arange(0, R)
        xa = tl.load(xa_ptr + m * R + rr, mask=(rr < R) & (m < M), other=0.0).to(tl.float32)
        lb = tl.load(lb_ptr + rn[:, None] * R + rr[None, :], mask=(rn < N)[:, None], other=0.0).to(tl.float32)
        y += lora_scale * tl.sum(lb * xa[None, :], axis=1)
    tl.store(out_ptr + m * stride_om + rn, y.to(out_ptr.dtype.element_ty), mask=omask)


@triton.jit(do_not_specialize=["M", "SPLIT"])
def _nvfp4_gemv_kernel(
    x_ptr, wp_ptr, ws_ptr, gs_ptr, out_ptr, bias_ptr, xa_ptr, lb_ptr, part_ptr, lock_ptr,
    M, N, K, stride_xm, stride_om, stride_wn, stride_sn, lora_scale, SPLIT,
    HAS_BIAS: tl.constexpr, R: tl.constexpr, USE_SPLIT: tl.constexpr, EVEN_K: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, FAST: tl.constexpr,
):
    # program (pid_n, pid_m, pid_s): rows pid_m*BM .. +BM (BM <= 4, one accumulator each) x output
    # columns [BN], K tiles pid_s::SPLIT-th share of the loop. stride_wn is in 32-bit words (K / 8).
    tl.static_assert(BM == 1 or BM == 2 or BM == 4, "GEMV handles 1, 2 or 4 activation rows per program")
    BW: tl.constexpr = BK // 8  # words per row per K tile
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_s = tl.program_id(2)
    m0 = pid_m * BM
    rn = pid_n * BN + tl.arange(0, BN)
    wq_ptr = wp_ptr.to(tl.pointer_type(tl.int32))
    x0 = x_ptr + m0 * stride_xm
    acc0 = tl.zeros((BN, BW), dtype=tl.float32)
    acc1 = tl.zeros((BN, BW), dtype=tl.float32)
    acc2 = tl.zeros((BN, BW), dtype=tl.float32)
    acc3 = tl.zeros((BN, BW), dtype=tl.float32)
    k_tiles = tl.cdiv(K, BK)
    per_split = tl.cdiv(k_tiles, SPLIT)
    t0 = pid_s * per_split
    rw = t0 * BW + tl.arange(0, BW)  # word index within the row; its scale group is rw // 2
    q_ptrs = wq_ptr + rn[:, None] * stride_wn + rw[None, :]  # advanced by BW words per K tile
    s_ptrs = ws_ptr + rn[:, None] * stride_sn + (rw // 2)[None, :]
    x_ptrs = x0 + rw * 8
    for t in range(t0, tl.minimum(k_tiles, t0 + per_split)):
        wmask = (rn < N)[:, None]
        xm = rw >= 0
        if not EVEN_K:
            wmask = wmask & (rw < K // 8)[None, :]
            xm = rw < K // 8
        q = tl.load(q_ptrs, mask=wmask, other=0, eviction_policy="evict_first")  # [BN, BW] int32
        sb = tl.load(s_ptrs, mask=wmask, other=0, eviction_policy="evict_first")  # [BN, BW] uint8 (word's scale)
        if FAST:
            sw = sb.to(tl.float8e4nv, bitcast=True).to(tl.float32)
            pairs = _word_pairs(q, tl.full(q.shape, 0x7E807E80, tl.int32))  # bf16x2 (2^126, 2^126)
        else:
            sw = _e4m3_to_f32(sb.to(tl.int32))
            pairs = q
        p0 = acc0
        p1 = acc1
        p2 = acc2
        p3 = acc3
        for i in tl.static_range(4):
            lo, hi = _pair(pairs, q, i, FAST)
            p0 = _row_part(p0, lo, hi, x_ptrs, i, xm & (m0 < M), i == 0)
            if BM > 1:
                p1 = _row_part(p1, lo, hi, x_ptrs + stride_xm, i, xm & (m0 + 1 < M), i == 0)
            if BM > 2:
                p2 = _row_part(p2, lo, hi, x_ptrs + 2 * stride_xm, i, xm & (m0 + 2 < M), i == 0)
                p3 = _row_part(p3, lo, hi, x_ptrs + 3 * stride_xm, i, xm & (m0 + 3 < M), i == 0)
        acc0 += p0 * sw
        if BM > 1:
            acc1 += p1 * sw
        if BM > 2:
            acc2 += p2 * sw
            acc3 += p3 * sw
        q_ptrs += BW
        s_ptrs += BW // 2
        x_ptrs += BK
        rw += BW
    last = True
    if USE_SPLIT:  # one ticket per program; the last program of the tile reduces every row
        _row_partial(acc0, rn, m0, M, N, part_ptr, pid_s)
        if BM > 1:
            _row_partial(acc1, rn, m0 + 1, M, N, part_ptr, pid_s)
        if BM > 2:
            _row_partial(acc2, rn, m0 + 2, M, N, part_ptr, pid_s)
            _row_partial(acc3, rn, m0 + 3, M, N, part_ptr, pid_s)
        tl.debug_barrier()  # every thread's partial is written before the (releasing) ticket
        tile = pid_m * tl.num_programs(0) + pid_n
        ticket = tl.atomic_add(lock_ptr + tile, 1, sem="acq_rel", scope="gpu")
        last = ticket == SPLIT - 1
        if last:
            tl.atomic_xchg(lock_ptr + tile, 0)
    if last:
        gs = tl.load(gs_ptr)
        _row_out(acc0, rn, m0, M, N, part_ptr, gs, bias_ptr, xa_ptr, lb_ptr, out_ptr, stride_om, lora_scale, SPLIT,
                 HAS_BIAS, R, USE_SPLIT)
        if BM > 1:
            _row_out(acc1, rn, m0 + 1, M, N, part_ptr, gs, bias_ptr, xa_ptr, lb_ptr, out_ptr, stride_om, lora_scale,
                     SPLIT, HAS_BIAS, R, USE_SPLIT)
        if BM > 2:
            _row_out(acc2, rn, m0 + 2, M, N, part_ptr, gs, bias_ptr, xa_ptr, lb_ptr, out_ptr, stride_om, lora_scale,
                     SPLIT, HAS_BIAS, R, USE_SPLIT)
            _row_out(acc3, rn, m0 + 3, M, N, part_ptr, gs, bias_ptr, xa_ptr, lb_ptr, out_ptr, stride_om, lora_scale,
                     SPLIT, HAS_BIAS, R, USE_SPLIT)
