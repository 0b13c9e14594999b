"""NVFP4 weight-only (W4A16) matmuls in Triton, on the packed compressed-tensors layout.

Format (``../shared/docs/nvfp4.md``): ``packed uint8 [N, K/2]`` (low nibble = even k), ``scale``
float8_e4m3fn ``[N, K/16]`` (passed as its uint8 bits), ``gs`` float32 ``[1]`` (quantize direction:
``W ≈ e2m1 · scale / gs``). Written for Hopper (sm_90), which has no FP4 tensor cores: each tile is
dequantized in registers to bf16 and multiplied on bf16 tensor cores with fp32 accumulation.

* forward ``y [M, N] = x [M, K] · Ŵᵀ (+ bias) (+ s · xa [M, R] · Bᵀ)``;
* backward ``dX [M, K] = dY [M, N] · Ŵ (+ s · dyb [M, R] · A)`` from the same packed tensors
  (no bf16 W is ever materialised in memory);
* LoRA in the epilogue: the caller computes the rank-R product (``xa = x·Aᵀ`` / ``dyb = dY·B``,
  one extra launch); the kernel adds ``s · xa · Bᵀ`` before its single store. Forward ``LXA``: the kernel
  computes ``xa`` itself (one launch): ``xa_ptr`` is then ``lora_a [R, K]``, each program accumulates its rows'
  ``x · Aᵀ`` over its K share (fp32, beside the main accumulator; every N tile repeats it, +R/BN of the MMA work)
  and adds its share's ``s · xa · Bᵀ`` before the split reduction (linear in ``xa``, so the shares sum to the
  whole term; in ``acc``'s units ``2^-7 · gs``);
* ``SPLIT > 1`` (runtime; ``USE_SPLIT`` compiles the reduction in) splits the reduction loop over
  programs (decode sizes: fills the SMs); partial sums go to an fp32 workspace and the *last* program of each output tile (an atomic ticket per tile,
  reset by that program) reduces them and runs the epilogue — one launch, no zero-fill, no extra
  reduction kernel, CUDA-graph safe (tickets always return to 0);
* ``SWAP`` computes the transposed product ``yᵀ = Ŵ · xᵀ`` so that the weight tile is the MMA's
  *A* operand (registers; wgmma on Hopper) and the few activation rows are its *B* operand.

Dequantization (the hot loop), per 4 packed bytes = 8 weights, with 32-bit integer ops
(``_fp4_pairs``, inline PTX, like vLLM Marlin's ``dequant.h``): each nibble's sign and 3-bit
magnitude are placed into a bf16 bit pattern (sign -> bit 15, magnitude -> bits 6..8) whose value is
``e2m1 · 2^-126`` exactly (the 0.5 code lands on a subnormal), then one ``mul.bf16x2`` by the block
scale pre-multiplied by 2^119 gives ``e2m1 · scale · 2^-7`` — exact (2 × 4 significant bits fit
bf16's 8) and in range for every E4M3 scale. The MMA accumulates these *unscaled* weights; the
epilogue multiplies by ``2^7 / gs`` once per output (paper Eq. 1, ``Ŵ = FP4 · S_FP8 · S_FP32``, with
``S_FP32 = 1/gs``). ``FAST=False`` computes the same bf16 tile with plain Triton arithmetic (used
under ``TRITON_INTERPRET=1``, which cannot run PTX); ``DOT_FP32`` works around the interpreter's
bf16 ``tl.dot`` bug. The readable reference of everything here is :mod:`qerl.ops.linear`.

Difference to the reference: the reference rounds each weight ``e2m1·scale/gs`` to bf16 before the
matmul; the kernels use the exact ``e2m1·scale`` and apply ``1/gs`` in fp32 after accumulation
(<= 2^-9 relative per weight, below the bf16 rounding of the output).
"""
from __future__ import annotations

import triton
import triton.language as tl

from qerl_kernels import interpreter_compat

interpreter_compat.patch()  # loop bounds from tl.program_id, TRITON_INTERPRET, NumPy >= 2.4 (every kernel module
# imports this one or launch)

ENC_SHIFT = 7  # the MMA sees e2m1 · scale · 2^-ENC_SHIFT; the epilogue multiplies by 2^ENC_SHIFT / gs


@triton.jit
def _e4m3_to_f32(bits):
    """float8_e4m3fn bits (int32, 0..255) -> fp32, exactly (no NaN in block scales)."""
    e = (bits >> 3) & 15
    m = bits & 7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)  # 2^(e-7) (1 + m/8)
    sub = m.to(tl.float32) * 0.001953125  # e = 0: m/8 * 2^-6 = m * 2^-9
    v = tl.where(e == 0, sub, normal)
    return tl.where((bits & 128) != 0, -v, v)


@triton.jit
def _e2m1_to_f32(c):
    """E2M1 codes (int32, 0..15) -> fp32: magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6; bit 3 = sign."""
    mag = c & 7
    e = mag >> 1
    halves = tl.where(e == 0, mag, (2 + (mag & 1)) << tl.maximum(e - 1, 0))  # value in units of 0.5
    v = halves.to(tl.float32) * 0.5
    return tl.where((c & 8) != 0, -v, v)


# byte b of $4 -> bf16x2 (low, high nibble) pair $b times the bf16x2 scale operand $(5 + b) (also used by
# nvfp4_wgmma with one scale operand for all four bytes)
FP4_PAIRS_PTX = tl.constexpr("""
        {
        .reg .b32 q4, r, t;
        shl.b32 q4, $4, 4;
        prmt.b32 r, $4, q4, 0x0040; shr.b32 t, r, 6; and.b32 t, t, 0x01C001C0; and.b32 r, r, 0x80008000; or.b32 r, r, t; mul.rn.bf16x2 $0, r, $5;
        prmt.b32 r, $4, q4, 0x1151; shr.b32 t, r, 6; and.b32 t, t, 0x01C001C0; and.b32 r, r, 0x80008000; or.b32 r, r, t; mul.rn.bf16x2 $1, r, $6;
        prmt.b32 r, $4, q4, 0x2262; shr.b32 t, r, 6; and.b32 t, t, 0x01C001C0; and.b32 r, r, 0x80008000; or.b32 r, r, t; mul.rn.bf16x2 $2, r, $7;
        prmt.b32 r, $4, q4, 0x3373; shr.b32 t, r, 6; and.b32 t, t, 0x01C001C0; and.b32 r, r, 0x80008000; or.b32 r, r, t; mul.rn.bf16x2 $3, r, $8;
        }
        """)


@triton.jit
def _fp4_pairs(p, s2):
    """4 packed bytes (one b32) + each byte's block scale as a bf16x2 pair ``(s, s)`` with
    ``s = scale · 2^119`` (int32, four registers) -> 4 int32, each the bf16x2 pair
    ``(low nibble, high nibble) · scale · 2^-7`` of one byte, i.e. weights k = 2b and 2b+1 in order.

    Strictly elementwise (output j depends only on byte j and scale j): Triton may pack any four
    elements of its layout into one call, e.g. bytes of different rows.
    Per byte: ``prmt`` puts the low nibble at bits 12..15 and the high nibble at 28..31; then
    ``(r & 0x80008000) | ((r >> 6) & 0x01C001C0)`` is the bf16x2 ``e2m1 · 2^-126``; ``mul.bf16x2``
    by the scale (sm_90; subnormal inputs are honoured) is exact.

    Declared non-pure on purpose: it stops Triton from hoisting the MMA operand's layout
    conversion above the dequantization, which otherwise loads the packed bytes one ``LDS.U8`` at a
    time in the MMA fragment order (bank-conflicted; ncu: L1 91% busy, DRAM 19%, on an H200)."""
    return tl.inline_asm_elementwise(
        asm=FP4_PAIRS_PTX,
        constraints="=r,=r,=r,=r,r,r,r,r,r",
        args=[p, s2], dtype=tl.int32, is_pure=False, pack=4)


@triton.jit
def _tiled(n, col, row_bytes, W: tl.constexpr):
    """Byte offset of byte ``col`` of row ``n`` in the tile-contiguous layout (:func:`qerl_kernels.layout.offsets`;
    ``W`` 64 for the packed weights, 8 for the scales)."""
    return (n // 64) * (64 * row_bytes) + (col // W) * (64 * W) + (n % 64) * W + col % W


@triton.jit
def _w_tile(wp_ptr, ws_ptr, rn, k0, N, K, stride_wn, stride_sn,
            BN: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr, FAST: tl.constexpr, TILED: tl.constexpr = False):
    """Rows ``rn`` ([BN]) x columns ``k0 .. k0+BK`` of ``e2m1 · scale · 2^-7`` as bf16 [BN, BK]
    (0 outside the matrix). Loads [BN, BK/2] packed bytes and [BN, BK/16] scale bytes (``TILED``: from the
    tile-contiguous layout, :mod:`qerl_kernels.layout`, rows of ``stride_wn`` / ``stride_sn`` bytes)."""
    rg = k0 // 16 + tl.arange(0, BK // 16)  # 16-wide scale groups = 8 packed bytes each
    rb = tl.arange(0, 8)
    pmask = (rn < N)[:, None, None]
    smask = (rn < N)[:, None]
    if not EVEN_K:
        pmask = pmask & (rg < K // 16)[None, :, None]
        smask = smask & (rg < K // 16)[None, :]
    if TILED:
        poff = _tiled(rn[:, None, None], rg[None, :, None] * 8 + rb[None, None, :], stride_wn, 64)
        soff = _tiled(rn[:, None], rg[None, :], stride_sn, 8)
    else:
        poff = rn[:, None, None] * stride_wn + rg[None, :, None] * 8 + rb[None, None, :]
        soff = rn[:, None] * stride_sn + rg[None, :]
    p = tl.load(wp_ptr + poff, mask=pmask, other=0, eviction_policy="evict_first")  # [BN, BK/16, 8] uint8
    sb = tl.load(ws_ptr + soff, mask=smask, other=0, eviction_policy="evict_first")  # [BN, BK/16] uint8
    if FAST:
        s = (sb.to(tl.float8e4nv, bitcast=True).to(tl.float32) * 6.646139978924579e35).to(tl.bfloat16)  # · 2^119
        s16 = s.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        pr = _fp4_pairs(p, (s16 | (s16 << 16))[:, :, None])  # int32 [BN, BK/16, 8]
        lo = pr.to(tl.int16).to(tl.bfloat16, bitcast=True)
        hi = (pr >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        sf = (_e4m3_to_f32(sb.to(tl.int32)) * 0.0078125)[:, :, None]  # scale · 2^-7
        c = p.to(tl.int32)
        lo = (_e2m1_to_f32(c & 15) * sf).to(tl.bfloat16)  # exact: 2 x 4 significant bits
        hi = (_e2m1_to_f32(c >> 4) * sf).to(tl.bfloat16)
    return tl.reshape(tl.join(lo, hi), (BN, BK))  # k = 16 g + 2 b + (0 | 1)


@triton.jit
def _dot(a, b, acc, DOT_FP32: tl.constexpr):
    if DOT_FP32:  # interpreter: its bf16 tl.dot multiplies raw bits
        return acc + tl.dot(a.to(tl.float32), b.to(tl.float32))
    return tl.dot(a, b, acc)


def split_red(rows: int, cols: int, warps: int) -> int:
    """Partials a split-K reduction loads per round (``RED`` of :func:`_split_reduce` and of
    :func:`qerl_kernels.nvfp4_wgmma._split_sum`) for a ``[rows, cols]`` fp32 tile over ``warps`` warps: 8 where a
    thread holds at most 4 of its values (the decode tiles at BT = 8), else 1.

    Why: the last share of a tile adds the ``SPLIT`` partials after its ticket, on the kernel's critical path. For
    the runtime loop ptxas unrolls by 4 and issues those loads together, after a remainder loop of one partial per
    L2 round trip (``SPLIT % 4`` of them): 7B down at M = 8 (``SPLIT`` 14) waited for 5 round trips, with 8 per
    round for 2. Measured (H100, CUDA graphs, tiled weights, bit-equal outputs; reports/kernels): 7B q/k/v / o /
    down at M = 8 1.03 / 1.06 / 1.02x faster, 0.5B down 1.11x; the 7B rollout at batch 8 1% shorter per step. The
    kernel's register count is its peak, so more loads per round cost residency (sm_90 compiles, RED 1 / 2 / 4 / 8):
    BT = 8 71 / 75 / 71 / 72 registers; BT = 16 75 / 77 / 83 / 120 — at 2 the M = 16 calls ran 0.93-1.01x
    (slower at every SPLIT >= 6) on the H100, at 4 14B / 32B q/k/v 7-8% slower on the H200 (one program per SM
    fewer); BT = 32 96 / 107 / 151 / 211; a bwd tile ``[128, 64]`` at 4 warps 168 -> 246 with 2."""
    per_thread = max(1, rows * cols // (32 * warps))
    return 8 if per_thread <= 4 else 1


@triton.jit
def _sum_round(acc, ptr, MN, omask, left, RED: tl.constexpr):
    """``acc + part[0] + … + part[RED - 1]`` in that order (``part[i]`` at ``ptr + i · MN``; those at ``i >= left``
    load as -0.0, which adds exactly nothing). Unrolled straight-line code: ptxas issues the RED loads before the
    first addition (``tests/kernels/test_nvfp4_kernels.py`` checks the SASS)."""
    for i in tl.static_range(RED):
        acc += tl.load(ptr + i * MN, mask=omask & (left > i), other=-0.0, cache_modifier=".cg")
    return acc


@triton.jit
def _split_reduce(acc, part_ptr, lock_ptr, offs, omask, tile, MN, SPLIT, pid_s, RED: tl.constexpr = 1):
    """Serial split reduction: store this program's fp32 partial, take a ticket; the last program
    of the tile sums all partials in split order (returns ``last=True``) and resets the ticket to 0.
    ``RED`` (1, 2, 4 or 8: :func:`split_red`) partials are loaded per round before any is added, so that their L2
    round trips overlap; the sum is the same for every ``RED``."""
    tl.store(part_ptr + pid_s * MN + offs, acc, mask=omask)
    tl.debug_barrier()  # every thread's partial is written before the (releasing) ticket
    ticket = tl.atomic_add(lock_ptr + tile, 1, sem="acq_rel", scope="gpu")
    last = ticket == SPLIT - 1
    if last:
        acc = tl.zeros_like(acc)
        if RED == 1:  # the loop as it was: the code of every kernel the A/B did not re-measure
            for j in range(SPLIT):
                acc += tl.load(part_ptr + j * MN + offs, mask=omask, other=0.0, cache_modifier=".cg")
        else:
            for j in range(0, SPLIT, RED):
                acc = _sum_round(acc, part_ptr + j * MN + offs, MN, omask, SPLIT - j, RED)
        tl.atomic_xchg(lock_ptr + tile, 0)
    return acc, last


@triton.jit(do_not_specialize=["M", "SPLIT"])
def _nvfp4_fwd_kernel(
    x_ptr, wp_ptr, ws_ptr, gs_ptr, out_ptr, bias_ptr, xa_ptr, lb_ptr, part_ptr, lock_ptr,
    M, N, K, stride_xm, stride_om, stride_wn, stride_sn, lora_scale, SPLIT,
    HAS_BIAS: tl.constexpr, R: tl.constexpr, USE_SPLIT: tl.constexpr, SWAP: tl.constexpr, EVEN_K: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, FAST: tl.constexpr, DOT_FP32: tl.constexpr,
    TILED: tl.constexpr = False, LXA: tl.constexpr = False, RED: tl.constexpr = 1,
):
    # program (pid_n, pid_m, pid_s): output tile [BM, BN], K tiles pid_s::SPLIT-th share of the loop
    # (LXA: xa_ptr is lora_a [R, K] and xacc [BM, R] this program's share of x · lora_aᵀ)
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_s = tl.program_id(2)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    if SWAP:  # acc = yᵀ tile [BN, BM]
        acc = tl.zeros((BN, BM), dtype=tl.float32)
        offs = rm[None, :] * N + rn[:, None]
        omask = (rm < M)[None, :] & (rn < N)[:, None]
    else:
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        offs = rm[:, None] * N + rn[None, :]
        omask = (rm < M)[:, None] & (rn < N)[None, :]
    if LXA:
        xacc = tl.zeros((BM, R), dtype=tl.float32)
    k_tiles = tl.cdiv(K, BK)
    per_split = tl.cdiv(k_tiles, SPLIT)
    for t in range(pid_s * per_split, tl.minimum(k_tiles, (pid_s + 1) * per_split)):
        k0 = t * BK
        rk = k0 + tl.arange(0, BK)
        xmask = (rm < M)[:, None]
        if not EVEN_K:
            xmask = xmask & (rk < K)[None, :]
        x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=xmask, other=0.0)  # [BM, BK]
        w = _w_tile(wp_ptr, ws_ptr, rn, k0, N, K, stride_wn, stride_sn, BN, BK, EVEN_K, FAST, TILED)  # [BN, BK]
        if SWAP:
            acc = _dot(w, tl.trans(x.to(tl.bfloat16)), acc, DOT_FP32)
        else:
            acc = _dot(x.to(tl.bfloat16), tl.trans(w), acc, DOT_FP32)
        if LXA:
            la = tl.load(xa_ptr + tl.arange(0, R)[:, None] * K + rk[None, :], mask=(rk < K)[None, :], other=0.0)
            xacc = _dot(x.to(tl.bfloat16), tl.trans(la.to(tl.bfloat16)), xacc, DOT_FP32)  # [BM, R]
    if LXA:  # this share's s · xa · Bᵀ, in acc's units (· 2^-7 · gs: the epilogue multiplies by 2^7 / gs)
        lb = tl.load(lb_ptr + rn[:, None] * R + tl.arange(0, R)[None, :], mask=(rn < N)[:, None], other=0.0)
        f = lora_scale * tl.load(gs_ptr) * 0.0078125
        if SWAP:
            acc += f * tl.dot(lb.to(tl.float32), tl.trans(xacc))
        else:
            acc += f * tl.dot(xacc, tl.trans(lb.to(tl.float32)))
    last = True
    if USE_SPLIT:
        acc, last = _split_reduce(acc, part_ptr, lock_ptr, offs, omask, pid_m * tl.num_programs(0) + pid_n, M * N,
                                  SPLIT, pid_s, RED)
    if last:
        acc = acc * ((1 << 7) / tl.load(gs_ptr))  # undo the 2^-7 of the tile, apply 1/gs
        if HAS_BIAS:
            b = tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
            if SWAP:
                acc += b[:, None]
            else:
                acc += b[None, :]
        if (R > 0) and (not LXA):
            rr = tl.arange(0, R)
            xa = tl.load(xa_ptr + rm[:, None] * R + rr[None, :], mask=(rm < M)[:, None], other=0.0)  # [BM, R]
            lb = tl.load(lb_ptr + rn[:, None] * R + rr[None, :], mask=(rn < N)[:, None], other=0.0)  # [BN, R]
            if SWAP:
                acc += lora_scale * tl.dot(lb.to(tl.float32), tl.trans(xa.to(tl.float32)))
            else:
                acc += lora_scale * tl.dot(xa.to(tl.float32), tl.trans(lb.to(tl.float32)))
        if SWAP:
            optr = out_ptr + rm[None, :] * stride_om + rn[:, None]
        else:
            optr = out_ptr + rm[:, None] * stride_om + rn[None, :]
        tl.store(optr, acc.to(out_ptr.dtype.element_ty), mask=omask)


@triton.jit(do_not_specialize=["M", "SPLIT"])
def _nvfp4_bwd_kernel(
    dy_ptr, wp_ptr, ws_ptr, gs_ptr, out_ptr, dyb_ptr, la_ptr, part_ptr, lock_ptr,
    M, N, K, stride_dm, stride_om, stride_wn, stride_sn, lora_scale, SPLIT,
    R: tl.constexpr, USE_SPLIT: tl.constexpr, SWAP: tl.constexpr, EVEN_K: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, FAST: tl.constexpr, DOT_FP32: tl.constexpr,
    TILED: tl.constexpr = False, RED: tl.constexpr = 1,
):
    # program (pid_k, pid_m, pid_s): dX tile [BM, BK], N tiles pid_s::SPLIT-th share of the loop;
    # SWAP accumulates dXᵀ = Ŵᵀ · dYᵀ ([BK, BM]) with the weight tile as the MMA's A operand
    pid_k = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_s = tl.program_id(2)
    rm = pid_m * BM + tl.arange(0, BM)
    k0 = pid_k * BK
    rk = k0 + tl.arange(0, BK)
    if SWAP:
        acc = tl.zeros((BK, BM), dtype=tl.float32)
        offs = rm[None, :] * K + rk[:, None]
        omask = (rm < M)[None, :] & (rk < K)[:, None]
    else:
        acc = tl.zeros((BM, BK), dtype=tl.float32)
        offs = rm[:, None] * K + rk[None, :]
        omask = (rm < M)[:, None] & (rk < K)[None, :]
    n_tiles = tl.cdiv(N, BN)
    per_split = tl.cdiv(n_tiles, SPLIT)
    for t in range(pid_s * per_split, tl.minimum(n_tiles, (pid_s + 1) * per_split)):
        rn = t * BN + tl.arange(0, BN)
        dy = tl.load(dy_ptr + rm[:, None] * stride_dm + rn[None, :], mask=(rm < M)[:, None] & (rn < N)[None, :],
                     other=0.0)  # [BM, BN]
        w = _w_tile(wp_ptr, ws_ptr, rn, k0, N, K, stride_wn, stride_sn, BN, BK, EVEN_K, FAST, TILED)  # [BN, BK]
        if SWAP:
            acc = _dot(tl.trans(w), tl.trans(dy.to(tl.bfloat16)), acc, DOT_FP32)
        else:
            acc = _dot(dy.to(tl.bfloat16), w, acc, DOT_FP32)
    last = True
    if USE_SPLIT:
        acc, last = _split_reduce(acc, part_ptr, lock_ptr, offs, omask, pid_m * tl.num_programs(0) + pid_k, M * K,
                                  SPLIT, pid_s, RED)
    if last:
        acc = acc * ((1 << 7) / tl.load(gs_ptr))
        if R > 0:
            rr = tl.arange(0, R)
            dyb = tl.load(dyb_ptr + rm[:, None] * R + rr[None, :], mask=(rm < M)[:, None], other=0.0)  # [BM, R]
            la = tl.load(la_ptr + rr[:, None] * K + rk[None, :], mask=(rk < K)[None, :], other=0.0)  # [R, BK]
            if SWAP:
                acc += lora_scale * tl.dot(tl.trans(la.to(tl.float32)), tl.trans(dyb.to(tl.float32)))
            else:
                acc += lora_scale * tl.dot(dyb.to(tl.float32), la.to(tl.float32))
        if SWAP:
            optr = out_ptr + rm[None, :] * stride_om + rk[:, None]
        else:
            optr = out_ptr + rm[:, None] * stride_om + rk[None, :]
        tl.store(optr, acc.to(out_ptr.dtype.element_ty), mask=omask)
