"""NVFP4 weight-only (W4A16) matmuls in Triton, on the packed compressed-tensors layout.

Format (``../shared/docs/nvfp4.md``): ``packed uint8 [N, K/2]`` (low nibble = even k), ``scale``
float8_e4m3fn ``[N, K/16]`` (passed as its uint8 bits), ``gs`` float32 ``[1]`` (quantize direction).
Hardware: any CUDA GPU Triton supports; written for Hopper (sm_90), which has no FP4 tensor cores:
each tile is dequantized in registers to bf16 and multiplied on bf16 tensor cores, fp32 accumulate.

* forward ``y [M, N] = x [M, K] · Ŵᵀ (+ bias) (+ s · xa [M, R] · Bᵀ)``; ``SPLIT_K > 1`` splits the K
  loop over programs (decode sizes) into an fp32 workspace reduced afterwards.
* backward ``dX [M, K] = dY [M, N] · Ŵ (+ s · dyb [M, R] · A)`` straight from the same packed
  tensors (no bf16 W is ever materialised in memory).
* LoRA is folded into the epilogue: the caller computes the rank-R product (``xa = x·Aᵀ`` or
  ``dyb = dY·B``) with one extra launch; the kernel adds ``s · xa · Bᵀ`` to its accumulator.

The dequantized tile is bit-identical to :func:`qerl.quant.nvfp4.dequantize` in bf16: E2M1 value
times ``fp32(s_b) / gs`` (IEEE division, ``div_rn``) in fp32, rounded once to bf16. The readable
reference of every kernel here is :mod:`qerl.ops.linear` (``reference_forward`` /
``reference_backward_input``); tests check equivalence on odd shapes, on the GPU and under
``TRITON_INTERPRET=1`` (where ``DOT_FP32`` works around the interpreter's bf16 ``tl.dot`` bug).
"""
from __future__ import annotations

import triton
import triton.language as tl


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


@triton.jit
def _dequant_tile(wp_ptr, ws_ptr, gs, rn, k0, N, K, stride_wn, stride_sn, BN: tl.constexpr, BK: tl.constexpr):
    """Rows ``rn`` (``[BN]``) x columns ``k0 .. k0+BK`` of Ŵ as bf16 ``[BN, BK]`` (0 outside).
    ``stride_wn``/``stride_sn`` are the row strides (K/2, K/16) passed as arguments so that Triton
    specialises them as multiples of 16 and issues wide vector loads of the packed bytes."""
    rkh = tl.max_contiguous(tl.multiple_of(k0 // 2 + tl.arange(0, BK // 2), BK // 2), BK // 2)
    mask = (rn < N)[:, None] & (rkh < K // 2)[None, :]
    p = tl.load(wp_ptr + rn[:, None] * stride_wn + rkh[None, :], mask=mask, other=0,
                eviction_policy="evict_first").to(tl.int32)  # [BN, BK/2]
    codes = tl.reshape(tl.join(p & 15, p >> 4), (BN, BK))  # interleave: k = 2j low, 2j+1 high
    rs = k0 // 16 + tl.arange(0, BK // 16)
    smask = (rn < N)[:, None] & (rs < K // 16)[None, :]
    sbits = tl.load(ws_ptr + rn[:, None] * stride_sn + rs[None, :], mask=smask, other=0).to(tl.int32)
    eff = tl.div_rn(_e4m3_to_f32(sbits), gs)  # [BN, BK/16], exactly fp32(s_b) / gs
    w = tl.reshape(_e2m1_to_f32(codes), (BN, BK // 16, 16)) * eff[:, :, None]
    return tl.reshape(w, (BN, BK)).to(tl.bfloat16)


@triton.jit
def _nvfp4_fwd_kernel(
    x_ptr, wp_ptr, ws_ptr, gs_ptr, out_ptr, bias_ptr, xa_ptr, lb_ptr,
    M, N, K, stride_xm, stride_om, stride_wn, stride_sn, lora_scale,
    HAS_BIAS: tl.constexpr, R: tl.constexpr, SPLIT_K: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DOT_FP32: tl.constexpr,
):
    # program (pid_m, pid_n, pid_k): out tile [BM, BN], K range pid_k/SPLIT_K of the loop
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    gs = tl.load(gs_ptr)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    k_tiles = tl.cdiv(K, BK)
    per_split = tl.cdiv(k_tiles, SPLIT_K)
    for t in range(pid_k * per_split, tl.minimum(k_tiles, (pid_k + 1) * per_split)):
        k0 = t * BK
        rk = k0 + tl.arange(0, BK)
        x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=(rm < M)[:, None] & (rk < K)[None, :],
                    other=0.0, eviction_policy="evict_last")  # [BM, BK]
        w = _dequant_tile(wp_ptr, ws_ptr, gs, rn, k0, N, K, stride_wn, stride_sn, BN, BK)  # [BN, BK]
        if DOT_FP32:
            acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)))
        else:
            acc = tl.dot(x.to(tl.bfloat16), tl.trans(w), acc)
    if pid_k == 0:  # epilogue terms are added once
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        if R > 0:
            rr = tl.arange(0, R)
            xa = tl.load(xa_ptr + rm[:, None] * R + rr[None, :], mask=(rm < M)[:, None], other=0.0)  # [BM, R]
            lb = tl.load(lb_ptr + rn[:, None] * R + rr[None, :], mask=(rn < N)[:, None], other=0.0)  # [BN, R]
            acc += lora_scale * tl.dot(xa.to(tl.float32), tl.trans(lb.to(tl.float32)))
    omask = (rm < M)[:, None] & (rn < N)[None, :]
    if SPLIT_K == 1:
        tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty), mask=omask)
    else:  # fp32 partials [SPLIT_K, M, N]
        tl.store(out_ptr + pid_k * M * N + rm[:, None] * N + rn[None, :], acc, mask=omask)


@triton.jit
def _nvfp4_bwd_kernel(
    dy_ptr, wp_ptr, ws_ptr, gs_ptr, out_ptr, dyb_ptr, la_ptr,
    M, N, K, stride_dm, stride_om, stride_wn, stride_sn, lora_scale,
    R: tl.constexpr, SPLIT_N: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DOT_FP32: tl.constexpr,
):
    # program (pid_m, pid_k, pid_n): dX tile [BM, BK] summed over N range pid_n/SPLIT_N
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_n = tl.program_id(2)
    rm = pid_m * BM + tl.arange(0, BM)
    k0 = pid_k * BK
    rk = k0 + tl.arange(0, BK)
    gs = tl.load(gs_ptr)
    acc = tl.zeros((BM, BK), dtype=tl.float32)
    n_tiles = tl.cdiv(N, BN)
    per_split = tl.cdiv(n_tiles, SPLIT_N)
    for t in range(pid_n * per_split, tl.minimum(n_tiles, (pid_n + 1) * per_split)):
        rn = t * BN + tl.arange(0, BN)
        dy = tl.load(dy_ptr + rm[:, None] * stride_dm + rn[None, :], mask=(rm < M)[:, None] & (rn < N)[None, :],
                     other=0.0, eviction_policy="evict_last")  # [BM, BN]
        w = _dequant_tile(wp_ptr, ws_ptr, gs, rn, k0, N, K, stride_wn, stride_sn, BN, BK)  # [BN, BK]
        if DOT_FP32:
            acc += tl.dot(dy.to(tl.float32), w.to(tl.float32))
        else:
            acc = tl.dot(dy.to(tl.bfloat16), w, acc)
    if pid_n == 0 and R > 0:
        rr = tl.arange(0, R)
        dyb = tl.load(dyb_ptr + rm[:, None] * R + rr[None, :], mask=(rm < M)[:, None], other=0.0)  # [BM, R]
        la = tl.load(la_ptr + rr[:, None] * K + rk[None, :], mask=(rk < K)[None, :], other=0.0)  # [R, BK]
        acc += lora_scale * tl.dot(dyb.to(tl.float32), la.to(tl.float32))
    omask = (rm < M)[:, None] & (rk < K)[None, :]
    if SPLIT_N == 1:
        tl.store(out_ptr + rm[:, None] * stride_om + rk[None, :], acc.to(out_ptr.dtype.element_ty), mask=omask)
    else:
        tl.store(out_ptr + pid_n * M * K + rm[:, None] * K + rk[None, :], acc, mask=omask)
