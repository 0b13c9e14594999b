"""NVFP4 W4A16 matmul for small and mid-size M (routed at M = 17 … 128 — the gap between the decode kernel
and the dequantize-then-cuBLAS path — and at the tuned keys of M = 8, 16 and 256) on Hopper's warpgroup MMA
with the **weights as the register operand**
(Gluon; the Machete / Marlin idea on ``wgmma``): ``yᵀ [N, M] = Ŵ [N, K] · xᵀ`` (+ bias)
(+ ``s · (xa · lora_bᵀ)ᵀ``), ``Ŵ = FP4 · S_FP8 · S_FP32`` (paper Eq. 1; the MMA sees ``e2m1 · scale · 2^-7``
exactly and the epilogue applies ``2^7 / gs``, as in :mod:`.nvfp4_matmul`). x, y, xa, lora_b: bf16; packed
uint8 ``[N, K/2]``, scale bits uint8 ``[N, K/16]``, gs fp32 ``[1]``; fp32 accumulation.

Why: the Triton tile kernel (:mod:`.nvfp4_matmul`, ``SWAP``) also feeds ``wgmma`` with the weight tile
from registers, but Triton dequantizes in a blocked layout and moves the tile into the MMA operand
layout through shared memory with a barrier per step (17 ``BAR`` per 128-wide step at M = 64): it ran
at ~100 TFLOP/s. Here every thread decodes exactly the packed words of its own A fragment, so the
decoded tile is *already* in the operand layout (``gl.convert_layout(..., assert_trivial=True)``
proves it at compile time), and nothing but the activations goes through shared memory.

Per program: ``64 · WG · MT`` weight rows (WG warpgroups, MT ``m64`` tiles each) x ``BT`` activation rows
(the MMA's n), 128-wide K steps, ``NS``-stage ``cp.async`` ring for the packed weights, their block
scales and the activation tile (``PIPE``: the next step's decode under this step's wgmma, the weights
``NSW`` steps ahead). Split-K over programs (``SPLIT``) with the decode kernel's ticketed, deterministic
reduction; the LoRA up-projection (rank R) is one more wgmma in the epilogue, accumulating into the tile
(at decode sizes ``xa`` comes from the PDL primary :mod:`qerl_kernels.lora_xa`, waited for only there).
Programs: the activation-row tiles of one weight tile are adjacent in the grid (its second read hits L2).
Measurements of every variant: reports/kernels/README.md, "v9" and "v10" (large tiles for M >= 2048:
~500 TFLOP/s at best, below dequantize + cuBLAS, not routed).

The reduction order trick (as in :mod:`.nvfp4_mmv`): thread ``(g, c) = (lane // 4, lane % 4)`` of warp
``w`` owns rows ``16 w + g`` and ``+ 8`` of its warpgroup's tile and the 16 packed bytes ``16 c … 16 c + 15``
of each row's 64-byte step (4 words, physical k ``32 c … 32 c + 31``). The MMA's logical k may be any
permutation of the physical k if the activations use the same one: word ``v`` decodes
(:func:`qerl_kernels.nvfp4_gemv._word_pairs`) into the bf16 pairs ``P_i = (8 v + 3 - i, 8 v + 7 - i)``,
and logical ``k = 16 j + 8 h + 2 c + e`` (``j`` the k16 MMA, ``h`` the fragment half, ``e`` the element)
is physical ``π(k) = 32 c + 8 (j // 2) + 3 - (2 (j % 2) + h) + 4 e``. The activations are gathered once
per call into that order (:func:`permute_activations`, one small copy) and copied with 16-byte
``cp.async`` into a 128-byte-swizzled tile that is the ``wgmma`` B operand as is (``XG``: the kernel
gathers them itself in the byte-pair order ``perm_128(1)`` with 4-byte copies — slower, kept for
experiments; ``XS``: the tiles are copied as they are (16-byte
``cp.async``) and each step moves its tile through registers into one operand tile in the order
``perm_128(2)`` — the word pairs joined in reverse make that order a pure bit permutation of k, so the
move is a reshape and a permute — which saves the pre-pass launch, 1.5-2.4 µs per call on the H100,
wgmma_lora_split_NVIDIA_H100_80GB_HBM3.json [ea84b65]; routed at most tuned keys of M 1-8, e.g. 7B q/k/v
M = 8 on the H100 10.5 vs 11.9 µs, NVIDIA_H100_80GB_HBM3_tune_wgmma_xs.csv [ea84b65]).

``TILED`` (plain loop, split-K or stream-K): the weights and scales in the tile-contiguous layout of :mod:`qerl_kernels.layout`,
so that a program's step is one contiguous 4 KB block (row-major: 64 pieces of 64 bytes); bit-equal results, 7B
gate/up at M = 8 44.0 -> 37.0 µs and 32B gate/up 102.8 -> 73.1 on the H100 (routed through ``ops.nvfp4_matmul(...,
tiled=True)``; the rollout engine's default on CUDA).

Requires K % 128 == 0 and 16-byte aligned rows (checked by :func:`qerl_kernels.ops`); CUDA only (Gluon
does not run in the CPU interpreter): ``tests/kernels/test_wgmma_layout.py`` replays the permutation and
the fragment assembly in NumPy and compiles the kernel for sm_90 on CPU.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

from qerl_kernels import launch
from qerl_kernels.nvfp4_gemv import WORD_PAIRS_PTX
from qerl_kernels.nvfp4_matmul import FP4_PAIRS_PTX, split_red

_WORD_PAIRS = gl.constexpr(WORD_PAIRS_PTX.value)  # one scale operand ($5) for the word's 8 nibbles
_BYTE_PAIRS = gl.constexpr(FP4_PAIRS_PTX.value.replace("$6", "$5").replace("$7", "$5").replace("$8", "$5"))


_SMS: dict = {}


def _sms(device) -> int:
    """Streaming multiprocessors of ``device`` (cached)."""
    key = torch.device(device).index or 0
    if key not in _SMS:
        _SMS[key] = torch.cuda.get_device_properties(key).multi_processor_count
    return _SMS[key]


def perm_128(xg: int = 0):
    """``π`` as a list: logical k (0..127) -> physical k within each 128-wide block (see module doc);
    ``xg`` 1: the in-kernel gather's order (byte-pair decode); 2: the in-kernel staging's order (``XS``: word
    pairs joined in reverse, a pure bit permutation of k)."""
    out = []
    for k in range(128):
        j, h, c, e = k // 16, (k // 8) % 2, (k // 2) % 4, k % 2
        if xg == 2:
            out.append(32 * c + 8 * (j // 2) + 2 * (j % 2) + h + 4 * e)
        elif xg:
            out.append(32 * c + 4 * j + 2 * h + e)
        else:
            out.append(32 * c + 8 * (j // 2) + 3 - (2 * (j % 2) + h) + 4 * e)
    return out


@triton.jit
def _permute_kernel(x_ptr, out_ptr, NBLK, stride_xm, stride_om, BLOCKS: tl.constexpr, PDL: tl.constexpr = False,
                    WAIT: tl.constexpr = False):
    """Row ``program_id(0)``, 128-wide blocks ``program_id(1) * BLOCKS …``: ``out[m, 128 b + l] =
    x[m, 128 b + π(l)]`` (``perm_128()``, the word-pair order). ``PDL``: release the next launch (a kernel launched
    with ``launch_pdl`` that waits for this grid before reading ``out``) at once. ``WAIT``: itself a programmatic
    dependent (:func:`qerl_kernels.launch.chain`): wait for the previous grid before reading ``x``."""
    if PDL:
        gdc_launch_dependents()
    if WAIT:
        gdc_wait()
    m = tl.program_id(0).to(tl.int64)
    l = tl.arange(0, 128)
    j, h, c, e = l // 16, (l // 8) % 2, (l // 2) % 4, l % 2
    src = 32 * c + 8 * (j // 2) + 3 - (2 * (j % 2) + h) + 4 * e
    b = tl.program_id(1) * BLOCKS + tl.arange(0, BLOCKS)
    mask = (b < NBLK)[:, None]
    v = tl.load(x_ptr + m * stride_xm + b[:, None] * 128 + src[None, :], mask=mask)
    tl.store(out_ptr + m * stride_om + b[:, None] * 128 + l[None, :], v, mask=mask)


def permute_activations(x, out=None, pdl: bool = False, wait: bool = False):
    """``x [M, K]`` (K % 128 == 0, unit column stride) -> a contiguous copy in the kernel's reduction order
    (one small Triton launch; runs in the CPU interpreter too). ``pdl``: as the primary of a programmatic dependent
    launch — the next launch (``launch_pdl``) starts under it and waits (``griddepcontrol.wait``) before its first
    read of ``out``. ``wait`` (CUDA; :func:`qerl_kernels.launch.chain`): also launched as a programmatic dependent of
    the launch before it, waiting for it before reading ``x``."""
    M, K = x.shape
    if out is None:
        out = torch.empty((M, K), device=x.device, dtype=x.dtype)
    nblk = K // 128
    launch.run(_permute_kernel, (M, launch.cdiv(nblk, 8)), (x, out, nblk, x.stride(0), out.stride(0)),
               dict(BLOCKS=8, PDL=bool(pdl or wait), WAIT=bool(wait), num_warps=4,
                    **({"launch_pdl": True} if wait else {})))
    return out


@gluon.constexpr_function
def _warp_rows(WG):
    out = [[16, 0], [32, 0]]
    r = 64
    while r < 64 * WG:
        out.append([r, 0])
        r *= 2
    return out


@gluon.constexpr_function
def _words_layout(WG, MT=1):
    """[64·WG·MT rows, 16 words] int32: thread (g, c) of warp w holds words 4c..4c+3 (registers) of rows
    16w + g and + 8 (register bit) of each of its warpgroup's MT m64 tiles (register bit, 64·WG apart)."""
    return gl.DistributedLinearLayout(reg_bases=[[0, 1], [0, 2], [8, 0]] + ([[64 * WG, 0]] if MT == 2 else []),
                                      lane_bases=[[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]],
                                      warp_bases=_warp_rows(WG), block_bases=[], shape=[64 * WG * MT, 16])


@gluon.constexpr_function
def _scales_layout(WG, MT=1):
    """[64·WG·MT rows, 8 scale bytes]: thread (g, c) holds bytes 2c, 2c+1 of rows 16w + g and + 8 (per m64 tile)."""
    return gl.DistributedLinearLayout(reg_bases=[[0, 1], [8, 0]] + ([[64 * WG, 0]] if MT == 2 else []),
                                      lane_bases=[[0, 2], [0, 4], [1, 0], [2, 0], [4, 0]],
                                      warp_bases=_warp_rows(WG), block_bases=[], shape=[64 * WG * MT, 8])


@gluon.jit
def _word_pairs(q, s):
    """Words (8 nibbles) x bf16x2 scale ``(s, s)`` -> pairs (3, 7), (2, 6), (1, 5), (0, 4) of
    ``e2m1 · 2^-126 · s`` (see :func:`qerl_kernels.nvfp4_gemv._word_pairs`)."""
    return gl.inline_asm_elementwise(
        asm=_WORD_PAIRS,
        constraints="=r,=r,=r,=r,r,r", args=[q, s], dtype=(gl.int32, gl.int32, gl.int32, gl.int32), is_pure=True,
        pack=1)


@gluon.jit
def _byte_pairs(q, s):
    """Words (4 packed bytes) x bf16x2 scale ``(s, s)`` -> per byte b = 0..3 the pair (low nibble, high
    nibble) = physical k (2b, 2b + 1) of ``e2m1 · 2^-126 · s`` (:func:`qerl_kernels.nvfp4_matmul._fp4_pairs`
    with one scale per word)."""
    return gl.inline_asm_elementwise(
        asm=_BYTE_PAIRS,
        constraints="=r,=r,=r,=r,r,r", args=[q, s], dtype=(gl.int32, gl.int32, gl.int32, gl.int32), is_pure=True,
        pack=1)


@gluon.jit
def _halves(p):
    lo = (p & 0xFFFF).to(gl.int16).to(gl.bfloat16, bitcast=True)
    hi = (p >> 16).to(gl.int16).to(gl.bfloat16, bitcast=True)
    return lo, hi


@gluon.jit
def _a_operand(q, sb, AOP: gl.constexpr, LW: gl.constexpr, RW: gl.constexpr, XG: gl.constexpr,
               XS: gl.constexpr = False):
    """Packed words ``q [RW, 16]`` (layout LW) and scale bytes ``sb [RW, 8]`` -> the decoded
    ``e2m1 · scale · 2^-7`` tile ``[RW, 128]`` bf16 in logical k order, in the wgmma A layout (no data
    movement: asserted). ``XS``: the word pairs joined in reverse, so that logical (j, h) takes nibbles
    (2 (j % 2) + h, + 4): the order ``perm_128(2)``, a pure bit permutation of k."""
    s = (sb.to(gl.float8e4nv, bitcast=True).to(gl.float32) * 6.646139978924579e35).to(gl.bfloat16)  # · 2^119
    s16 = s.to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF
    s2 = (s16 | (s16 << 16)).reshape([RW, 4, 2])  # [row, c, word // 2]
    s2 = gl.join(s2, s2).reshape([RW, 16])  # [row, q = 4c + word]: word v uses byte 2c + v // 2
    s2 = gl.convert_layout(s2, LW, assert_trivial=True)
    if XG:  # byte b of word v = physical k 2b, 2b + 1: logical (j, h) with 2 (j % 2) + h = b
        p0, p1, p2, p3 = _byte_pairs(q, s2)
    else:  # nibbles (3 - i, 7 - i) of word v: logical (j, h) with 2 (j % 2) + h = i
        p0, p1, p2, p3 = _word_pairs(q, s2)
    if XS:  # [row, q, h, j % 2]: pair i = 3 - (2 (j % 2) + h)
        t = gl.join(gl.join(p3, p2), gl.join(p1, p0))
    else:  # [row, q, h, j % 2]: pair i = 2 (j % 2) + h
        t = gl.join(gl.join(p0, p1), gl.join(p2, p3))
    t = t.reshape([RW, 4, 4, 2, 2])  # [row, c, v = j // 2, h, j % 2]
    t = t.permute([0, 2, 4, 3, 1])  # [row, j // 2, j % 2, h, c]
    t = t.reshape([RW, 8, 8])  # [row, j, 4h + c]
    lo, hi = _halves(t)  # e = 0: nibble 3 - i, e = 1: nibble 7 - i
    a = gl.join(lo, hi).reshape([RW, 128])  # logical k = 16 j + 2 (4h + c) + e
    return gl.convert_layout(a, AOP, assert_trivial=True)


@gluon.jit
def _issue_s(t, slot, ssm, ws_ptr, srow, scol, stride_sn, TILED: gl.constexpr = False):
    """cp.async of step t's scales [RW, 8 B] (int32 words ``ws_ptr``) into W-ring slot ``slot`` (``TILED``: each 64-row
    tile's steps stored one after another, 512 B each)."""
    TS: gl.constexpr = 128 if TILED else 2
    async_copy.async_copy_global_to_shared(ssm.index(slot), ws_ptr + srow * (stride_sn // 4) + t * TS + scol)


@gluon.jit
def _issue_w(t, slot, wsm, ssm, wp_ptr, ws_ptr, wrow, wcol, srow, scol, stride_wn, stride_sn,
             TILED: gl.constexpr = False):
    """cp.async of step t's packed weights [RW, 64 B] and scales [RW, 8 B] into W-ring slot ``slot`` (``TILED``: each
    64-row tile's steps stored one after another, 4 KB of weights and 512 B of scales each)."""
    TW: gl.constexpr = 4096 if TILED else 64
    async_copy.async_copy_global_to_shared(wsm.index(slot), wp_ptr + wrow * stride_wn + t * TW + wcol)
    _issue_s(t, slot, ssm, ws_ptr, srow, scol, stride_sn, TILED)


@gluon.jit
def _rows(n0, N, stride, RW: gl.constexpr, L: gl.constexpr, W: gl.constexpr, UNIT: gl.constexpr,
          TILED: gl.constexpr = False):
    """``(row [RW, 1], row stride in bytes)`` for :func:`_issue_w` — which addresses ``row · (stride // UNIT)``
    in ``UNIT``-byte words (packed weights: ``UNIT`` 1, scales: 4) — of rows ``n0 … n0 + RW - 1`` (clamped to
    N - 1) in layout ``L``. ``TILED`` (N % 64 == 0; ``W`` words per row and K step, 64 packed bytes or 2 scale words):
    each row's first step — row n of tile n // 64 (which starts where it does row-major) lies ``W`` words after row
    n - 1 of its tile — and the stride of one word."""
    r = gl.minimum(n0 + gl.arange(0, RW, layout=gl.SliceLayout(1, L)), N - 1)
    if TILED:
        row = ((r // 64) * ((64 // UNIT) * stride) + (r % 64) * W)[:, None]  # (stride % UNIT == 0)
        st = UNIT
    else:
        row = r[:, None]
        st = stride
    return row, st


@gluon.jit
def _issue_x(t, slot, xsm, xp_ptr, xrow, xcol, xmask, stride_xm):
    """cp.async of step t's activation tile [BT, 128] into x-ring slot ``slot``."""
    async_copy.async_copy_global_to_shared(xsm.index(slot), xp_ptr + xrow * stride_xm + t * 128 + xcol, mask=xmask)


@gluon.jit
def _issue(t, slot, wsm, ssm, xsm, wp_ptr, ws_ptr, xp_ptr, wrow, wcol, srow, scol, xrow, xcol, xmask,
           stride_wn, stride_sn, stride_xm, TILED: gl.constexpr = False):
    """Step t's weights, scales and activations into ring slot ``slot`` (one ring): one commit group."""
    _issue_w(t, slot, wsm, ssm, wp_ptr, ws_ptr, wrow, wcol, srow, scol, stride_wn, stride_sn, TILED)
    _issue_x(t, slot, xsm, xp_ptr, xrow, xcol, xmask, stride_xm)
    async_copy.commit_group()


@gluon.jit
def _decode_slot(wsm, ssm, slot, AOP: gl.constexpr, LW: gl.constexpr, LS: gl.constexpr, FLAT: gl.constexpr,
                 RW: gl.constexpr, XG: gl.constexpr, XS: gl.constexpr = False):
    q = wsm.index(slot)._reinterpret(gl.int32, [RW, 16], FLAT).load(LW)
    sb = ssm.index(slot)._reinterpret(gl.uint8, [RW, 8], FLAT).load(LS)
    return _a_operand(q, sb, AOP, LW, RW, XG, XS)


@gluon.jit
def _stage_x(xst, xop, CX: gl.constexpr, BT: gl.constexpr):
    """``XS``: the activation tile as loaded (natural k order, ``xst [BT, 128]``) -> registers -> the wgmma
    operand tile ``xop`` (128-byte swizzled) in logical order ``perm_128(2)``: physical
    ``k = 32 c + 8 v + 4 e + 2 j1 + h`` to logical ``16 (2 v + j1) + 8 h + 2 c + e`` (a reshape and a
    permute of the bits of k), replacing the pre-pass launch (:func:`permute_activations`)."""
    xv = xst.load(CX).reshape([BT, 4, 4, 2, 2, 2])  # [m, c, v, e, j1, h]
    xop.store(xv.permute([0, 2, 4, 5, 1, 3]).reshape([BT, 128]))  # [m, v, j1, h, c, e]


@gluon.jit
def _pipelined(acc, t0, t1, wsm, ssm, xsm, wp_ptr, ws_ptr, xp_ptr, wrow, wcol, srow, scol, xrow, xcol, xmask,
               stride_wn, stride_sn, stride_xm, AOP: gl.constexpr, LW: gl.constexpr, LS: gl.constexpr,
               FLAT: gl.constexpr, RW: gl.constexpr, XG: gl.constexpr, NS: gl.constexpr, NSW: gl.constexpr):
    """The main loop with the next step's weight decode under the current step's wgmma, the weights
    ``NSW`` steps ahead and the activations ``NS`` (>= 3) ahead. Commit group g (prologue g < NSW, then one
    per iteration) holds W(t0 + g) and x(t0 + g) (g < NS), then W(t + NSW), x(t + NS) of iteration t: the
    group holding step t + 1's data is at most NS - 2 groups from the newest."""
    for g in gl.static_range(NSW):
        _issue_w(gl.minimum(t0 + g, t1 - 1), g, wsm, ssm, wp_ptr, ws_ptr, wrow, wcol, srow, scol, stride_wn, stride_sn)
        if g < NS:
            _issue_x(gl.minimum(t0 + g, t1 - 1), g, xsm, xp_ptr, xrow, xcol, xmask, stride_xm)
        async_copy.commit_group()
    async_copy.wait_group(NSW - 1)
    gl.thread_barrier()
    a = _decode_slot(wsm, ssm, 0, AOP, LW, LS, FLAT, RW, XG)
    for t in range(t0, t1):
        i = t - t0
        fence_async_shared()
        acc = warpgroup_mma(a, xsm.index(i % NS).permute((1, 0)), acc, is_async=True)
        async_copy.wait_group(NS - 2)
        gl.thread_barrier()
        a = _decode_slot(wsm, ssm, (i + 1) % NSW, AOP, LW, LS, FLAT, RW, XG)  # step t + 1 (clamped: unused at the end)
        acc = warpgroup_mma_wait(0, deps=[acc])
        gl.thread_barrier()  # slots of W(t + 1) and x(t) are free in every warp
        _issue_w(gl.minimum(t + NSW, t1 - 1), i % NSW, wsm, ssm, wp_ptr, ws_ptr, wrow, wcol, srow, scol, stride_wn,
                 stride_sn)
        _issue_x(gl.minimum(t + NS, t1 - 1), i % NS, xsm, xp_ptr, xrow, xcol, xmask, stride_xm)
        async_copy.commit_group()
    async_copy.wait_group(0)
    return acc


@gluon.jit
def _plain(acc, t0, t1, wsm, ssm, xsm, xop, wp_ptr, ws_ptr, xp_ptr, wrow, wcol, srow, scol, xrow, xcol, xmask,
           stride_wn, stride_sn, stride_xm, AOP: gl.constexpr, LW: gl.constexpr, LS: gl.constexpr,
           FLAT: gl.constexpr, RW: gl.constexpr, XG: gl.constexpr, NS: gl.constexpr, XS: gl.constexpr,
           CX: gl.constexpr, BT: gl.constexpr, TILED: gl.constexpr = False, EW: gl.constexpr = False):
    """The main loop over K steps ``t0 … t1 - 1`` (t0 < t1): an ``NS``-stage ring, each step's decode then its
    wgmma (``XS``: the activation tile staged into the operand tile first). ``EW`` (early weights; the launch chain,
    :func:`qerl_kernels.launch.chain`): the prologue's weights and scales are issued first, then the kernel waits for
    the previous grid (``griddepcontrol.wait``), then the prologue's activations — commit group 0 holds every
    prologue weight step, group i the activations of step i, so step i's data is complete once group i is."""
    if EW:
        for i in gl.static_range(NS - 1):
            _issue_w(gl.minimum(t0 + i, t1 - 1), i, wsm, ssm, wp_ptr, ws_ptr, wrow, wcol, srow, scol, stride_wn,
                     stride_sn, TILED)
        _gdc_wait()
        for i in gl.static_range(NS - 1):
            _issue_x(gl.minimum(t0 + i, t1 - 1), i, xsm, xp_ptr, xrow, xcol, xmask, stride_xm)
            async_copy.commit_group()
    else:
        for i in gl.static_range(NS - 1):
            _issue(gl.minimum(t0 + i, t1 - 1), i, wsm, ssm, xsm, wp_ptr, ws_ptr, xp_ptr, wrow, wcol, srow, scol,
                   xrow, xcol, xmask, stride_wn, stride_sn, stride_xm, TILED)
    for t in range(t0, t1):
        slot = (t - t0) % NS
        _issue(gl.minimum(t + NS - 1, t1 - 1), (t - t0 + NS - 1) % NS, wsm, ssm, xsm, wp_ptr, ws_ptr, xp_ptr,
               wrow, wcol, srow, scol, xrow, xcol, xmask, stride_wn, stride_sn, stride_xm, TILED)
        async_copy.wait_group(NS - 1)
        gl.thread_barrier()
        if XS:  # the tile as loaded -> the operand tile (every warp's stores before any wgmma reads it)
            _stage_x(xsm.index(slot), xop, CX, BT)
            fence_async_shared()
            gl.thread_barrier()
            a = _decode_slot(wsm, ssm, slot, AOP, LW, LS, FLAT, RW, XG, XS)
            acc = warpgroup_mma(a, xop.permute((1, 0)), acc, is_async=True)
        else:
            fence_async_shared()
            a = _decode_slot(wsm, ssm, slot, AOP, LW, LS, FLAT, RW, XG)
            acc = warpgroup_mma(a, xsm.index(slot).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=[acc])
        gl.thread_barrier()  # every warp is done with this slot before it is refilled
    async_copy.wait_group(0)
    return acc


@gluon.jit
def _output(acc, n0, m0, M, N, out_ptr, stride_om, gs_ptr, bias_ptr, xa_ptr, lb_ptr, lora_scale,
            HAS_BIAS: gl.constexpr, R: gl.constexpr, PDL: gl.constexpr, RW: gl.constexpr, BT: gl.constexpr,
            NW: gl.constexpr, MMA: gl.constexpr):
    """``y = acc · 2^7 / gs (+ bias) (+ s · xa · lora_bᵀ)`` of the tile at rows ``n0`` (weights), ``m0`` (tokens),
    stored transposed into ``out [M, N]``."""
    on = n0 + gl.arange(0, RW, layout=gl.SliceLayout(1, MMA))
    om = m0 + gl.arange(0, BT, layout=gl.SliceLayout(0, MMA))
    omask = (on < N)[:, None] & (om < M)[None, :]
    y = acc * (128.0 / gl.load(gs_ptr))
    if HAS_BIAS:
        y += gl.load(bias_ptr + on, mask=on < N, other=0.0).to(gl.float32)[:, None]
    if R > 0:
        if PDL:  # xa comes from the preceding lora_xa launch, which this one overlaps: wait for that grid
            _gdc_wait()
        y = _lora_up(y, xa_ptr, lb_ptr, lora_scale, n0, m0, M, N, RW, BT, R, NW, MMA)
    gl.store(out_ptr + om[None, :] * stride_om + on[:, None], y.to(out_ptr.dtype.element_ty), mask=omask)


@gluon.jit
def _split_sum(acc, n0, m0, M, N, part_ptr, lock_ptr, pid_s, SPLIT, RW: gl.constexpr, BT: gl.constexpr,
               MMA: gl.constexpr, C: gl.constexpr, CI: gl.constexpr, RED: gl.constexpr = 1):
    """Split-K: share ``pid_s`` of ``SPLIT`` stores its partial tile ``[RW, BT]`` fp32 into ``part[pid_s]`` and takes
    a ticket on ``lock[program_id(0) · C + CI]`` (one per sub-tile of ``C`` consumers; 1, 0 for one); the last share
    adds all partials in split order (deterministic) and resets the ticket. Returns ``(acc, last)`` — the sum is
    valid where ``last``. ``RED`` (1, 2, 4 or 8; :func:`split_red`): partials loaded per round before any is added,
    so that their L2 round trips overlap instead of following one another (the sum is the same for every ``RED``)."""
    on = n0 + gl.arange(0, RW, layout=gl.SliceLayout(1, MMA))
    om = m0 + gl.arange(0, BT, layout=gl.SliceLayout(0, MMA))
    omask = (on < N)[:, None] & (om < M)[None, :]
    offs = om[None, :] * N + on[:, None]
    gl.store(part_ptr + pid_s * M * N + offs, acc, mask=omask)
    gl.thread_barrier()  # (in a warp-specialised partition: that partition's warps)
    tile = gl.program_id(0) * C + CI
    ticket = gl.atomic_add(lock_ptr + tile, 1, sem="acq_rel", scope="gpu")
    last = ticket == SPLIT - 1
    if last:
        acc = gl.zeros([RW, BT], gl.float32, layout=MMA)
        if RED == 1:  # the loop as it was: the code of every kernel the A/B did not re-measure
            for j in range(SPLIT):
                acc += gl.load(part_ptr + j * M * N + offs, mask=omask, other=0.0, cache_modifier=".cg")
        else:
            for j in range(0, SPLIT, RED):
                acc = _sum_round(acc, part_ptr + j * M * N + offs, M * N, omask, SPLIT - j, RED)
        gl.atomic_xchg(lock_ptr + tile, 0)
    return acc, last


@gluon.jit
def _sum_round(acc, ptr, MN, omask, left, RED: gl.constexpr):
    """``acc + part[0] + … + part[RED - 1]`` in that order (``part[i]`` at ``ptr + i · MN``; those at ``i >= left``
    load as -0.0, which adds exactly nothing). Unrolled straight-line code: ptxas issues the RED loads before the
    first addition (``tests/kernels/test_nvfp4_kernels.py`` checks the SASS)."""
    for i in gl.static_range(RED):
        acc += gl.load(ptr + i * MN, mask=omask & (left > i), other=-0.0, cache_modifier=".cg")
    return acc


@gluon.jit
def _first_program(u, P, U):
    """The stream-K program whose unit range ``[p·U // P, (p+1)·U // P)`` holds unit ``u``: ``((u+1)·P - 1) // U``
    (:func:`stream_k_owner`, the host's copy)."""
    return ((u + 1) * P - 1) // U


@gluon.jit
def _lora_up(y, xa_ptr, lb_ptr, lora_scale, n0, m0, M, N, RW: gl.constexpr, BT: gl.constexpr, R: gl.constexpr,
             NW: gl.constexpr, MMA: gl.constexpr):
    """``y + s · (xa · Bᵀ)ᵀ`` for this tile (``y [RW, BT]`` fp32 in the accumulator layout): one more
    warpgroup MMA that accumulates into ``y`` itself (no second accumulator: at BT = 256 one more
    [128, 256] fp32 tile would spill), with the rows of ``lora_b [N, R]`` times ``s`` (rounded to bf16:
    exact for a power-of-two s) as the register operand (loaded straight into the operand layout, pairs
    of adjacent ranks per 32-bit load) and ``xa [M, R]`` (bf16, from ``x · lora_aᵀ``) as the shared-memory
    operand; the rank R (a multiple of 16) is the reduction."""
    AR: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    rn = gl.minimum(n0 + gl.arange(0, RW, layout=gl.SliceLayout(1, AR)), N - 1)
    rk = gl.arange(0, R, layout=gl.SliceLayout(0, AR))
    lb = (gl.load(lb_ptr + rn[:, None] * R + rk[None, :]).to(gl.float32) * lora_scale).to(gl.bfloat16)
    XL: gl.constexpr = gl.BlockedLayout([1, 2], [32 // (R // 2) if R < 64 else 1, R // 2 if R < 64 else 32],
                                        [NW, 1], [1, 0])
    xm = m0 + gl.arange(0, BT, layout=gl.SliceLayout(1, XL))
    xk = gl.arange(0, R, layout=gl.SliceLayout(0, XL))
    xa = gl.load(xa_ptr + xm[:, None] * R + xk[None, :], mask=(xm < M)[:, None], other=0.0)
    SL: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=min(128, 2 * R), element_bitwidth=16, rank=2)
    xs = gl.allocate_shared_memory(gl.bfloat16, [BT, R], SL, xa)
    fence_async_shared()
    return warpgroup_mma(lb, xs.permute((1, 0)), y)


@gluon.jit
def _gdc_launch_dependents():
    """``griddepcontrol.launch_dependents``: the next launch (a programmatic dependent) may start."""
    gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [], dtype=gl.int32,
                              is_pure=False, pack=1)


@gluon.jit
def _gdc_wait():
    """``griddepcontrol.wait``: the preceding grid (the PDL primary :mod:`qerl_kernels.lora_xa`) has completed
    and its writes are visible (as ``triton.language.extra.cuda.gdc_wait``)."""
    gl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit(do_not_specialize=["M", "SPLIT"])
def _nvfp4_wgmma_kernel(
    xp_ptr, wp_ptr, ws_ptr, gs_ptr, out_ptr, bias_ptr, part_ptr, lock_ptr,
    M, N, K, stride_xm, stride_om, stride_wn, stride_sn, SPLIT, xa_ptr, lb_ptr, lora_scale,
    HAS_BIAS: gl.constexpr, USE_SPLIT: gl.constexpr, WG: gl.constexpr, BT: gl.constexpr, NS: gl.constexpr,
    XG: gl.constexpr = True, PIPE: gl.constexpr = False, NSW: gl.constexpr = 0, MT: gl.constexpr = 1,
    R: gl.constexpr = 0, PDL: gl.constexpr = False, XS: gl.constexpr = False, SK: gl.constexpr = False,
    TILED: gl.constexpr = False, EW: gl.constexpr = False, TRIG: gl.constexpr = False, RED: gl.constexpr = 1,
):
    if TRIG:  # the launch chain: the next launch (which waits for this grid before its first read) may start
        _gdc_launch_dependents()
    RW: gl.constexpr = 64 * WG * MT  # weight rows per program: MT m64 tiles per warpgroup (one x tile for all)
    NW: gl.constexpr = 4 * WG
    LW: gl.constexpr = _words_layout(WG, MT)
    LS: gl.constexpr = _scales_layout(WG, MT)
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, BT, 16])
    AOP: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    # cp.async source layouts (16 B per thread for weights and activations, 4 B for the scales)
    CW: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [NW, 1], [1, 0])  # [RW, 64] uint8
    CS: gl.constexpr = gl.BlockedLayout([1, 1], [16, 2], [NW, 1], [1, 0])  # [RW, 2] int32 (the 8 bytes)
    if XG:  # gathered: 4-byte pairs
        CX: gl.constexpr = gl.BlockedLayout([1, 2], [1, 32], [NW, 1], [1, 0])  # [BT, 128] bf16
    else:
        CX: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [NW, 1], [1, 0])  # [BT, 128] bf16
    FLAT: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    XSL: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)

    WSL: gl.constexpr = NSW if PIPE else NS  # W-ring slots
    wsm = gl.allocate_shared_memory(gl.uint8, [WSL, RW, 64], FLAT)
    ssm = gl.allocate_shared_memory(gl.int32, [WSL, RW, 2], FLAT)
    if XS:  # the ring holds the tiles as loaded; one operand tile in the wgmma layout
        xsm = gl.allocate_shared_memory(gl.bfloat16, [NS, BT, 128], FLAT)
        xop = gl.allocate_shared_memory(gl.bfloat16, [BT, 128], XSL)
    else:
        xsm = gl.allocate_shared_memory(gl.bfloat16, [NS, BT, 128], XSL)
        xop = xsm
    ws_ptr = ws_ptr.to(gl.pointer_type(gl.int32), bitcast=True)  # scale rows are 4-byte aligned (K % 64 == 0)
    wcol = gl.arange(0, 64, layout=gl.SliceLayout(0, CW))[None, :]
    scol = gl.arange(0, 2, layout=gl.SliceLayout(0, CS))[None, :]
    kl = gl.arange(0, 128, layout=gl.SliceLayout(0, CX))
    if XG:  # logical k = 16 j + 8 h + 2 c + e reads physical 32 c + 4 j + 2 h + e (pairs stay adjacent)
        kp = 32 * ((kl // 2) % 4) + 4 * (kl // 16) + 2 * ((kl // 8) % 2) + kl % 2
        kl = gl.max_contiguous(gl.multiple_of(kp, 2), 2)
    xcol = kl[None, :]
    k_steps = K // 128
    # activation-row tiles fastest: the programs of one weight tile run together (its second read hits L2)
    m_tiles = gl.cdiv(M, BT)

    if SK:  # stream-K: program p runs units [p·U // P, (p+1)·U // P) of the U = tiles · k_steps (tile, K step) units
        if EW:  # (the chain: no early weights on this schedule)
            _gdc_wait()
        P = gl.num_programs(0)
        U = gl.cdiv(N, RW) * m_tiles * k_steps
        pid = gl.program_id(0)
        u_start = pid * U // P
        u = u_start
        u_end = (pid + 1) * U // P
        while u < u_end:
            tile = u // k_steps
            ks0 = u - tile * k_steps
            ks1 = gl.minimum(k_steps, ks0 + (u_end - u))
            n0 = (tile // m_tiles) * RW
            m0 = (tile % m_tiles) * BT
            wrow, swn = _rows(n0, N, stride_wn, RW, CW, 64, 1, TILED)
            srow, ssn = _rows(n0, N, stride_sn, RW, CS, 2, 4, TILED)
            xrow = (m0 + gl.arange(0, BT, layout=gl.SliceLayout(1, CX)))[:, None]
            xmask = xrow < M
            acc = gl.zeros([RW, BT], gl.float32, layout=MMA)
            acc = _plain(acc, ks0, ks1, wsm, ssm, xsm, xop, wp_ptr, ws_ptr, xp_ptr, wrow, wcol, srow, scol, xrow,
                         xcol, xmask, swn, ssn, stride_xm, AOP, LW, LS, FLAT, RW, XG, NS, XS, CX, BT, TILED)
            if (ks0 == 0) & (ks1 == k_steps):  # the whole tile: straight out
                _output(acc, n0, m0, M, N, out_ptr, stride_om, gs_ptr, bias_ptr, xa_ptr, lb_ptr, lora_scale,
                        HAS_BIAS, R, PDL, RW, BT, NW, MMA)
            else:  # a share of the tile: partial slot 2p (the range's first segment) or 2p + 1 (its last)
                pr = gl.arange(0, RW, layout=gl.SliceLayout(1, MMA))
                pc = gl.arange(0, BT, layout=gl.SliceLayout(0, MMA))
                poffs = pr[:, None] * BT + pc[None, :]
                mine = 2 * pid + (u_start < tile * k_steps).to(gl.int32)
                gl.store(part_ptr + mine * (RW * BT) + poffs, acc)
                gl.thread_barrier()
                q0 = _first_program(tile * k_steps, P, U)
                q1 = _first_program(tile * k_steps + k_steps - 1, P, U)
                ticket = gl.atomic_add(lock_ptr + tile, 1, sem="acq_rel", scope="gpu")
                if ticket == q1 - q0:  # the last share to arrive sums them all, in program order (deterministic)
                    acc = gl.zeros([RW, BT], gl.float32, layout=MMA)
                    for q in range(q0, q1 + 1):
                        slot = 2 * q + ((q * U // P) < tile * k_steps).to(gl.int32)
                        acc += gl.load(part_ptr + slot * (RW * BT) + poffs, cache_modifier=".cg")
                    gl.atomic_xchg(lock_ptr + tile, 0)
                    _output(acc, n0, m0, M, N, out_ptr, stride_om, gs_ptr, bias_ptr, xa_ptr, lb_ptr, lora_scale,
                            HAS_BIAS, R, PDL, RW, BT, NW, MMA)
            u = tile * k_steps + ks1
    else:
        pid_n = gl.program_id(0) // m_tiles
        pid_m = gl.program_id(0) % m_tiles
        pid_s = gl.program_id(1)
        n0 = pid_n * RW
        m0 = pid_m * BT
        wrow, swn = _rows(n0, N, stride_wn, RW, CW, 64, 1, TILED)
        srow, ssn = _rows(n0, N, stride_sn, RW, CS, 2, 4, TILED)
        xrow = (m0 + gl.arange(0, BT, layout=gl.SliceLayout(1, CX)))[:, None]
        xmask = xrow < M  # async_copy broadcasts it over the columns
        per = gl.cdiv(k_steps, SPLIT)
        t0 = pid_s * per
        t1 = gl.minimum(k_steps, t0 + per)
        acc = gl.zeros([RW, BT], gl.float32, layout=MMA)
        if PIPE:
            if EW:
                _gdc_wait()
            if t0 < t1:
                acc = _pipelined(acc, t0, t1, wsm, ssm, xsm, wp_ptr, ws_ptr, xp_ptr, wrow, wcol, srow, scol, xrow,
                                 xcol, xmask, stride_wn, stride_sn, stride_xm, AOP, LW, LS, FLAT, RW, XG, NS, NSW)
        elif t0 < t1:
            acc = _plain(acc, t0, t1, wsm, ssm, xsm, xop, wp_ptr, ws_ptr, xp_ptr, wrow, wcol, srow, scol, xrow, xcol,
                         xmask, swn, ssn, stride_xm, AOP, LW, LS, FLAT, RW, XG, NS, XS, CX, BT, TILED, EW)
        elif EW:  # no K steps here: still wait before any write (the chain's order)
            _gdc_wait()
        last = True
        if USE_SPLIT:
            acc, last = _split_sum(acc, n0, m0, M, N, part_ptr, lock_ptr, pid_s, SPLIT, RW, BT, MMA, 1, 0, RED)
        if last:
            _output(acc, n0, m0, M, N, out_ptr, stride_om, gs_ptr, bias_ptr, xa_ptr, lb_ptr, lora_scale,
                    HAS_BIAS, R, PDL, RW, BT, NW, MMA)


def stream_k_owner(u: int, P: int, U: int) -> int:
    """The program of a stream-K launch of ``P`` programs over ``U`` units whose range ``[p·U // P, (p+1)·U // P)``
    holds unit ``u`` (the kernel's ``_first_program``)."""
    return ((u + 1) * P - 1) // U


def stream_k_plan(tiles: int, k_steps: int, P: int) -> list[list[tuple[int, int, int, int]]]:
    """The reference of the kernel's stream-K schedule: per program, its segments ``(tile, k0, k1, slot)`` in order
    — K steps ``k0 … k1 - 1`` of ``tile``; ``slot`` the partial-sum slot (``2p`` for the range's first segment, ``2p
    + 1`` for a later one; -1 where the segment is the whole tile and is stored directly). Every (tile, step) unit
    appears exactly once; a tile's shares are summed by the last to arrive, in program order."""
    U = tiles * k_steps
    out = []
    for p in range(P):
        u, u_end, start, segs = p * U // P, (p + 1) * U // P, p * U // P, []
        while u < u_end:
            tile, k0 = divmod(u, k_steps)
            k1 = min(k_steps, k0 + u_end - u)
            whole = k0 == 0 and k1 == k_steps
            segs.append((tile, k0, k1, -1 if whole else 2 * p + int(start < tile * k_steps)))
            u = tile * k_steps + k1
        out.append(segs)
    return out


def nvfp4_wgmma_matmul(x, packed, scale_u8, gs, bias=None, xa=None, lora_b=None, lora_scale=1.0, *, WG=1, BT=64,
                       NS=3, SPLIT=1, XG=0, PIPE=0, NSW=0, MT=1, XS=0, SK=0, xp=None, part=None, lock=None,
                       pdl=False, TILED=0, ew=False, trig=False, RED=0, **_):
    """``y [M, N] = x [M, K] · Ŵᵀ (+ bias) (+ lora_scale · xa · lora_bᵀ)`` (bf16; ``xa [M, R]``,
    ``lora_b [N, R]`` contiguous bf16, R a multiple of 16) with :func:`_nvfp4_wgmma_kernel`. ``XG=0``
    (default; faster at every tuned key): the activations are permuted first (:func:`permute_activations`,
    or ``xp`` if given); ``XG=1``: the kernel gathers them itself (4-byte copies); ``XS=1`` (plain loop
    only): it stages them through registers into the operand tile (no pre-pass). ``part`` / ``lock``: split-K
    workspace (fp32 >= SPLIT·M·N) and tickets (int32 zeros >= tiles); allocated when not given. ``TILED``: ``packed``
    and ``scale_u8`` are in the tile-contiguous layout (:mod:`qerl_kernels.layout`; plain loop, split-K or
    stream-K). ``SK``: stream-K
    (plain loop) — ``SK`` programs per SM share the ``tiles · K/128`` (tile, K step) units evenly, so no wave runs
    part-empty whatever the tile count (:func:`stream_k_plan`); ``part`` then holds 2 partial tiles per program
    (fp32 >= 2·P·RW·BT) and ``SPLIT`` is ignored. ``pdl``:
    launched as the dependent of the launch just before it (``xa`` from :mod:`qerl_kernels.lora_xa`; the
    tiles wait for it only before the LoRA epilogue). ``ew`` (the launch chain, :func:`qerl_kernels.launch.chain`;
    not with ``pdl``): launched as a programmatic dependent that issues its ring's first weight steps before it waits
    for the previous grid, then reads ``x``; its activation pre-pass (when it permutes ``x`` itself) joins the chain
    too. ``trig`` (the chain): release the next launch at the start — it waits for this grid before its first read.
    (Prefetching more of each program's weights into L2 before the wait was slower: 7B batch 8 without LoRA 3.37
    against 3.05 ms per step with 8 steps per program, H100 — it competes with the running kernel's stream.)
    ``RED``: split-K partials the last share loads per round (:func:`split_red`'s choice where 0).
    Validation is the caller's (:mod:`qerl_kernels.ops`); other keys (a config's) are ignored."""
    M, K = x.shape
    N = packed.shape[0]
    if scale_u8.dtype != torch.uint8:
        scale_u8 = scale_u8.view(torch.uint8)
    # (inside a call's scope, qerl_kernels.ops, computed once per scope; outside, on every call)
    grid, tiles, RW, SPLIT, kw = launch.memo(_static, x, M, N, K, WG, BT, NS, SPLIT, XG, PIPE, NSW, MT, XS, SK,
                                             TILED, bias is not None, lora_b.shape[1] if lora_b is not None else 0,
                                             pdl, ew, trig, RED)
    if XG or XS:
        xp = x
    elif xp is None:
        xp = permute_activations(x, wait=ew)
    out = torch.empty((M, N), device=x.device, dtype=torch.bfloat16)
    if SK:
        if part is None or part.numel() < 2 * grid[0] * RW * BT:
            part = torch.empty(2 * grid[0] * RW * BT, device=x.device, dtype=torch.float32)
        if lock is None or lock.numel() < tiles:
            lock = torch.zeros(tiles, device=x.device, dtype=torch.int32)
    elif SPLIT > 1:
        if part is None:
            part = torch.empty(SPLIT * M * N, device=x.device, dtype=torch.float32)
        if lock is None:
            lock = torch.zeros(tiles, device=x.device, dtype=torch.int32)
    else:
        part = out
        lock = torch.zeros(1, device=x.device, dtype=torch.int32) if lock is None else lock
    launch.run(_nvfp4_wgmma_kernel, grid, (
        xp, packed, scale_u8, gs, out, bias if bias is not None else out, part, lock,
        M, N, K, xp.stride(0), out.stride(0), packed.stride(0), scale_u8.stride(0), SPLIT,
        xa if xa is not None else out, lora_b if lora_b is not None else out, float(lora_scale)), kw)
    return out


def _static(x, M, N, K, WG, BT, NS, SPLIT, XG, PIPE, NSW, MT, XS, SK, TILED, has_bias, R, pdl, ew, trig,
            RED=0) -> tuple:
    """:func:`nvfp4_wgmma_matmul`'s argument checks and static part — ``(grid, tiles, weight rows per program,
    SPLIT, kernel keywords)`` — once per :mod:`qerl_kernels.launch` scope (the scope fixes every argument; of ``x``,
    the activations, only the device is read: stream-K sizes its grid by the SMs)."""
    if TILED and (PIPE or N % 64):
        raise ValueError(f"nvfp4_wgmma: TILED weights (qerl_kernels.layout) run the plain loop (split-K or stream-K) "
                         f"with N % 64 == 0, got PIPE={PIPE} N={N}")
    if XS and (XG or PIPE):
        raise ValueError(f"nvfp4_wgmma: XS (activations staged in the kernel) excludes XG and PIPE, got XG={XG} "
                         f"PIPE={PIPE}")
    if SK and PIPE:
        raise ValueError("nvfp4_wgmma: SK (stream-K) runs the plain loop, got PIPE=1")
    RW = 64 * WG * MT
    tiles = launch.cdiv(N, RW) * launch.cdiv(M, BT)
    if SK:
        grid, SPLIT = (min(int(SK) * _sms(x.device), tiles * (K // 128)), 1), 1
    else:
        grid = (tiles, SPLIT) if SPLIT > 1 else (tiles, 1)
    return grid, tiles, RW, SPLIT, _kwargs(WG, BT, NS, SPLIT, XG, PIPE, NSW, MT, XS, SK, TILED, has_bias, R, pdl, ew,
                                           trig, RED)


def _kwargs(WG, BT, NS, SPLIT, XG, PIPE, NSW, MT, XS, SK, TILED, has_bias, R, pdl, ew, trig, RED=0) -> dict:
    """The kernel's constexprs and launch options for a config (:func:`nvfp4_wgmma_matmul`)."""
    red = (int(RED) or split_red(64 * WG * MT, BT, 4 * WG)) if SPLIT > 1 else 1
    return dict(HAS_BIAS=has_bias, USE_SPLIT=SPLIT > 1, WG=WG, BT=BT, NS=NS, XG=bool(XG), PIPE=bool(PIPE),
                NSW=max(int(NSW), NS) if PIPE else 0, MT=int(MT), R=R, PDL=bool(pdl), XS=bool(XS), SK=bool(SK),
                TILED=bool(TILED), EW=bool(ew), TRIG=bool(trig), RED=red, num_warps=4 * WG,
                **({"launch_pdl": True} if pdl or ew else {}))
