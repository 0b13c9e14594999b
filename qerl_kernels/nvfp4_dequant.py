"""NVFP4 -> bf16/fp16 dequantization in one pass (Triton), and the large-M path built on it.

``dequantize_into(out, packed, scale, gs)``: ``out [R, C] = e2m1 · fl32(scale / gs)`` rounded to
``out.dtype`` — the same fp32 operations, in the same order, as the readable reference
:func:`qerl.quant.nvfp4.dequantize` (paper Eq. 1, ``Ŵ = FP4 · S_FP8 · S_FP32`` with ``S_FP32 = 1/gs``),
so the two agree **bit for bit**. ``packed [R, C/2]`` uint8 and ``scale [R, C/16]`` (its uint8 bits)
may be row or column windows (views) of a checkpoint tensor; ``out`` may be a strided view
(unit stride along C).

Why it exists: on Hopper (no FP4 tensor cores) a large-M matmul is compute-bound, and the fastest way
to run it from 4-bit weights is to let cuBLAS's wgmma pipelines do the multiply on a bf16 copy of a
*window* of W, made by this kernel near copy bandwidth (0.5625 B read + 2 B written per weight;
vLLM routes AWQ to dequantize + matmul the same way above 256 tokens). :func:`dq_forward` /
:func:`dq_backward` go window by window with one scratch buffer of at most :data:`MAX_WINDOW`
weights (256 MiB), so no bf16 copy of a W larger than that is ever held. Forward windows are whole
rows of W (output columns of ``y``), backward windows whole columns (output columns of ``dX``): every
output element is one cuBLAS dot product, no partial sums to round.

Per weight: the nibble's E2M1 bits dropped into an fp32's (magnitude -> bits 22..24, sign -> 31) read
as ``e2m1 · 2^-126`` (code 1 = 0.5 lands on a subnormal, code 8 gives -0.0 like the reference table);
one exact multiply by 2^126, one by ``fl32(scale / gs)``, one rounding cast.
"""
from __future__ import annotations

import triton
import triton.language as tl

from qerl_kernels import launch
from qerl_kernels.nvfp4_matmul import _e4m3_to_f32, _tiled


@triton.jit
def _e2m1_lo_hi(p):
    """Packed bytes (int32, 0..255) -> fp32 of the low and the high nibble, exactly, by bit placement:
    the nibble's 3 magnitude bits go to fp32 bits 22..24 and its sign to bit 31, which reads as
    ``e2m1 · 2^-126`` (the 0.5 code a subnormal, kept: no flush-to-zero), times 2^126 (exact)."""
    lo = (((p << 22) & 0x01C00000) | ((p << 28) & -0x80000000)).to(tl.float32, bitcast=True)
    hi = (((p << 18) & 0x01C00000) | ((p << 24) & -0x80000000)).to(tl.float32, bitcast=True)
    return lo * 8.507059173023462e37, hi * 8.507059173023462e37


@triton.jit
def _nvfp4_dequant_kernel(
    wp_ptr, ws_ptr, gs_ptr, out_ptr, R, C2, stride_wr, stride_sr, stride_or, r0, c0,
    BR: tl.constexpr, BG: tl.constexpr, EXACT_DIV: tl.constexpr, TILED: tl.constexpr = False,
):
    """One program: ``BR`` rows x ``BG`` scale groups (16 weights = 8 packed bytes each).

    ``wp_ptr`` uint8 ``[R, C2]`` (C2 = C/2 packed bytes per row, row stride ``stride_wr``),
    ``ws_ptr`` uint8 E4M3 bits ``[R, C2/8]``, ``gs_ptr`` fp32 ``[1]``, ``out_ptr`` ``[R, 2*C2]``
    (row stride ``stride_or``) in the output dtype. ``EXACT_DIV``: IEEE ``scale / gs`` (libdevice
    ``div_rn``; Triton's ``/`` is the approximate ``div.full.f32`` on NVIDIA) — off only under the
    interpreter, whose ``/`` is numpy's IEEE division already. ``TILED``: ``wp_ptr`` / ``ws_ptr`` are whole tensors in
    the tile-contiguous layout (:mod:`qerl_kernels.layout`) with rows of ``stride_wr`` / ``stride_sr`` bytes, and the
    window starts at row ``r0``, packed byte ``c0`` (``c0 % 8 == 0``)."""
    pid_r = tl.program_id(0)
    pid_g = tl.program_id(1)
    rows = pid_r * BR + tl.arange(0, BR)
    groups = pid_g * BG + tl.arange(0, BG)
    byte = tl.arange(0, 8)
    rmask = rows < R
    gmask = groups < C2 // 8
    cols = groups[:, None] * 8 + byte[None, :]  # [BG, 8] packed byte columns
    m3 = rmask[:, None, None] & gmask[None, :, None]
    if TILED:
        n = (r0 + rows).to(tl.int64)
        p = tl.load(wp_ptr + _tiled(n[:, None, None], c0 + cols[None, :, :], stride_wr, 64), mask=m3, other=0)
        s = tl.load(ws_ptr + _tiled(n[:, None], c0 // 8 + groups[None, :], stride_sr, 8),
                    mask=rmask[:, None] & gmask[None, :], other=0)
    else:
        p = tl.load(wp_ptr + rows[:, None, None].to(tl.int64) * stride_wr + cols[None, :, :], mask=m3, other=0)
        s = tl.load(ws_ptr + rows[:, None].to(tl.int64) * stride_sr + groups[None, :],
                    mask=rmask[:, None] & gmask[None, :], other=0)
    gs = tl.load(gs_ptr)
    sf = _e4m3_to_f32(s.to(tl.int32))
    if EXACT_DIV:
        eff = tl.math.div_rn(sf, gs + tl.zeros_like(sf))
    else:
        eff = sf / gs
    p = p.to(tl.int32)
    lo, hi = _e2m1_lo_hi(p)  # weights k = 16g + 2b and 16g + 2b + 1
    lo = lo * eff[:, :, None]
    hi = hi * eff[:, :, None]
    w = tl.reshape(tl.join(lo, hi), [BR, BG * 16]).to(out_ptr.dtype.element_ty)
    ocols = pid_g * (BG * 16) + tl.arange(0, BG * 16)
    omask = rmask[:, None] & (ocols[None, :] < C2 * 2)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_or + ocols[None, :], w, mask=omask)


def dequantize_into(out, packed, scale8, gs, interpret: bool = False, BR: int = 8, BG: int = 64, num_warps: int = 4,
                    tiled: tuple[int, int] | None = None, whole: bool = False):
    """Launch :func:`_nvfp4_dequant_kernel`: ``out [R, C]`` <- ``packed [R, C/2]``, ``scale8 [R, C/16]``
    (uint8 view of the E4M3 scales), ``gs`` fp32 ``[1]``. ``C % 16 == 0``; unit stride along C. ``tiled = (r0,
    k0)``: ``packed`` / ``scale8`` are whole contiguous tensors in the tile-contiguous layout
    (:mod:`qerl_kernels.layout`) and ``out`` receives the window of rows ``r0 …`` and weights ``k0 …`` (``k0 % 16 ==
    0``). ``whole``: the one window of a call of :mod:`qerl_kernels.ops` (all of W; :func:`dq_forward` /
    :func:`dq_backward` with one window) — inside its scope the checks, grid, sizes and strides are then computed once
    per scope (:func:`qerl_kernels.launch.memo`)."""
    if whole and launch.in_scope():
        grid, tail, kw = launch.memo(_static, out, packed, scale8, interpret, BR, BG, num_warps, tiled)
        if grid is not None:
            launch.run(_nvfp4_dequant_kernel, grid, (packed, scale8, gs, out, *tail), kw)
        return out
    grid, tail, kw = _static(out, packed, scale8, interpret, BR, BG, num_warps, tiled)
    if grid is None:
        return out
    args = (packed, scale8, gs, out, *tail)
    if launch.in_scope():  # a call of qerl_kernels.ops: its scope fixes everything this launch specialises on
        launch.run(_nvfp4_dequant_kernel, grid, args, kw)
        return out
    # called on its own (weight loading, the engine's dense copies): a scope of its own, keyed on what Triton
    # specialises this launch on — the integer arguments exactly (stricter than Triton's ``== 1`` / ``% 16``),
    # dtypes, pointer alignments, meta-parameters
    key = ("dequantize_into", out.device, out.dtype, packed.dtype, scale8.dtype, gs.dtype, *args[4:],
           packed.data_ptr() % 16, scale8.data_ptr() % 16, gs.data_ptr() % 16, out.data_ptr() % 16, BR, BG,
           num_warps, interpret, tiled is not None)
    prev = launch.scope(key)
    try:
        launch.run(_nvfp4_dequant_kernel, grid, args, kw)
    finally:
        launch.restore(prev)
    return out


def _static(out, packed, scale8, interpret: bool, BR: int, BG: int, num_warps: int, tiled) -> tuple:
    """:func:`dequantize_into`'s checks and static part: ``(grid, the integer arguments, keywords)``, grid None for
    an empty window."""
    R, C = out.shape
    r0 = c0 = 0
    if tiled is not None:
        r0, k0 = tiled
        N, kb = packed.shape
        if (k0 % 16 or C % 16 or r0 < 0 or k0 < 0 or r0 + R > N or k0 + C > 2 * kb or N % 64 or kb % 64
                or scale8.shape != (N, kb // 8) or not (packed.is_contiguous() and scale8.is_contiguous())):
            raise ValueError(f"dequantize_into: a [{R}, {C}] window at row {r0}, weight {k0} of tiled packed "
                             f"{tuple(packed.shape)} / scale {tuple(scale8.shape)} (contiguous, N % 64 == 0, "
                             f"K % 128 == 0, the window inside, k0 and C multiples of 16)")
        c0 = k0 // 2
        strides = (kb, kb // 8)
    else:
        if packed.shape != (R, C // 2) or scale8.shape != (R, C // 16) or C % 16:
            raise ValueError(f"dequantize_into: out {tuple(out.shape)}, packed {tuple(packed.shape)}, "
                             f"scale {tuple(scale8.shape)} do not describe one [R, C] window with C % 16 == 0")
        strides = (packed.stride(0), scale8.stride(0))
    if min(out.stride(1), packed.stride(1), scale8.stride(1)) != 1:
        raise ValueError("dequantize_into: every tensor needs unit stride along C")
    if R == 0 or C == 0:
        return None, (), {}
    grid = (launch.cdiv(R, BR), launch.cdiv(C // 16, BG))
    kw = dict(BR=BR, BG=BG, EXACT_DIV=not interpret, num_warps=num_warps, TILED=tiled is not None)
    return grid, (R, C // 2, *strides, out.stride(0), r0, c0), kw


def _dequant(out, packed, scale8, gs, interpret: bool, tiled: tuple[int, int] | None = None, whole: bool = False):
    """:func:`dequantize_into`; under the interpreter, whose fp32 -> bf16 cast truncates (platform.md),
    through an fp32 window and torch's round-to-nearest cast, so the CPU path stays bit-exact too."""
    if interpret and out.dtype.itemsize == 2:
        import torch

        return out.copy_(dequantize_into(torch.empty(out.shape, dtype=torch.float32), packed, scale8, gs, True,
                                         tiled=tiled, whole=whole))
    return dequantize_into(out, packed, scale8, gs, interpret, tiled=tiled, whole=whole)


MAX_WINDOW = 1 << 27  # weights per dequantized window at most (256 MiB of bf16 scratch), whatever W's size


def _window(total: int, chunk: int, align: int) -> int:
    """Width of equal windows over ``total`` (multiples of ``align``, the last one shorter) for at most
    ``chunk`` per window: as few windows as the cap allows, balanced (an unbalanced split left a
    48-column window next to a 3536-column one for 7B gate/up, and cuBLAS runs thin windows badly)."""
    cap = max(align, chunk // align * align)
    n = -(-total // cap)
    return min(total, -(-(-(-total // n)) // align) * align)


def _weights(chunk: int) -> int:
    """Weights per window: ``chunk``, capped at :data:`MAX_WINDOW`; ``chunk <= 0`` means the cap."""
    return min(chunk, MAX_WINDOW) if chunk > 0 else MAX_WINDOW


def dq_forward(x2, packed, scale8, gs, bias, xa, lora_b, lora_scale, chunk: int, interpret: bool = False,
               tiled: bool = False):
    """``y [M, N] = x2 · Ŵᵀ (+ bias) (+ s · xa · lora_bᵀ)`` by dequantizing windows of whole rows of W
    (at most ``chunk`` weights each, at least 16 rows) into one scratch buffer and running cuBLAS on each
    (``torch.mm`` / ``torch.addmm`` into the matching column window of ``y``). ``chunk <= 0`` or above
    :data:`MAX_WINDOW`: windows of ``MAX_WINDOW`` weights. ``tiled``: W in the tile-contiguous layout."""
    import torch

    M, K = x2.shape
    N = packed.shape[0]
    rows = _window(N, _weights(chunk) // max(K, 1), 16)
    scratch = torch.empty(rows, K, device=x2.device, dtype=x2.dtype)
    if rows >= N:  # one window (eager calls): no views of y
        w = _dequant(scratch, packed, scale8, gs, interpret, (0, 0) if tiled else None, whole=True)
        out = torch.mm(x2, w.t()) if bias is None else torch.addmm(bias, x2, w.t())
        return out.addmm_(xa, lora_b.t(), alpha=lora_scale) if xa is not None else out
    out = torch.empty(M, N, device=x2.device, dtype=x2.dtype)
    for n0 in range(0, N, rows):
        n1 = min(N, n0 + rows)
        w = (_dequant(scratch[: n1 - n0], packed, scale8, gs, interpret, (n0, 0)) if tiled else
             _dequant(scratch[: n1 - n0], packed[n0:n1], scale8[n0:n1], gs, interpret))
        if bias is not None:
            torch.addmm(bias[n0:n1], x2, w.t(), out=out[:, n0:n1])
        else:
            torch.mm(x2, w.t(), out=out[:, n0:n1])
    if xa is not None:
        out.addmm_(xa, lora_b.t(), alpha=lora_scale)
    return out


def dq_backward(d2, packed, scale8, gs, dyb, lora_a, lora_scale, chunk: int, interpret: bool = False,
                tiled: bool = False):
    """``dX [M, K] = d2 · Ŵ (+ s · dyb · lora_a)`` by dequantizing windows of whole columns of W
    (``Ŵ[:, k0:k1]``: column windows of the packed and scale tensors; at most ``chunk`` weights, at least
    16 columns) and writing ``dX[:, k0:k1]`` with cuBLAS. ``chunk``, ``tiled``: as in :func:`dq_forward`."""
    import torch

    M = d2.shape[0]
    N, K = packed.shape[0], packed.shape[1] * 2
    cols = _window(K, _weights(chunk) // max(N, 1), 16)
    scratch = torch.empty(N, cols, device=d2.device, dtype=d2.dtype)
    if cols >= K:  # one window (eager calls): no views of dX
        out = torch.mm(d2, _dequant(scratch, packed, scale8, gs, interpret, (0, 0) if tiled else None, whole=True))
        return out.addmm_(dyb, lora_a, alpha=lora_scale) if dyb is not None else out
    out = torch.empty(M, K, device=d2.device, dtype=d2.dtype)
    for k0 in range(0, K, cols):
        k1 = min(K, k0 + cols)
        w = (_dequant(scratch[:, : k1 - k0], packed, scale8, gs, interpret, (0, k0)) if tiled else
             _dequant(scratch[:, : k1 - k0], packed[:, k0 // 2:k1 // 2], scale8[:, k0 // 16:k1 // 16], gs, interpret))
        torch.mm(d2, w, out=out[:, k0:k1])
    if dyb is not None:
        out.addmm_(dyb, lora_a, alpha=lora_scale)
    return out
