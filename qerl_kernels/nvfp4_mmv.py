"""NVFP4 decode matmul on tensor cores with register-resident fragments (Marlin-style):
``y [M, N] = x [M, K] · Ŵᵀ (+ bias) (+ s · xa · Bᵀ)``, 8 x NB activation rows per program (NB 1, 2, 4, 8).

Why: Triton's ``tl.dot`` needs the dequantized bf16 weight tile in its own MMA fragment layout and
moves it there through shared memory (4 bytes of shared-memory traffic per weight: the limit of
:mod:`.nvfp4_matmul` at decode sizes), and the CUDA-core path (:mod:`.nvfp4_gemv`) pays one
bf16->fp32 move and one FMA per weight and activation row. Here every thread loads exactly the packed
words whose weights its ``mma.sync.m16n8k16`` A fragment needs, decodes them in registers and feeds
them to the tensor core directly; nothing goes through shared memory.

The trick (as in Marlin) is that the order of the reduction index is free: the MMA's *logical* k
can be any permutation of the *physical* k as long as A (weights) and B (activations) use the same
one. Thread ``(g, c) = (lane // 4, lane % 4)`` of a warp owns weight rows ``g`` and ``g + 8`` of the
warp's 16 rows and the 4 packed words ``4c .. 4c+3`` (32 weights, one LDG.128 per row) of each
128-wide K step; the word decode (:func:`qerl_kernels.nvfp4_gemv._word_pairs` with the block scale)
yields bf16x2 pairs of nibbles ``(3-i, 7-i)``, and MMA ``(w, h)`` (word w, half h) takes
``A = (P[g][w][2h], P[g+8][w][2h], P[g][w][2h+1], P[g+8][w][2h+1])`` — logical k ``2c, 2c+1`` are the
physical nibbles ``(3-2h, 7-2h)`` of word ``4c+w``, logical ``2c+8, 2c+9`` the nibbles ``(2-2h, 6-2h)``.
The thread's B fragment is built from activation row ``m = g`` at the same physical k with one
``prmt`` per register. 8 MMAs per step and activation block;
the fp32 accumulator (4 registers per block) is the C fragment: ``c0, c1 = y[2c, 2c+1][row g]``,
``c2, c3 = y[2c, 2c+1][row g+8]`` (block b: rows + 8b).

``RB = 2`` gives each warp two such blocks of 16 weight rows (g, g+8, g+16, g+24): the activation B
fragments are loaded and permuted once and feed both blocks' MMAs, halving the L1 traffic and ``prmt``
work per weight (the activation loads, not DRAM, limit this kernel from M = 16 up).

Every value here is one per thread (tensors of shape ``[32 · num_warps]`` whose element is identified
by the holding thread's ``%tid.x``, so the code does not depend on how Triton lays the tensor out).
Cost per weight: 3.6 SASS instructions in the main loop for 8 activation rows (decode 2.4), 4.2 for 16,
vs ~6 on the CUDA-core path for one row (``python tools/inspect_ir.py --kind mmv``). CUDA only: the CPU interpreter cannot run PTX, so
:mod:`qerl_kernels.ops` runs :mod:`.nvfp4_gemv`'s interpreter twin there, and
``tests/kernels/test_mmv_fragments.py`` replays this kernel's per-lane data flow in NumPy against
the PTX ISA's fragment tables.
"""
from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from qerl_kernels.nvfp4_gemv import _word_pairs

@triton.jit
def _tid(like):
    return tl.inline_asm_elementwise("mov.u32 $0, %tid.x;", "=r,r", [like], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _stamp(tr, slot: tl.constexpr, TRACE: tl.constexpr):
    """TRACE (diagnostics, ``tools/lora_trace.py``): thread 0 writes ``%globaltimer`` (ns) — or, for
    slot 1, ``%smid`` — into ``tr[slot]`` (int64 pointer: this program's 8 slots)."""
    if TRACE:
        like = tl.arange(0, 32)
        if slot == 1:
            v = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r,r", [like], dtype=tl.int32, is_pure=False,
                                          pack=1).to(tl.int64)
        else:
            v = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [like], dtype=tl.int64,
                                          is_pure=False, pack=1)
        tl.store(tr + slot + like * 0, v, mask=_tid(like) == 0)


@triton.jit
def _trace_ptr(xap_ptr, XP, R: tl.constexpr):
    """This program's 8 int64 trace slots, after the producers' partials in ``xap``."""
    pid = tl.program_id(0) + tl.num_programs(0) * (tl.program_id(1) + tl.num_programs(1) * tl.program_id(2))
    base = (xap_ptr + XP * 16 * R).to(tl.pointer_type(tl.int64))
    return base + pid.to(tl.int64) * 8


@triton.jit
def _ld128(addr, pred, STREAM: tl.constexpr, L2: tl.constexpr = 0):
    """4 x b32 at ``addr`` (int64, 16-byte aligned) when ``pred != 0`` (a constexpr: always), else zeros.
    ``STREAM``: read once (weights: no L1 allocation); else L1-cached (activations: every warp of the
    SM reads them). ``L2`` 128 | 256: the load asks L2 to fetch that many bytes around ``addr`` (the
    row's next steps: DRAM reads in flight without registers to hold them)."""
    hint: tl.constexpr = (".L1::no_allocate" if STREAM else "") + (f".L2::{L2}B" if L2 else "")
    if isinstance(pred, tl.constexpr):  # always loads (no predicate, no zeroing moves)
        return tl.inline_asm_elementwise(
            asm="ld.global.nc" + hint + ".v4.u32 {$0, $1, $2, $3}, [$4];", constraints="=r,=r,=r,=r,l",
            args=[addr], dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=False, pack=1)
    return tl.inline_asm_elementwise(
        asm="""
        {
        .reg .pred p;
        setp.ne.b32 p, $5, 0;
        mov.b32 $0, 0; mov.b32 $1, 0; mov.b32 $2, 0; mov.b32 $3, 0;
        @p ld.global.nc""" + hint + """.v4.u32 {$0, $1, $2, $3}, [$4];
        }
        """,
        constraints="=r,=r,=r,=r,l,r", args=[addr, pred], dtype=(tl.int32, tl.int32, tl.int32, tl.int32),
        is_pure=False, pack=1)


@triton.jit
def _prefetch_l2(addr):
    """``prefetch.global.L2`` of the line holding ``addr`` (int64; a valid address): no register waits
    for it. Returns a dummy 0 (the asm has side effects, so it stays)."""
    return tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.b32 $0, 0;", "=r,l", [addr], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def _prmt(a, b, sel: tl.constexpr):
    return tl.inline_asm_elementwise(f"prmt.b32 $0, $1, $2, {sel};", "=r,r,r", [a, b], dtype=tl.int32,
                                     is_pure=True, pack=1)


@triton.jit
def _mma(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
    """One warp-wide ``mma.sync.m16n8k16`` bf16 x bf16 -> fp32 on per-thread fragments."""
    return tl.inline_asm_elementwise(
        asm="mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {$0, $1, $2, $3}, {$4, $5, $6, $7}, "
            "{$8, $9}, {$10, $11, $12, $13};",
        constraints="=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f", args=[a0, a1, a2, a3, b0, b1, c0, c1, c2, c3],
        dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True, pack=1)


@triton.jit
def _scale2(sb):
    """E4M3 scale bits (uint8) -> int32 bf16x2 ``(s · 2^119, s · 2^119)`` for the word decode."""
    s = (sb.to(tl.float8e4nv, bitcast=True).to(tl.float32) * 6.646139978924579e35).to(tl.bfloat16)
    s16 = s.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    return s16 | (s16 << 16)


@triton.jit
def _step(acc, qs, s2, us, w: tl.constexpr, NB: tl.constexpr, RB: tl.constexpr):
    """The MMAs of word ``w`` of this thread for each of its RB row blocks (rows a / b of block r:
    words ``qs[2r][w]`` / ``qs[2r+1][w]``, bf16x2 scales ``s2[2i + w // 2]`` of row i) and each of the
    NB blocks of 8 activation rows (activation words ``us[b]``, 16 per block; their B fragments are
    built once and shared by the row blocks). Accumulator of (activation block b, row block r):
    ``acc[b * RB + r]``."""
    pp = ()
    for i in tl.static_range(2 * RB):
        pp = pp + (_word_pairs(qs[i][w], s2[2 * i + w // 2]),)
    for h in tl.static_range(2):
        new = ()
        for b in tl.static_range(NB):
            u = us[b]
            x0 = _prmt(u[4 * w + 1 - h], u[4 * w + 3 - h], 0x7632)  # (x[8w+3-2h], x[8w+7-2h])
            x1 = _prmt(u[4 * w + 1 - h], u[4 * w + 3 - h], 0x5410)  # (x[8w+2-2h], x[8w+6-2h])
            for r in tl.static_range(RB):
                pa = pp[2 * r]
                pb = pp[2 * r + 1]
                c0, c1, c2, c3 = acc[b * RB + r]
                new = new + (_mma(pa[2 * h], pb[2 * h], pa[2 * h + 1], pb[2 * h + 1], x0, x1, c0, c1, c2, c3),)
        acc = new
    return acc


@triton.jit
def _x_words(xr, t, kin):
    x0 = _ld128(xr + t * 256, kin, False)
    x1 = _ld128(xr + t * 256 + 16, kin, False)
    x2 = _ld128(xr + t * 256 + 32, kin, False)
    x3 = _ld128(xr + t * 256 + 48, kin, False)
    return (x0[0], x0[1], x0[2], x0[3], x1[0], x1[1], x1[2], x1[3], x2[0], x2[1], x2[2], x2[3],
            x3[0], x3[1], x3[2], x3[3])


@triton.jit
def _all_x(xrs, t, kin, NB: tl.constexpr):
    us = ()
    for b in tl.static_range(NB):
        us = us + (_x_words(xrs[b], t, kin),)
    return us


@triton.jit
def _loads(ws, xrs, ss, t, t1, c, K, EVEN_K: tl.constexpr, NB: tl.constexpr, XPRE: tl.constexpr,
           L2: tl.constexpr, PFD: tl.constexpr, RB: tl.constexpr):
    """Everything step t needs: 4 packed words of each of the thread's 2 x RB weight rows (byte
    addresses ``ws``), 16 activation words (32 bf16) of each activation row block, the 2 block scales of
    each row (``ss``). Rows beyond N / M read a valid row (their results are never stored). Steps at or
    past ``t1`` (the unrolled loop's overrun) load zero scales, so their MMAs add exactly 0 (e2m1 · 0;
    activations are finite); a K tail loads zeros everywhere."""
    ok = t < t1
    if EVEN_K:  # overrun steps re-read the last step (in bounds) and are zeroed by their zero scales
        t = tl.minimum(t, t1 - 1)
        kin = tl.constexpr(1)
    else:
        ok = ok & (t * 128 + c * 32 < K)
        kin = ok.to(tl.int32)
    qs = ()
    sc = ()
    for i in tl.static_range(2 * RB):
        if PFD > 0:  # this row's step t + PFD into L2 (clamped to the row; 4 lanes share the line)
            _prefetch_l2(ws[i] + tl.minimum(t + PFD, (K - 1) // 128) * 64)
        qs = qs + (_ld128(ws[i] + t * 64, kin, True, L2),)
        sc = sc + (tl.load(ss[i] + t * 8, mask=ok, other=0), tl.load(ss[i] + t * 8 + 1, mask=ok, other=0))
    if XPRE:  # activations prefetched with the weights (16 more live registers per block of 8 rows)
        us = _all_x(xrs, t, kin, NB)
    else:  # loaded (from L1) by _compute when needed: fewer registers, more resident warps
        us = (t, kin)
    return qs, us, sc


@triton.jit
def _compute(acc, ld, xrs, NB: tl.constexpr, XPRE: tl.constexpr, RB: tl.constexpr):
    qs, us, sc = ld
    if not XPRE:  # us carries (t, kin)
        us = _all_x(xrs, us[0], us[1], NB)
    s2 = ()
    for i in tl.static_range(4 * RB):
        s2 = s2 + (_scale2(sc[i]),)
    for w in tl.static_range(4):
        acc = _step(acc, qs, s2, us, w, NB, RB)
    return acc


@triton.jit
def _out(c, lo, m, n, M, N, inv, bias_ptr, out_ptr, stride_om, lora_scale, HAS_BIAS: tl.constexpr, R: tl.constexpr):
    y = c * inv
    if HAS_BIAS:
        y += tl.load(bias_ptr + n, mask=n < N, other=0.0).to(tl.float32)
    if R > 0:
        y += lora_scale * lo
    tl.store(out_ptr + m * stride_om + n, y.to(out_ptr.dtype.element_ty), mask=(m < M) & (n < N))


@triton.jit
def _lora_b(lb_ptr, la, lb_, c, R: tl.constexpr):
    """The A fragments of the LoRA up-projection: rows na = la, nb = lb_ of ``lora_b [N, R]`` (bf16
    pairs, one 32-bit load each; k = r in order), R / 16 MMAs' worth. Independent of ``xa``, so the
    epilogue issues these loads before it waits for the fused producers."""
    ai = lb_ptr.to(tl.pointer_type(tl.int32))
    ra = ai + la * (R // 2) + c
    rb = ai + lb_ * (R // 2) + c
    out = ()
    for j in tl.static_range(R // 16):
        out = out + ((tl.load(ra + 8 * j), tl.load(rb + 8 * j), tl.load(ra + 8 * j + 4), tl.load(rb + 8 * j + 4)),)
    return out


@triton.jit
def _lora(xa_ptr, bf, g, c, pid_m, M, R: tl.constexpr, NB: tl.constexpr, like):
    """LoRA up-projection ``xa · Bᵀ`` on the tensor cores, as C fragments laid out like the main
    accumulator (``bf``: the rows of ``lora_b`` as the MMA's A, from :func:`_lora_b`; ``xa [M, R]``
    rows as its B; the rank R, a multiple of 16, is the reduction): R / 16 MMAs per activation block."""
    xi = xa_ptr.to(tl.pointer_type(tl.int32))
    z = tl.zeros(like.shape, tl.float32)
    out = ()
    for b in tl.static_range(NB):
        xr = xi + tl.minimum(pid_m * (8 * NB) + 8 * b + g, M - 1) * (R // 2) + c
        c0, c1, c2, c3 = z, z, z, z
        for j in tl.static_range(R // 16):
            a0, a1, a2, a3 = bf[j]
            c0, c1, c2, c3 = _mma(a0, a1, a2, a3, tl.load(xr + 8 * j, cache_modifier=".cg"),
                                  tl.load(xr + 8 * j + 4, cache_modifier=".cg"), c0, c1, c2, c3)
        out = out + ((c0, c1, c2, c3),)
    return out


@triton.jit
def _partial(base, c, m, n, M, N):
    tl.store(base + m * N + n, c, mask=(m < M) & (n < N))


@triton.jit
def _reduced(part_ptr, m, n, M, N, SPLIT):
    y = tl.zeros(m.shape, tl.float32)
    for j in range(SPLIT):
        y += tl.load(part_ptr + j * M * N + m * N + n, mask=(m < M) & (n < N), other=0.0, cache_modifier=".cg")
    return y


@triton.jit
def _xa_partial(p, x_ptr, la_ptr, M, K, stride_xm, XP, R: tl.constexpr, KB: tl.constexpr, STAGES: tl.constexpr = 1):
    """Program ``p`` of XP: ``x [M <= 16, Kp] · lora_a[:, Kp]ᵀ`` over its KB-wide K chunks p, p + XP, …
    (``tl.dot``, fp32 [16, R]; rows >= M are 0). Shared by the fused producers and :mod:`.lora_xa`;
    ``STAGES`` > 1: the chunk loop software-pipelined by Triton (the PDL primary above K = 8192)."""
    rows = tl.arange(0, 16)
    rr = tl.arange(0, R)
    kk = tl.arange(0, KB)
    acc = tl.zeros((16, R), tl.float32)
    for k0 in tl.range(p * KB, K, XP * KB, num_stages=STAGES):
        offs = k0 + kk
        km = offs < K
        xb = tl.load(x_ptr + rows[:, None] * stride_xm + offs[None, :], mask=(rows < M)[:, None] & km[None, :],
                     other=0.0)
        ab = tl.load(la_ptr + rr[:, None] * K + offs[None, :], mask=km[None, :], other=0.0)
        acc += tl.dot(xb, tl.trans(ab))
    return acc


@triton.jit
def _xa_sum(p, acc, xa_ptr, xap_ptr, lock_ptr, XP, R: tl.constexpr, QB: tl.constexpr, tr, TRACE: tl.constexpr,
            XR: tl.constexpr = 0):
    """Store program ``p``'s partial into ``xap [XP, 16, R]`` and take a ticket (``lock[0]``); the last
    program sums the XP partials in a fixed order (QB of all 16 rows per load, deterministic; masking rows
    >= M, which are 0, cost the fused decode kernel 6 registers), stores ``xa [16, R]`` in bf16 (as
    ``x @ lora_a.T`` would) and resets the ticket. Returns whether this program was the last (its ``xa``
    stores are then complete for the whole program). ``XR``: ``xa``'s row stride when it is wider than R (one
    chunk of R ranks of a wider adapter, :mod:`qerl_kernels.lora_xa`); 0: R."""
    rows = tl.arange(0, 16)
    rr = tl.arange(0, R)
    tile = rows[:, None] * R + rr[None, :]
    tl.store(xap_ptr + p * 16 * R + tile, acc)
    tl.debug_barrier()  # every thread's partial is written before the (releasing) ticket
    ticket = tl.atomic_add(lock_ptr, 1, sem="acq_rel", scope="gpu")
    _stamp(tr, 3, TRACE)  # ticket back
    last = ticket == XP - 1
    if last:
        qq = tl.arange(0, QB)
        tot = tl.zeros((16, R), tl.float32)
        for q0 in range(0, XP, QB):
            q = q0 + qq
            part = tl.load(xap_ptr + q[:, None, None] * (16 * R) + tile[None, :, :],
                           mask=(q < XP)[:, None, None], other=0.0, cache_modifier=".cg")
            tot += tl.sum(part, axis=0)
        if XR:
            tl.store(xa_ptr + rows[:, None] * XR + rr[None, :], tot.to(xa_ptr.dtype.element_ty))
        else:
            tl.store(xa_ptr + tile, tot.to(xa_ptr.dtype.element_ty))
        tl.debug_barrier()
        tl.atomic_xchg(lock_ptr, 0)
    return last


@triton.jit
def _xa_producer(p, x_ptr, la_ptr, xa_ptr, xap_ptr, xlock_ptr, M, K, stride_xm, XP, R: tl.constexpr,
                 TRACE: tl.constexpr = False):
    """Program ``p`` < XP of a fused-LoRA launch: its partial ``x · lora_aᵀ`` over 64-wide K chunks
    (:func:`_xa_partial`) goes to ``xap [XP, 16, R]``; the last producer to finish sums the partials
    (:func:`_xa_sum`, 4 per load) into ``xa`` and raises the ready flag ``xlock[1]`` (release). Small
    operand tiles on purpose: shared memory taken here is L1 taken from the tiles, which read the
    activations through L1 (a 256-wide single-shot version, 24 KB of shared memory, made the launch up to
    70% slower)."""
    acc = _xa_partial(p, x_ptr, la_ptr, M, K, stride_xm, XP, R, 64)
    tr = _trace_ptr(xap_ptr, XP, R)
    _stamp(tr, 2, TRACE)  # producer: partial computed
    if _xa_sum(p, acc, xa_ptr, xap_ptr, xlock_ptr, XP, R, 4, tr, TRACE):
        tl.atomic_xchg(xlock_ptr + 1, 1, sem="release", scope="gpu")
        _stamp(tr, 4, TRACE)  # the last producer: flag raised


@triton.jit
def _await_xa(xlock_ptr):
    """Spin until the producers' ready flag is up (acquire), then count this consumer in: returns its
    arrival index. Only programs that have finished their main loop wait, and producers are the
    launch's lowest program ids (dispatched first). Counting right after the wait (not after the
    stores) keeps that atomic's round trip off the tail of the launch: the flag may be reset as soon
    as every consumer is past its wait (``xa`` itself stays until the next launch, stream-ordered)."""
    ready = tl.atomic_add(xlock_ptr + 1, 0, sem="acquire", scope="gpu")
    while ready == 0:
        ready = tl.atomic_add(xlock_ptr + 1, 0, sem="acquire", scope="gpu")
    return tl.atomic_add(xlock_ptr + 2, 1, sem="relaxed", scope="gpu")


@triton.jit
def _release_xa(xlock_ptr, arrival, n_cons):
    """The last consumer to arrive resets the counter and the flag for the next launch."""
    if arrival == n_cons - 1:
        tl.atomic_xchg(xlock_ptr + 2, 0)
        tl.atomic_xchg(xlock_ptr + 1, 0, sem="release", scope="gpu")


@triton.jit(do_not_specialize=["M", "SPLIT", "XP"])
def _nvfp4_mmv_kernel(
    x_ptr, wp_ptr, ws_ptr, gs_ptr, out_ptr, bias_ptr, xa_ptr, lb_ptr, part_ptr, lock_ptr, la_ptr, xap_ptr, xlock_ptr,
    M, N, K, stride_xm, stride_om, stride_wn, stride_sn, lora_scale, SPLIT,
    HAS_BIAS: tl.constexpr, R: tl.constexpr, USE_SPLIT: tl.constexpr, EVEN_K: tl.constexpr, WARPS: tl.constexpr,
    NB: tl.constexpr, PREFETCH: tl.constexpr, XPRE: tl.constexpr, L2: tl.constexpr = 0, PFD: tl.constexpr = 0,
    FUSED: tl.constexpr = False, UNROLL: tl.constexpr = False, XP=0, RB: tl.constexpr = 1,
    TRACE: tl.constexpr = False, PDL: tl.constexpr = False,
):
    if TRACE:  # diagnostics (tools/lora_trace.py): per-program timestamps after the producers' partials
        tr = _trace_ptr(xap_ptr, XP, R)
        _stamp(tr, 0, TRACE)
        _stamp(tr, 1, TRACE)
    pid_n = _tile_pid(x_ptr, la_ptr, xa_ptr, xap_ptr, xlock_ptr, M, K, stride_xm, XP, R, FUSED, TRACE)
    if pid_n >= 0:
        _mmv_tile(pid_n, x_ptr, wp_ptr, ws_ptr, gs_ptr, out_ptr, bias_ptr, xa_ptr, lb_ptr, part_ptr, lock_ptr,
                  xlock_ptr, M, N, K, stride_xm, stride_om, stride_wn, stride_sn, lora_scale, SPLIT, HAS_BIAS, R,
                  USE_SPLIT, EVEN_K, WARPS, NB, PREFETCH, XPRE, L2, PFD, FUSED, UNROLL, XP, RB, xap_ptr, TRACE, PDL)


@triton.jit
def _tile_pid(x_ptr, la_ptr, xa_ptr, xap_ptr, xlock_ptr, M, K, stride_xm, XP, R: tl.constexpr, FUSED: tl.constexpr,
              TRACE: tl.constexpr = False):
    """The output tile (axis-0 index) this program computes; negative for a producer. FUSED (LoRA
    down-projection in this launch): programs (0..XP-1, 0, 0) compute
    xa = x · lora_aᵀ into xa_ptr (see _xa_producer) and the others are the tiles, shifted by XP, which
    wait for xa before their epilogue."""
    pid = tl.program_id(0)
    if FUSED:
        if pid < XP:
            if (tl.program_id(1) == 0) & (tl.program_id(2) == 0):
                _xa_producer(pid, x_ptr, la_ptr, xa_ptr, xap_ptr, xlock_ptr, M, K, stride_xm, XP, R, TRACE)
        pid = pid - XP
    return pid


@triton.jit
def _mmv_tile(
    pid_n, x_ptr, wp_ptr, ws_ptr, gs_ptr, out_ptr, bias_ptr, xa_ptr, lb_ptr, part_ptr, lock_ptr, xlock_ptr,
    M, N, K, stride_xm, stride_om, stride_wn, stride_sn, lora_scale, SPLIT,
    HAS_BIAS: tl.constexpr, R: tl.constexpr, USE_SPLIT: tl.constexpr, EVEN_K: tl.constexpr, WARPS: tl.constexpr,
    NB: tl.constexpr, PREFETCH: tl.constexpr, XPRE: tl.constexpr, L2: tl.constexpr, PFD: tl.constexpr,
    FUSED: tl.constexpr, UNROLL: tl.constexpr, XP, RB: tl.constexpr, xap_ptr=None, TRACE: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    # program (pid_n, pid_m, pid_s): weight rows pid_n*16*RB*WARPS .. (RB blocks of 16 per warp: the
    # activation B fragments, loaded and permuted once, feed RB MMAs) x activation rows
    # pid_m*8*NB .. +8*NB (NB blocks of 8), K steps pid_s::SPLIT-th share; loads run PREFETCH (1 or 2)
    # steps ahead into registers; XPRE=0 loads the activations at use instead (fewer registers); L2 (128 |
    # 256) asks L2 for that many bytes per weight load; PFD > 0 prefetches each row's step t + PFD into L2.
    # Requires K % 32 == 0 and 16-byte aligned rows (checked by ops).
    T: tl.constexpr = 32 * WARPS
    pid_m = tl.program_id(1)
    pid_s = tl.program_id(2)
    tid = _tid(tl.arange(0, T))
    lane = tid & 31
    g = lane >> 2
    c = lane & 3
    # weight rows of this thread's A fragments: rows a, b = g, g + 8 of each of the warp's RB blocks of 16
    n0 = pid_n * (16 * RB * WARPS) + (tid >> 5) * (16 * RB) + g
    rows = ()
    lrows = ()  # rows beyond the matrix load a valid row; their outputs are not stored
    ws = ()  # byte addresses of the thread's 16 bytes of each row in step 0 (+ 64 per step)
    ss = ()  # its 2 scale bytes of each row in step 0 (+ 8 per step)
    for i in tl.static_range(2 * RB):
        rows = rows + (n0 + 8 * i,)
        lrows = lrows + (tl.minimum(n0 + 8 * i, N - 1),)
        ws = ws + (wp_ptr.to(tl.int64) + lrows[i].to(tl.int64) * stride_wn + c * 16,)
        ss = ss + (ws_ptr + lrows[i] * stride_sn + 2 * c,)
    xrs = ()  # per activation block b: this thread's B-fragment row pid_m*8*NB + 8b + g
    for b in tl.static_range(NB):
        mx = pid_m * (8 * NB) + 8 * b + g
        xrs = xrs + (x_ptr.to(tl.int64) + tl.minimum(mx, M - 1).to(tl.int64) * (stride_xm * 2) + c * 64,)
    z = tl.zeros((T,), tl.float32)
    acc = ()
    for i in tl.static_range(NB * RB):
        acc = acc + ((z, z, z, z),)
    k_steps = tl.cdiv(K, 128)
    if UNROLL:
        # unrolled PREFETCH + 1 times over as many register buffers (no rotation moves: 243 instead of
        # 277 SASS instructions per step) — but ptxas then sinks the next buffer's loads towards their
        # use, and the H200 benchmark measured it ~3% slower (median, decode shapes) than the rotation;
        # splits are whole unrolled iterations, and the last iteration's overrun loads zero scales
        U: tl.constexpr = PREFETCH + 1
        per_split = tl.cdiv(tl.cdiv(k_steps, SPLIT), U) * U
        t0 = pid_s * per_split
        t1 = tl.minimum(k_steps, t0 + per_split)
        if t0 < t1:
            p0 = _loads(ws, xrs, ss, t0, t1, c, K, EVEN_K, NB, XPRE, L2, PFD, RB)
            if PREFETCH == 2:
                p1 = _loads(ws, xrs, ss, t0 + 1, t1, c, K, EVEN_K, NB, XPRE, L2, PFD, RB)
                for t in range(t0, t1, 3):
                    p2 = _loads(ws, xrs, ss, t + 2, t1, c, K, EVEN_K, NB, XPRE, L2, PFD, RB)
                    acc = _compute(acc, p0, xrs, NB, XPRE, RB)
                    p0 = _loads(ws, xrs, ss, t + 3, t1, c, K, EVEN_K, NB, XPRE, L2, PFD, RB)
                    acc = _compute(acc, p1, xrs, NB, XPRE, RB)
                    p1 = _loads(ws, xrs, ss, t + 4, t1, c, K, EVEN_K, NB, XPRE, L2, PFD, RB)
                    acc = _compute(acc, p2, xrs, NB, XPRE, RB)
            else:
                for t in range(t0, t1, 2):
                    p1 = _loads(ws, xrs, ss, t + 1, t1, c, K, EVEN_K, NB, XPRE, L2, PFD, RB)
                    acc = _compute(acc, p0, xrs, NB, XPRE, RB)
                    p0 = _loads(ws, xrs, ss, t + 2, t1, c, K, EVEN_K, NB, XPRE, L2, PFD, RB)
                    acc = _compute(acc, p1, xrs, NB, XPRE, RB)
    else:  # rotating prefetch (the tuned default): loads run PREFETCH steps ahead, clamped to the range
        per_split = tl.cdiv(k_steps, SPLIT)
        t0 = pid_s * per_split
        t1 = tl.minimum(k_steps, t0 + per_split)
        if t0 < t1:
            nxt = _loads(ws, xrs, ss, t0, t1, c, K, EVEN_K, NB, XPRE, L2, PFD, RB)
            if PREFETCH == 2:
                nxt2 = _loads(ws, xrs, ss, tl.minimum(t0 + 1, t1 - 1), t1, c, K, EVEN_K, NB, XPRE, L2, PFD, RB)
                for t in range(t0, t1):
                    cur = nxt
                    nxt = nxt2
                    nxt2 = _loads(ws, xrs, ss, tl.minimum(t + 2, t1 - 1), t1, c, K, EVEN_K, NB, XPRE, L2, PFD, RB)
                    acc = _compute(acc, cur, xrs, NB, XPRE, RB)
            else:
                for t in range(t0, t1):
                    cur = nxt
                    nxt = _loads(ws, xrs, ss, tl.minimum(t + 1, t1 - 1), t1, c, K, EVEN_K, NB, XPRE, L2, PFD, RB)
                    acc = _compute(acc, cur, xrs, NB, XPRE, RB)
    if TRACE:
        _stamp(_trace_ptr(xap_ptr, XP, R), 2, TRACE)  # tile: main loop done
    _epilogue(acc, pid_n, pid_m, pid_s, g, c, rows, lrows, z, gs_ptr, out_ptr, bias_ptr, xa_ptr, lb_ptr, part_ptr,
              lock_ptr, xlock_ptr, M, N, stride_om, lora_scale, SPLIT, HAS_BIAS, R, USE_SPLIT, NB, FUSED, XP, RB, PDL)
    if TRACE:
        _stamp(_trace_ptr(xap_ptr, XP, R), 4, TRACE)  # tile: stored


@triton.jit
def _epilogue(acc, pid_n, pid_m, pid_s, g, c, rows, lrows, z, gs_ptr, out_ptr, bias_ptr, xa_ptr, lb_ptr, part_ptr,
              lock_ptr, xlock_ptr, M, N, stride_om, lora_scale, SPLIT, HAS_BIAS: tl.constexpr, R: tl.constexpr,
              USE_SPLIT: tl.constexpr, NB: tl.constexpr, FUSED: tl.constexpr, XP, RB: tl.constexpr,
              PDL: tl.constexpr = False):
    """Everything after the main loop of a tile: the split-K
    partials and their reduction by the last program of the tile, 1/gs, bias, the LoRA up-projection
    (after the fused producers' ready flag, or — PDL — after the preceding ``lora_xa`` grid) and the bf16
    stores."""
    # C fragment of (activation block b, row block r) = acc[b * RB + r]: (c0, c1) = y[m, m+1][rows[2r]],
    # (c2, c3) = y[m, m+1][rows[2r + 1]] with m = pid_m*8*NB + 8b + 2c
    m0 = pid_m * (8 * NB) + 2 * c
    last = True
    if USE_SPLIT:
        base = part_ptr + pid_s * M * N
        for i in tl.static_range(NB * RB):
            c0, c1, c2, c3 = acc[i]
            m = m0 + 8 * (i // RB)
            na = rows[2 * (i % RB)]
            nb = rows[2 * (i % RB) + 1]
            _partial(base, c0, m, na, M, N)
            _partial(base, c1, m + 1, na, M, N)
            _partial(base, c2, m, nb, M, N)
            _partial(base, c3, m + 1, nb, M, N)
        tl.debug_barrier()  # every thread's partial is written before the (releasing) ticket
        tile = pid_m * tl.num_programs(0) + pid_n  # < num_programs(0) * num_programs(1) (ops checks the slots)
        ticket = tl.atomic_add(lock_ptr + tile, 1, sem="acq_rel", scope="gpu")
        last = ticket == SPLIT - 1
        if last:
            red = ()
            for i in tl.static_range(NB * RB):
                m = m0 + 8 * (i // RB)
                na = rows[2 * (i % RB)]
                nb = rows[2 * (i % RB) + 1]
                red = red + ((_reduced(part_ptr, m, na, M, N, SPLIT), _reduced(part_ptr, m + 1, na, M, N, SPLIT),
                              _reduced(part_ptr, m, nb, M, N, SPLIT), _reduced(part_ptr, m + 1, nb, M, N, SPLIT)),)
            acc = red
            tl.atomic_xchg(lock_ptr + tile, 0)
    if last:
        inv = 128.0 / tl.load(gs_ptr)  # undo the 2^-7 of the decoded weights, apply 1/gs
        arrival = 0
        if R > 0:
            bf = ()  # lora_b fragments of each row block: loaded before the wait (they do not need xa)
            for r in tl.static_range(RB):
                bf = bf + (_lora_b(lb_ptr, lrows[2 * r], lrows[2 * r + 1], c, R),)
            if FUSED:
                arrival = _await_xa(xlock_ptr)
            if PDL:  # xa comes from the preceding launch (qerl_kernels.lora_xa): wait for that grid
                gdc_wait()
            lo = ()  # per row block r: NB C fragments of xa · Bᵀ
            for r in tl.static_range(RB):
                lo = lo + (_lora(xa_ptr, bf[r], g, c, pid_m, M, R, NB, z),)
        for i in tl.static_range(NB * RB):
            c0, c1, c2, c3 = acc[i]
            if R > 0:
                l0, l1, l2, l3 = lo[i % RB][i // RB]
            else:
                l0, l1, l2, l3 = z, z, z, z
            m = m0 + 8 * (i // RB)
            na = rows[2 * (i % RB)]
            nb = rows[2 * (i % RB) + 1]
            _out(c0, l0, m, na, M, N, inv, bias_ptr, out_ptr, stride_om, lora_scale, HAS_BIAS, R)
            _out(c1, l1, m + 1, na, M, N, inv, bias_ptr, out_ptr, stride_om, lora_scale, HAS_BIAS, R)
            _out(c2, l2, m, nb, M, N, inv, bias_ptr, out_ptr, stride_om, lora_scale, HAS_BIAS, R)
            _out(c3, l3, m + 1, nb, M, N, inv, bias_ptr, out_ptr, stride_om, lora_scale, HAS_BIAS, R)
        if FUSED:
            _release_xa(xlock_ptr, arrival, (tl.num_programs(0) - XP) * tl.num_programs(1))
