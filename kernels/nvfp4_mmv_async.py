"""NVFP4 decode matmul, the MMV tile of :mod:`.nvfp4_mmv` with a shared-memory copy pipeline:
``y [M, N] = x [M, K] · Ŵᵀ (+ bias) (+ s · xa · Bᵀ)``, 8 x NB activation rows per program.

Why: the register-prefetch loop of :mod:`.nvfp4_mmv` keeps at most PREFETCH (1-2) steps of weights in
flight per warp — every program waits about one DRAM latency per step, and small shapes (a few steps
per program after split-K) are a chain of latencies, not a stream of bytes. Here the weight and scale
loads are plain ``tl.load``\\ s in a ``tl.range(..., num_stages=S)`` loop with no ``tl.dot``: Triton's
software pipeliner (``pipelineWithoutDot``) turns them into ``cp.async`` copies into S-1 shared-memory
buffers issued S-1 steps ahead, so the bytes in flight no longer cost registers, and a program with
few steps issues all of its loads at once.

Layout: one step is 256 k (K % 256 == 0). Thread ``(g, c) = (lane // 4, lane % 4)`` owns weight rows
``g`` and ``g + 8`` of its warp's 16 and, of each step, the 8 packed words ``8c .. 8c+7`` (k ``64c ..
64c+63``: 32 contiguous bytes, two 16-byte copies) and the 4 block scales ``4c .. 4c+3`` (one int32);
its activation words are x[64c .. 64c+63] of row ``g`` of each block. Each half step (words 4h .. 4h+3,
scales 2h, 2h+1, activations 64c + 32h ..) is exactly one 128-k step of :func:`.nvfp4_mmv._compute`
(same MMAs, same fragment permutation — only which physical k a thread owns differs, and the MMA's
reduction order is free), so the numerics equal the register-prefetch kernel's up to fp32 summation order.
The epilogue (split-K reduction, bias, LoRA, fused ``x·Aᵀ``) is :func:`.nvfp4_mmv._epilogue`'s.

Measured (H200, ``mmv_async_sweep_NVIDIA_H200.json [ea84b65]``): slower than the register-prefetch
kernel at every decode shape (its best variant 3–14% at M = 1, 1.44–1.89x at M = 16) and no faster with 6 stages than with
2 — the decode kernel is issue- and L1-bound, not waiting on DRAM. Selected only by ``MMV=2`` configs
(none is tuned), kept for experiments on other GPUs.
"""
from __future__ import annotations

import triton
import triton.language as tl

from qerl_kernels.nvfp4_mmv import _epilogue, _scale2, _step, _tile_pid


@triton.jit
def _ld128p(addr):
    """4 x b32 at ``addr`` (int64, 16-byte aligned), L1-cached: the activations (every warp of the SM
    reads them). Pure (read-only data), so it is not a ``tt.load`` the pipeliner would stage through
    shared memory once per warp."""
    return tl.inline_asm_elementwise(
        asm="ld.global.nc.v4.u32 {$0, $1, $2, $3}, [$4];", constraints="=r,=r,=r,=r,l",
        args=[addr], dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1)


@triton.jit
def _x16(xr):
    """The 16 activation words (32 bf16) at byte address ``xr`` of every thread."""
    x0 = _ld128p(xr)
    x1 = _ld128p(xr + 16)
    x2 = _ld128p(xr + 32)
    x3 = _ld128p(xr + 48)
    return (x0[0], x0[1], x0[2], x0[3], x1[0], x1[1], x1[2], x1[3], x2[0], x2[1], x2[2], x2[3],
            x3[0], x3[1], x3[2], x3[3])


@triton.jit
def _cols8(q, T: tl.constexpr):
    """int32 [T, 8] -> its 8 columns (each [T]), in order."""
    e, o = tl.split(tl.reshape(q, (T, 4, 2)))  # e[:, j] = q[:, 2j], o[:, j] = q[:, 2j + 1]
    ee, eo = tl.split(tl.reshape(e, (T, 2, 2)))  # ee[:, a] = q[:, 4a], eo[:, a] = q[:, 4a + 2]
    oe, oo = tl.split(tl.reshape(o, (T, 2, 2)))  # oe[:, a] = q[:, 4a + 1], oo[:, a] = q[:, 4a + 3]
    q0, q4 = tl.split(ee)
    q2, q6 = tl.split(eo)
    q1, q5 = tl.split(oe)
    q3, q7 = tl.split(oo)
    return q0, q1, q2, q3, q4, q5, q6, q7


@triton.jit
def _byte(s, j: tl.constexpr):
    return ((s >> (8 * j)) & 0xFF).to(tl.uint8)


@triton.jit
def _half(acc, qa, qb, sa, sb, xrs, h: tl.constexpr, NB: tl.constexpr):
    """Words 4h .. 4h+3 of rows a / b (qa, qb: 4-tuples), their scale bytes 2h, 2h+1 (sa, sb: int32
    of 4 bytes), activation words at ``xrs[b] + 64 h``: one 128-k step of :func:`.nvfp4_mmv._compute`."""
    us = ()
    for b in tl.static_range(NB):
        us = us + (_x16(xrs[b] + 64 * h),)
    s2 = (_scale2(_byte(sa, 2 * h)), _scale2(_byte(sa, 2 * h + 1)), _scale2(_byte(sb, 2 * h)),
          _scale2(_byte(sb, 2 * h + 1)))
    for w in tl.static_range(4):
        acc = _step(acc, (qa, qb), s2, us, w, NB, 1)
    return acc


@triton.jit(do_not_specialize=["M", "SPLIT", "XP"])
def _nvfp4_mmv_async_kernel(
    x_ptr, wp_ptr, ws_ptr, gs_ptr, out_ptr, bias_ptr, xa_ptr, lb_ptr, part_ptr, lock_ptr, la_ptr, xap_ptr, xlock_ptr,
    M, N, K, stride_xm, stride_om, stride_ww, stride_sw, lora_scale, SPLIT,
    HAS_BIAS: tl.constexpr, R: tl.constexpr, USE_SPLIT: tl.constexpr, WARPS: tl.constexpr, NB: tl.constexpr,
    STAGES: tl.constexpr, FUSED: tl.constexpr = False, XP=0,
):
    pid_n = _tile_pid(x_ptr, la_ptr, xa_ptr, xap_ptr, xlock_ptr, M, K, stride_xm, XP, R, FUSED)  # FUSED: see there
    if pid_n >= 0:
        _async_tile(pid_n, x_ptr, wp_ptr, ws_ptr, gs_ptr, out_ptr, bias_ptr, xa_ptr, lb_ptr, part_ptr, lock_ptr,
                    xlock_ptr, M, N, K, stride_xm, stride_om, stride_ww, stride_sw, lora_scale, SPLIT, HAS_BIAS, R,
                    USE_SPLIT, WARPS, NB, STAGES, FUSED, XP)


@triton.jit
def _async_tile(
    pid_n, x_ptr, wp_ptr, ws_ptr, gs_ptr, out_ptr, bias_ptr, xa_ptr, lb_ptr, part_ptr, lock_ptr, xlock_ptr,
    M, N, K, stride_xm, stride_om, stride_ww, stride_sw, lora_scale, SPLIT,
    HAS_BIAS: tl.constexpr, R: tl.constexpr, USE_SPLIT: tl.constexpr, WARPS: tl.constexpr, NB: tl.constexpr,
    STAGES: tl.constexpr, FUSED: tl.constexpr, XP,
):
    # weight rows pid_n*16*WARPS .. (16 per warp) x activation rows pid_m*8*NB .. +8*NB, the pid_s-th
    # share of the 256-k steps; stride_ww / stride_sw: row strides of the packed weights / scales in
    # int32 words. Requires K % 256 == 0, 16-byte aligned weight and activation rows, 4-byte aligned
    # scale rows (ops checks).
    T: tl.constexpr = 32 * WARPS
    pid_m = tl.program_id(1)
    pid_s = tl.program_id(2)
    # the logical index, not %tid.x: the [T, 8] copies are laid out differently from the [T] tensors
    # (2 threads per row), and a pure %tid would be re-evaluated there; element i of a [T] tensor is held
    # by thread i in the MMA operands' layout (1 element per thread), which is what the fragments need
    tid = tl.arange(0, T)
    lane = tid & 31
    g = lane >> 2
    c = lane & 3
    na = pid_n * (16 * WARPS) + (tid >> 5) * 16 + g
    nb = na + 8
    la = tl.minimum(na, N - 1)  # rows beyond the matrix load a valid row; their outputs are not stored
    lb_ = tl.minimum(nb, N - 1)
    wpi = wp_ptr.to(tl.pointer_type(tl.int32))
    wsi = ws_ptr.to(tl.pointer_type(tl.int32))
    j8 = tl.arange(0, 8)
    wa = la * stride_ww + c * 8  # word offsets of this thread's 8 words in step 0
    wb = lb_ * stride_ww + c * 8
    sa_off = la * stride_sw + c  # word offsets of its 4 scale bytes in step 0
    sb_off = lb_ * stride_sw + c
    xrs = ()  # per activation block b: byte address of this thread's activations (row pid_m*8*NB + 8b + g)
    for b in tl.static_range(NB):
        mx = pid_m * (8 * NB) + 8 * b + g
        xrs = xrs + (x_ptr.to(tl.int64) + tl.minimum(mx, M - 1).to(tl.int64) * (stride_xm * 2) + c * 128,)
    z = tl.zeros((T,), tl.float32)
    acc = ()
    for b in tl.static_range(NB):
        acc = acc + ((z, z, z, z),)
    k_steps = K // 256
    per_split = tl.cdiv(k_steps, SPLIT)
    t0 = pid_s * per_split
    t1 = tl.minimum(k_steps, t0 + per_split)
    for t in tl.range(t0, t1, num_stages=STAGES):
        qa = tl.load(wpi + (wa + t * 32)[:, None] + j8[None, :])  # [T, 8]
        qb = tl.load(wpi + (wb + t * 32)[:, None] + j8[None, :])
        sa = tl.load(wsi + sa_off + t * 4)  # [T]: 4 scale bytes
        sb = tl.load(wsi + sb_off + t * 4)
        a0, a1, a2, a3, a4, a5, a6, a7 = _cols8(qa, T)
        b0, b1, b2, b3, b4, b5, b6, b7 = _cols8(qb, T)
        xts = ()
        for b in tl.static_range(NB):
            xts = xts + (xrs[b] + t * 512,)
        acc = _half(acc, (a0, a1, a2, a3), (b0, b1, b2, b3), sa, sb, xts, 0, NB)
        acc = _half(acc, (a4, a5, a6, a7), (b4, b5, b6, b7), sa, sb, xts, 1, NB)
    _epilogue(acc, pid_n, pid_m, pid_s, g, c, (na, nb), (la, lb_), z, gs_ptr, out_ptr, bias_ptr, xa_ptr, lb_ptr,
              part_ptr, lock_ptr, xlock_ptr, M, N, stride_om, lora_scale, SPLIT, HAS_BIAS, R, USE_SPLIT, NB, FUSED, XP, 1)
