"""Warp-specialised NVFP4 W4A16 matmul for mid-size M on Hopper (``WS`` configs of the warpgroup-MMA route, tuned at
M = 32 … 512):
the same product as :mod:`.nvfp4_wgmma` — ``yᵀ [N, M] = Ŵ [N, K] · xᵀ`` (+ bias) (+ ``s · (xa · lora_bᵀ)ᵀ``),
``Ŵ = FP4 · S_FP8 · S_FP32`` (paper Eq. 1), the decoded weights as the wgmma register operand in the
permuted reduction order of that module — with the loads and the math in different warps.

Why (reports/kernels/README.md, "What limits each size range"): in :mod:`.nvfp4_wgmma` every warp of a program
issues its share of the ``cp.async`` loads and one CTA-wide barrier per K step keeps all warpgroups in lockstep
(all decode, then all wait on their wgmma), so a program's decode never overlaps its own MMA and a 64-row weight
tile re-reads the whole activation tile from L2 (7B gate/up at M = 64: 271 MB from L2 per call against 76 MB
of packed weights). Here a program owns ``C · 64 · MT`` weight rows (C consumer warpgroups, MT m64 tiles each)
over one activation tile of ``BT`` rows, and

* the **producer** (the default partition, 4 warps) runs up to ``NS`` K steps ahead: per step it waits for the
  ring slot to be free (``empty``), issues the ``cp.async`` of the packed weights ``[RW, 64 B]``, their block
  scales ``[RW, 8 B]`` and the activation tile ``[BT, 128]`` (128-byte swizzled: the wgmma B operand as is), and
  has the copies' completion arrive on the slot's ``full`` mbarrier (``cp.async.mbarrier.arrive.noinc``);
* each **consumer** (a worker partition of 4 warps) waits on ``full``, decodes its own ``64 · MT`` rows into
  the A operand, runs its wgmma on the shared activation tile, waits for it, and arrives on ``empty`` — no
  barrier with the other consumers, so the warp schedulers overlap one consumer's decode with another's MMA;
  the activation tile is read from L2 once per ``C · 64 · MT`` weight rows instead of once per 64.

``TMA`` (:func:`_nvfp4_ws_tma_kernel`, C = 1 | 2): the producer issues the packed weights and the activation tile as
bulk tensor copies from one thread (completion by transaction count on ``full``, rows past N / M zero-filled); the
scales (8 bytes per row and step, under TMA's 16-byte box minimum) still go by ``cp.async``, arriving on the same
barrier — 1.02–1.18x faster than the ``cp.async`` producer at every H100 key measured (reports/kernels/README.md).

Split-K over programs (``SPLIT``) or the stream-K schedule (``SK``) as in :mod:`.nvfp4_wgmma` (deterministic,
ticketed; one ticket per consumer sub-tile); the epilogue (``2^7 / gs``, bias, LoRA up-projection) is that module's ``_output``, run by each
consumer on its own sub-tile. Registers: the launch asks for ``maxnreg`` so that ``OCC`` programs fit an SM, the
consumers get ``CREGS`` each (``setmaxnreg``) and the producer the rest (>= :data:`PRODUCER_REGS`).

Registers: ptxas compiles every partition under the launch's ``maxnreg`` (``setmaxnreg`` does not raise its cap);
``tools/inspect_ir.py``'s ``ptxas_warnings`` shows where that serialises the wgmmas.

``DB`` (:func:`_mma_steps_db`, tuned where ptxas compiles it without serialising the wgmmas: C = 1 at one program
per SM, C = 2 at BT = 32): each consumer decodes step k + 1 while step k's wgmma runs (two A operands in registers,
never loop-carried), releasing a slot one step later (:func:`consumer_events`).

``XWAIT``: the kernel is the programmatic dependent of the activation permutation launched right before it
(:func:`qerl_kernels.nvfp4_wgmma.permute_activations` with ``pdl``; the producer runs ``griddepcontrol.wait``
before its first load), so its launch and prologue overlap the pre-pass — where no LoRA primary
(:mod:`qerl_kernels.lora_xa`) is the launch before it (H100: 0.3–1.3 µs per call, reports/kernels/README.md).

``KS``: the C consumers share one ``64 · MT``-row tile and take its K steps round-robin (a slot is read by one
consumer: ``empty`` counts one arrival); consumers 1 … C-1 leave their partial sums in shared memory and consumer 0
adds them in order and runs the epilogue — more decoders per weight tile where the tiles are fewer than the SMs
(7B / 14B q/k/v and o at M <= 64), without the split-K tickets. Only a ``KS`` kernel allocates that memory: the
non-``KS`` kernels compile to the same PTX as before it: an unused, initialised mbarrier in them was given the
same shared bytes as the consumer's split-K ticket broadcast (the allocator reuses a dead allocation's memory; an
mbarrier must be invalidated first), which made tickets come out wrong under CUDA-graph replays
(``tools/inspect_ir.py``'s ``mbarrier_overlaps`` checks the compiled kernels for it).

Reference: :func:`qerl.ops.linear.reference_forward` (the seam's pure-torch forward); CPU-checkable logic: the ring's slot /
phase sequence (:func:`ring_schedule`), a consumer's read / release order (:func:`consumer_events`) and the register
split (:func:`register_split`);
``tests/kernels/test_wgmma_ws.py`` replays them and compiles the kernel for sm_90 without a GPU.
"""
from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma, \
    warpgroup_mma_wait

from qerl_kernels import launch
from qerl_kernels.nvfp4_wgmma import _a_operand, _gdc_launch_dependents, _gdc_wait, _issue_s, _issue_w, _issue_x, _output, _rows, \
    _scales_layout, _sms, _split_sum, _words_layout

REGS_PER_SM = 65536
SMEM_PER_PROGRAM = 232448  # sm_90: the most shared memory one program (CTA) may take, 227 KB
PRODUCER_WARPS = 4  # the default partition (the kernel's num_warps)
PRODUCER_REGS = 80  # the producer's cp.async address tensors spill below ~56 at BT = 64 and ~80 at BT = 128 (sm_90 compile, C = 2)


def register_split(C: int, OCC: int = 1, preg: int = PRODUCER_REGS) -> tuple[int, int, int]:
    """``(maxnreg, consumer_regs, producer_regs)`` per thread for ``C`` consumer warpgroups + the 4-warp producer
    at ``OCC`` programs per SM: the launch's ``maxnreg`` (a multiple of 8, <= 255) fits ``OCC`` programs in the
    register file; the consumers get the most that leaves the producer >= ``preg`` (multiples of 8, <= 256)."""
    if C < 1 or OCC < 1:
        raise ValueError(f"register_split: C and OCC must be >= 1, got C={C} OCC={OCC}")
    warps = PRODUCER_WARPS + 4 * C
    maxnreg = min(255, REGS_PER_SM // (32 * warps * OCC)) // 8 * 8
    budget = maxnreg * warps  # registers x warps / 32 threads
    creg = min(256, (budget - preg * PRODUCER_WARPS) // (4 * C) // 8 * 8)
    preg = (budget - creg * 4 * C) // PRODUCER_WARPS
    if creg < 64:
        raise ValueError(f"register_split: C={C} consumers at OCC={OCC} programs per SM leave {creg} registers "
                         "per consumer thread (< 64)")
    return maxnreg, creg, preg


def ring_bytes(C: int, MT: int, BT: int, NS: int, R: int = 0, KS: bool = False) -> int:
    """Shared memory of one program: ``NS`` slots of packed weights (64 B per row) + scales (8 B per row) for
    ``64·C·MT`` rows (``KS``: ``64·MT``) and a ``[BT, 128]`` bf16 activation tile, + the two mbarrier arrays (and
    Triton's slack), + with a rank-``R`` LoRA epilogue each consumer's ``[BT, R]`` bf16 ``xa`` tile, + with ``KS``
    the C - 1 fp32 partial sums ``[64·MT, BT]`` and their mbarrier."""
    rows = 64 * MT * (1 if KS else C)
    red = (C - 1) * rows * BT * 4 + 8 if KS and C > 1 else 0
    return NS * (rows * 72 + BT * 256) + 2048 + C * BT * R * 2 + red


def min_stages(C: int, DB: bool = False, KS: bool = False) -> int:
    """The fewest ring slots that cannot deadlock: one more than the consumers hold at once — each holds one slot
    (two with ``DB``, :func:`consumer_events`), all the same step's, except with ``KS`` (C consumers, C steps)."""
    return (2 if DB else 1) * (C if KS else 1) + 1


def fit_stages(C: int, MT: int, BT: int, NS: int, R: int = 0, KS: bool = False, DB: bool = False,
               limit: int = SMEM_PER_PROGRAM) -> int:
    """The ring depth to launch a tuned ``NS`` with a rank-``R`` LoRA epilogue: ``NS`` where :func:`ring_bytes`
    fits ``limit``, else the deepest ring from :func:`min_stages` up that does, else 0 (the epilogue's ``[BT, R]``
    ``xa`` tiles do not fit beside any ring: the caller adds the LoRA outside the kernel). The tables are tuned
    with rank 32; the engine's fused q/k/v of rank r carry ``R = 3r`` rounded up to a power of two (the H100's
    14B q/k/v entries at M = 256 / 512, ``C = 2, BT = 128, NS = 4``, need 233,544 bytes at R = 128: over the limit)."""
    if ring_bytes(C, MT, BT, NS, R, KS) <= limit:
        return NS
    for ns in range(NS - 1, min_stages(C, DB, KS) - 1, -1):
        if ring_bytes(C, MT, BT, ns, R, KS) <= limit:
            return ns
    return 0


def ring_schedule(steps: int, NS: int) -> list[tuple[int, int, int, int]]:
    """The reference of the ring protocol: per K step ``i``, ``(slot, full_phase, empty_wait_phase, refill)`` —
    the producer waits on ``empty[slot]`` for phase ``empty_wait_phase`` (1 on a fresh barrier: passes at once)
    and fills the slot; the consumers wait on ``full[slot]`` for ``full_phase``. ``refill`` is how many times the
    slot was filled before. A slot is refilled only after every consumer arrived on its ``empty`` for the
    previous fill (the phase the producer waits for is the one that arrival completes)."""
    out = []
    for i in range(steps):
        s, n = i % NS, i // NS
        out.append((s, n & 1, (n & 1) ^ 1, n))
    return out


def consumer_events(steps: int, DB: bool = False, stride: int = 1, first: int = 0) -> list[tuple[str, int]]:
    """The reference of a consumer's order of slot reads and releases over a program's ``steps`` K steps, of which
    it takes ``first, first + stride, …`` (``KS``: consumer CI of C takes ``first = CI``, ``stride = C``; else all):
    ``("read", i)`` (wait on ``full``, decode, issue the wgmma) and ``("release", i)`` (arrive on ``empty`` once
    step i's wgmma is done). Plain: read i, release i. ``DB`` (:func:`_mma_steps_db`): its steps in pairs, each
    released only after the next one was read (its wgmma issued), so a consumer holds two slots; an odd last step
    goes alone."""
    own = list(range(first, steps, stride))
    if not DB:
        return [e for i in own for e in (("read", i), ("release", i))]
    out = []
    pairs = len(own) // 2
    for p in range(pairs):
        out.append(("read", own[2 * p]))
        if p > 0:
            out.append(("release", own[2 * p - 1]))
        out += [("read", own[2 * p + 1]), ("release", own[2 * p])]
    if pairs:
        out.append(("release", own[2 * pairs - 1]))
    if len(own) % 2:
        out += [("read", own[-1]), ("release", own[-1])]
    return out


@gluon.jit
def _coords(M, N, K, SPLIT, RW: gl.constexpr, BT: gl.constexpr):
    """This program's weight rows ``n0``, activation rows ``m0`` and K steps ``t0 … t1 - 1`` (the activation-row
    tiles of one weight tile adjacent in the grid, as in :mod:`.nvfp4_wgmma`)."""
    m_tiles = gl.cdiv(M, BT)
    n0 = (gl.program_id(0) // m_tiles) * RW
    m0 = (gl.program_id(0) % m_tiles) * BT
    k_steps = K // 128
    per = gl.cdiv(k_steps, SPLIT)
    t0 = gl.program_id(1) * per
    t1 = gl.minimum(k_steps, t0 + per)
    return n0, m0, t0, t1


@gluon.jit
def _segment(u, u_end, k_steps, m_tiles, RW: gl.constexpr, BT: gl.constexpr):
    """Stream-K: the segment starting at unit ``u`` of a program whose range ends at ``u_end`` — its tile, weight
    rows ``n0``, activation rows ``m0`` and K steps ``ks0 … ks1 - 1`` (as :mod:`.nvfp4_wgmma`'s ``SK``)."""
    tile = u // k_steps
    ks0 = u - tile * k_steps
    ks1 = gl.minimum(k_steps, ks0 + (u_end - u))
    return tile, (tile // m_tiles) * RW, (tile % m_tiles) * BT, ks0, ks1


@gluon.jit
def _units(M, N, K, RW: gl.constexpr, BT: gl.constexpr):
    """Stream-K: this program's unit range ``[p·U // P, (p+1)·U // P)`` of the ``U = tiles · K/128`` (tile, K step)
    units, with ``K/128``, the activation-row tiles, ``U`` and ``P``."""
    k_steps = K // 128
    m_tiles = gl.cdiv(M, BT)
    P = gl.num_programs(0)
    U = gl.cdiv(N, RW) * m_tiles * k_steps
    pid = gl.program_id(0)
    return pid * U // P, (pid + 1) * U // P, k_steps, m_tiles, U, P


@gluon.jit
def _fill(it, t0, t1, n0, m0, xp_ptr, wp_ptr, ws32, wsm, ssm, xsm, full, empty, M, N, stride_xm, stride_wn, stride_sn,
          RW: gl.constexpr, BT: gl.constexpr, NS: gl.constexpr, TILED: gl.constexpr):
    """Producer: K steps ``t0 … t1 - 1`` of the tile at (``n0``, ``m0``) into the ring, ring position ``it`` on;
    returns the position after them (``TILED``: weights and scales in :mod:`qerl_kernels.layout`'s order)."""
    PW: gl.constexpr = gl.num_warps()
    CW: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [PW, 1], [1, 0])  # [RW, 64] uint8, 16 B per copy
    CS: gl.constexpr = gl.BlockedLayout([1, 1], [16, 2], [PW, 1], [1, 0])  # [RW, 2] int32: the 8 scale bytes
    CX: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [PW, 1], [1, 0])  # [BT, 128] bf16, 16 B per copy
    wrow, swn = _rows(n0, N, stride_wn, RW, CW, 64, 1, TILED)
    wcol = gl.arange(0, 64, layout=gl.SliceLayout(0, CW))[None, :]
    srow, ssn = _rows(n0, N, stride_sn, RW, CS, 2, 4, TILED)
    scol = gl.arange(0, 2, layout=gl.SliceLayout(0, CS))[None, :]
    xrow = (m0 + gl.arange(0, BT, layout=gl.SliceLayout(1, CX)))[:, None]
    xcol = gl.arange(0, 128, layout=gl.SliceLayout(0, CX))[None, :]
    xmask = xrow < M
    for t in range(t0, t1):
        s = it % NS
        mbarrier.wait(empty.index(s), ((it // NS) & 1) ^ 1)  # every consumer is done with the slot's last fill
        _issue_w(t, s, wsm, ssm, wp_ptr, ws32, wrow, wcol, srow, scol, swn, ssn, TILED)
        _issue_x(t, s, xsm, xp_ptr, xrow, xcol, xmask, stride_xm)
        async_copy.mbarrier_arrive(full.index(s), increment_count=False)  # when this thread's copies land
        it += 1
    return it


@gluon.jit
def _producer(xp_ptr, wp_ptr, ws_ptr, wsm, ssm, xsm, full, empty, M, N, K, stride_xm, stride_wn, stride_sn, SPLIT,
              RW: gl.constexpr, BT: gl.constexpr, NS: gl.constexpr, SK: gl.constexpr, XWAIT: gl.constexpr,
              TILED: gl.constexpr):
    """The default partition: the ``cp.async`` ring, up to ``NS`` steps ahead of the slowest consumer. ``XWAIT``:
    first wait for the PDL primary that writes the activations (:func:`~qerl_kernels.nvfp4_wgmma.permute_activations`
    with ``pdl``)."""
    if XWAIT:
        _gdc_wait()
    ws32 = ws_ptr.to(gl.pointer_type(gl.int32), bitcast=True)  # scale rows are 4-byte aligned (K % 64 == 0)
    if SK:
        u, u_end, k_steps, m_tiles, U, P = _units(M, N, K, RW, BT)
        it = 0
        while u < u_end:
            tile, n0, m0, ks0, ks1 = _segment(u, u_end, k_steps, m_tiles, RW, BT)
            it = _fill(it, ks0, ks1, n0, m0, xp_ptr, wp_ptr, ws32, wsm, ssm, xsm, full, empty, M, N, stride_xm,
                       stride_wn, stride_sn, RW, BT, NS, TILED)
            u = tile * k_steps + ks1
    else:
        n0, m0, t0, t1 = _coords(M, N, K, SPLIT, RW, BT)
        _fill(t0 * 0, t0, t1, n0, m0, xp_ptr, wp_ptr, ws32, wsm, ssm, xsm, full, empty, M, N, stride_xm, stride_wn,
              stride_sn, RW, BT, NS, TILED)


@gluon.jit
def _fill_tma(it, t0, t1, n0, m0, w_desc, x_desc, ws32, wsm, ssm, xsm, full, empty, N, K, stride_sn,
              RW: gl.constexpr, BT: gl.constexpr, NS: gl.constexpr, TILED: gl.constexpr):
    """Producer, ``TMA``: per K step one bulk copy of the packed weights ``[RW, 64 B]`` and one of the activation
    tile ``[BT, 128]`` (rows past N / M zero-filled by the TMA unit; completion by transaction count on ``full``),
    and the 8 scale bytes of each row by ``cp.async`` (a TMA box needs >= 16 bytes per row), whose completion
    arrives on the same mbarrier. ``TILED`` (:mod:`qerl_kernels.layout`; ``w_desc`` over the weights viewed as
    ``[N/64 · K/128 · 64, 64 B]``): one contiguous 4 KB copy per 64-row tile, a tile past N zero-filled."""
    PW: gl.constexpr = gl.num_warps()
    CS: gl.constexpr = gl.BlockedLayout([1, 1], [16, 2], [PW, 1], [1, 0])  # [RW, 2] int32: the 8 scale bytes
    srow, ssn = _rows(n0, N, stride_sn, RW, CS, 2, 4, TILED)
    scol = gl.arange(0, 2, layout=gl.SliceLayout(0, CS))[None, :]
    k_steps = K // 128
    for t in range(t0, t1):
        s = it % NS
        mbarrier.wait(empty.index(s), ((it // NS) & 1) ^ 1)
        mbarrier.expect(full.index(s), RW * 64 + BT * 256)
        if TILED:
            for j in gl.static_range(RW // 64):
                tma.async_copy_global_to_shared(w_desc, [((n0 // 64 + j) * k_steps + t) * 64, 0], full.index(s),
                                                wsm.index(s).slice(j * 64, 64))
        else:
            tma.async_copy_global_to_shared(w_desc, [n0, t * 64], full.index(s), wsm.index(s))
        tma.async_copy_global_to_shared(x_desc, [m0, t * 128], full.index(s), xsm.index(s))
        _issue_s(t, s, ssm, ws32, srow, scol, ssn, TILED)
        async_copy.mbarrier_arrive(full.index(s), increment_count=False)
        it += 1
    return it


@gluon.jit
def _producer_tma(w_desc, x_desc, ws_ptr, wsm, ssm, xsm, full, empty, M, N, K, stride_sn, SPLIT, RW: gl.constexpr,
                  BT: gl.constexpr, NS: gl.constexpr, SK: gl.constexpr, XWAIT: gl.constexpr, TILED: gl.constexpr):
    """The default partition of the ``TMA`` kernel (the schedule of :func:`_producer`; ``XWAIT`` as there)."""
    if XWAIT:
        _gdc_wait()
    ws32 = ws_ptr.to(gl.pointer_type(gl.int32), bitcast=True)
    if SK:
        u, u_end, k_steps, m_tiles, U, P = _units(M, N, K, RW, BT)
        it = 0
        while u < u_end:
            tile, n0, m0, ks0, ks1 = _segment(u, u_end, k_steps, m_tiles, RW, BT)
            it = _fill_tma(it, ks0, ks1, n0, m0, w_desc, x_desc, ws32, wsm, ssm, xsm, full, empty, N, K, stride_sn,
                           RW, BT, NS, TILED)
            u = tile * k_steps + ks1
    else:
        n0, m0, t0, t1 = _coords(M, N, K, SPLIT, RW, BT)
        _fill_tma(t0 * 0, t0, t1, n0, m0, w_desc, x_desc, ws32, wsm, ssm, xsm, full, empty, N, K, stride_sn, RW, BT,
                  NS, TILED)


@gluon.jit
def _mma_steps(acc, it, t0, t1, wsm, ssm, xsm, full, empty, R0: gl.constexpr, RWC: gl.constexpr, NS: gl.constexpr,
               MMA: gl.constexpr, MT: gl.constexpr, STRIDE: gl.constexpr):
    """Consumer: K steps ``t0, t0 + STRIDE, … < t1`` from the ring (position ``it`` on, advancing by ``STRIDE``)
    into ``acc``: wait for the slot, decode this consumer's rows (``R0 …`` of the slot), wgmma on the slot's
    activation tile, release the slot. Returns ``(acc, it)``."""
    LW: gl.constexpr = _words_layout(1, MT)
    LS: gl.constexpr = _scales_layout(1, MT)
    AOP: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    FLAT: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    for _t in range(t0, t1, STRIDE):
        s = it % NS
        mbarrier.wait(full.index(s), (it // NS) & 1)
        fence_async_shared()  # the cp.async writes (generic proxy) before the wgmma's reads (async proxy)
        a = _decode_own(wsm, ssm, s, R0, RWC, AOP, LW, LS, FLAT)
        acc = warpgroup_mma(a, xsm.index(s).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=[acc])
        mbarrier.arrive(empty.index(s), count=1)  # (one arrival: the wgmma read every warp's operand)
        it += STRIDE
    return acc, it


@gluon.jit
def _decode_own(wsm, ssm, s, R0: gl.constexpr, RWC: gl.constexpr, AOP: gl.constexpr, LW: gl.constexpr,
                LS: gl.constexpr, FLAT: gl.constexpr):
    """Rows ``R0 … R0 + RWC - 1`` of ring slot ``s`` -> the decoded A operand ``[RWC, 128]`` bf16."""
    q = wsm.index(s).slice(R0, RWC)._reinterpret(gl.int32, [RWC, 16], FLAT).load(LW)
    sb = ssm.index(s).slice(R0, RWC)._reinterpret(gl.uint8, [RWC, 8], FLAT).load(LS)
    return _a_operand(q, sb, AOP, LW, RWC, False)


@gluon.jit
def _mma_steps_db(acc, it, t0, t1, wsm, ssm, xsm, full, empty, R0: gl.constexpr, RWC: gl.constexpr,
                  NS: gl.constexpr, MMA: gl.constexpr, MT: gl.constexpr, STRIDE: gl.constexpr):
    """:func:`_mma_steps` with each step's decode under the previous step's wgmma (``DB``): the steps go in pairs
    with two A operands that are *not* loop-carried — a loop-carried register operand is decoded into the registers
    the in-flight wgmma still reads, which makes ptxas serialise every wgmma (C7513, the removed ``PIPE``). Per
    pair: decode A0, wgmma A0, wait until one wgmma is outstanding (the previous pair's A1 done: release its slot),
    decode A1 under A0's wgmma, wgmma A1, wait for A0 (release its slot). An odd last step goes alone."""
    LW: gl.constexpr = _words_layout(1, MT)
    LS: gl.constexpr = _scales_layout(1, MT)
    AOP: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    FLAT: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    if STRIDE == 1:
        own = t1 - t0
    else:  # this consumer's steps t0, t0 + STRIDE, …
        own = (t1 - t0 + STRIDE - 1) // STRIDE
    pairs = own // 2
    for p in range(pairs):
        s0 = it % NS
        mbarrier.wait(full.index(s0), (it // NS) & 1)
        fence_async_shared()
        a0 = _decode_own(wsm, ssm, s0, R0, RWC, AOP, LW, LS, FLAT)
        acc = warpgroup_mma(a0, xsm.index(s0).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(1, deps=[acc])
        if p > 0:
            mbarrier.arrive(empty.index((it + NS - STRIDE) % NS), count=1)  # the previous pair's second step
        s1 = (it + STRIDE) % NS
        mbarrier.wait(full.index(s1), ((it + STRIDE) // NS) & 1)
        fence_async_shared()
        a1 = _decode_own(wsm, ssm, s1, R0, RWC, AOP, LW, LS, FLAT)
        acc = warpgroup_mma(a1, xsm.index(s1).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(1, deps=[acc])
        mbarrier.arrive(empty.index(s0), count=1)
        it += 2 * STRIDE
    acc = warpgroup_mma_wait(0, deps=[acc])
    if pairs > 0:
        mbarrier.arrive(empty.index((it + NS - STRIDE) % NS), count=1)
    if STRIDE == 1:
        if (t1 - t0) % 2 == 1:
            acc, it = _mma_steps(acc, it, t1 - 1, t1, wsm, ssm, xsm, full, empty, R0, RWC, NS, MMA, MT, STRIDE)
    elif own % 2 == 1:
        tl = t0 + 2 * pairs * STRIDE
        acc, it = _mma_steps(acc, it, tl, tl + 1, wsm, ssm, xsm, full, empty, R0, RWC, NS, MMA, MT, STRIDE)
    return acc, it


@gluon.jit
def _steps(acc, it, t0, t1, wsm, ssm, xsm, full, empty, R0: gl.constexpr, RWC: gl.constexpr, NS: gl.constexpr,
           MMA: gl.constexpr, MT: gl.constexpr, DB: gl.constexpr, STRIDE: gl.constexpr):
    if DB:
        acc, it = _mma_steps_db(acc, it, t0, t1, wsm, ssm, xsm, full, empty, R0, RWC, NS, MMA, MT, STRIDE)
    else:
        acc, it = _mma_steps(acc, it, t0, t1, wsm, ssm, xsm, full, empty, R0, RWC, NS, MMA, MT, STRIDE)
    return acc, it


@gluon.jit
def _consumer(wsm, ssm, xsm, full, empty, gs_ptr, out_ptr, bias_ptr, part_ptr, lock_ptr, xa_ptr, lb_ptr, lora_scale,
              M, N, K, stride_om, SPLIT, CI: gl.constexpr, C: gl.constexpr, MT: gl.constexpr, BT: gl.constexpr,
              NS: gl.constexpr, HAS_BIAS: gl.constexpr, USE_SPLIT: gl.constexpr, R: gl.constexpr, PDL: gl.constexpr,
              SK: gl.constexpr, DB: gl.constexpr, KS: gl.constexpr, red, done):
    """Consumer warpgroup ``CI``: rows ``CI · 64 · MT …`` of the program's weight tile(s) and its epilogue; ``KS``:
    every consumer on all ``64 · MT`` rows, consumer ``CI`` on the program's K steps ``CI, CI + C, …``, the partial
    sums added up in consumer order through shared memory (``red``; ``done`` counts the C - 1 stores) and consumer
    0 alone runs the epilogue."""
    RWC: gl.constexpr = 64 * MT
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BT, 16])
    if SK:
        u, u_end, k_steps, m_tiles, U, P = _units(M, N, K, C * RWC, BT)
        u_start = u
        it = 0
        pid = gl.program_id(0)
        pr = gl.arange(0, RWC, layout=gl.SliceLayout(1, MMA))
        pc = gl.arange(0, BT, layout=gl.SliceLayout(0, MMA))
        poffs = pr[:, None] * BT + pc[None, :]
        while u < u_end:
            tile, n0, m0, ks0, ks1 = _segment(u, u_end, k_steps, m_tiles, C * RWC, BT)
            n0 = n0 + CI * RWC
            acc = gl.zeros([RWC, BT], gl.float32, layout=MMA)
            acc, it = _steps(acc, it, ks0, ks1, wsm, ssm, xsm, full, empty, CI * RWC, RWC, NS, MMA, MT, DB, 1)
            if (ks0 == 0) & (ks1 == k_steps):  # the whole tile: straight out
                _output(acc, n0, m0, M, N, out_ptr, stride_om, gs_ptr, bias_ptr, xa_ptr, lb_ptr, lora_scale, HAS_BIAS,
                        R, PDL, RWC, BT, 4, MMA)
            else:  # a share: partial slot 2p (the range's first segment) or 2p + 1 (its last), per consumer
                mine = (2 * pid + (u_start < tile * k_steps).to(gl.int32)) * C + CI
                gl.store(part_ptr + mine * (RWC * BT) + poffs, acc)
                gl.thread_barrier()  # (this partition's warps)
                q0 = ((tile * k_steps + 1) * P - 1) // U  # the programs holding the tile's first and last unit
                q1 = ((tile * k_steps + k_steps) * P - 1) // U
                ticket = gl.atomic_add(lock_ptr + tile * C + CI, 1, sem="acq_rel", scope="gpu")
                if ticket == q1 - q0:  # the last share sums them all, in program order (deterministic)
                    acc = gl.zeros([RWC, BT], gl.float32, layout=MMA)
                    for q in range(q0, q1 + 1):
                        slot = (2 * q + ((q * U // P) < tile * k_steps).to(gl.int32)) * C + CI
                        acc += gl.load(part_ptr + slot * (RWC * BT) + poffs, cache_modifier=".cg")
                    gl.atomic_xchg(lock_ptr + tile * C + CI, 0)
                    _output(acc, n0, m0, M, N, out_ptr, stride_om, gs_ptr, bias_ptr, xa_ptr, lb_ptr, lora_scale,
                            HAS_BIAS, R, PDL, RWC, BT, 4, MMA)
            u = tile * k_steps + ks1
    else:
        acc = gl.zeros([RWC, BT], gl.float32, layout=MMA)
        if KS:  # all consumers on the same rows, K steps round-robin
            n0, m0, t0, t1 = _coords(M, N, K, SPLIT, RWC, BT)
            acc, it = _steps(acc, t0 * 0 + CI, t0 + CI, t1, wsm, ssm, xsm, full, empty, 0, RWC, NS, MMA, MT, DB, C)
            if CI > 0:
                red.index(CI - 1).store(acc)
                mbarrier.arrive(done.index(0), count=1)
            elif C > 1:
                mbarrier.wait(done.index(0), 0)
                for ci in gl.static_range(1, C):
                    acc += red.index(ci - 1).load(MMA)
        else:
            n0, m0, t0, t1 = _coords(M, N, K, SPLIT, C * RWC, BT)
            n0 = n0 + CI * RWC
            acc, it = _steps(acc, t0 * 0, t0, t1, wsm, ssm, xsm, full, empty, CI * RWC, RWC, NS, MMA, MT, DB, 1)
        if not KS or CI == 0:  # (KS: consumer 0 holds the sum)
            last = True
            if USE_SPLIT:  # one ticket per consumer sub-tile
                acc, last = _split_sum(acc, n0, m0, M, N, part_ptr, lock_ptr, gl.program_id(1), SPLIT, RWC, BT, MMA,
                                       C, CI)
            if last:
                _output(acc, n0, m0, M, N, out_ptr, stride_om, gs_ptr, bias_ptr, xa_ptr, lb_ptr, lora_scale, HAS_BIAS,
                        R, PDL, RWC, BT, 4, MMA)


@gluon.jit(do_not_specialize=["M", "SPLIT"])
def _nvfp4_ws_kernel(
    xp_ptr, wp_ptr, ws_ptr, gs_ptr, out_ptr, bias_ptr, part_ptr, lock_ptr,
    M, N, K, stride_xm, stride_om, stride_wn, stride_sn, SPLIT, xa_ptr, lb_ptr, lora_scale,
    HAS_BIAS: gl.constexpr, USE_SPLIT: gl.constexpr, C: gl.constexpr, MT: gl.constexpr, BT: gl.constexpr,
    NS: gl.constexpr, CREGS: gl.constexpr, R: gl.constexpr = 0, PDL: gl.constexpr = False, SK: gl.constexpr = False,
    DB: gl.constexpr = False, KS: gl.constexpr = False, XWAIT: gl.constexpr = False, TILED: gl.constexpr = False,
    TRIG: gl.constexpr = False,
):
    if TRIG:  # the launch chain (qerl_kernels.launch.chain): the next launch, which waits for this grid, may start
        _gdc_launch_dependents()
    RW: gl.constexpr = 64 * MT if KS else 64 * C * MT
    FLAT: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    XSL: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    wsm = gl.allocate_shared_memory(gl.uint8, [NS, RW, 64], FLAT)
    ssm = gl.allocate_shared_memory(gl.int32, [NS, RW, 2], FLAT)
    xsm = gl.allocate_shared_memory(gl.bfloat16, [NS, BT, 128], XSL)
    full = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(NS):
        mbarrier.init(full.index(s), count=32 * gl.num_warps())  # one noinc arrival per producer thread
        mbarrier.init(empty.index(s), count=1 if KS else C)  # one arrival per consumer warpgroup reading the slot
    gl.static_assert(not (KS and SK), "KS (K split over the consumers) runs on split-K or no split, not stream-K")
    if KS and C > 1:  # the partial sums of consumers 1 … C-1 and the barrier that counts them
        red = gl.allocate_shared_memory(gl.float32, [C - 1, RW, BT], FLAT)
        done = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
        mbarrier.init(done.index(0), count=C - 1)
    else:  # (unused: nothing more allocated, the kernel is the one without KS)
        red = ssm
        done = full
    # (the argument tuples are written out in the call: a tuple built in a variable turns constexprs into tensors)
    if C == 1:
        gl.warp_specialize([
            (_producer, (xp_ptr, wp_ptr, ws_ptr, wsm, ssm, xsm, full, empty, M, N, K, stride_xm, stride_wn, stride_sn,
                         SPLIT, RW, BT, NS, SK, XWAIT, TILED)),
            (_consumer, (wsm, ssm, xsm, full, empty, gs_ptr, out_ptr, bias_ptr, part_ptr, lock_ptr, xa_ptr, lb_ptr,
                         lora_scale, M, N, K, stride_om, SPLIT, 0, C, MT, BT, NS, HAS_BIAS, USE_SPLIT, R, PDL, SK, DB,
                         KS, red, done)),
        ], [4], [CREGS])
    elif C == 2:
        gl.warp_specialize([
            (_producer, (xp_ptr, wp_ptr, ws_ptr, wsm, ssm, xsm, full, empty, M, N, K, stride_xm, stride_wn, stride_sn,
                         SPLIT, RW, BT, NS, SK, XWAIT, TILED)),
            (_consumer, (wsm, ssm, xsm, full, empty, gs_ptr, out_ptr, bias_ptr, part_ptr, lock_ptr, xa_ptr, lb_ptr,
                         lora_scale, M, N, K, stride_om, SPLIT, 0, C, MT, BT, NS, HAS_BIAS, USE_SPLIT, R, PDL, SK, DB,
                         KS, red, done)),
            (_consumer, (wsm, ssm, xsm, full, empty, gs_ptr, out_ptr, bias_ptr, part_ptr, lock_ptr, xa_ptr, lb_ptr,
                         lora_scale, M, N, K, stride_om, SPLIT, 1, C, MT, BT, NS, HAS_BIAS, USE_SPLIT, R, PDL, SK, DB,
                         KS, red, done)),
        ], [4, 4], [CREGS, CREGS])
    else:
        gl.static_assert(C == 4, "C (consumer warpgroups) must be 1, 2 or 4")
        gl.warp_specialize([
            (_producer, (xp_ptr, wp_ptr, ws_ptr, wsm, ssm, xsm, full, empty, M, N, K, stride_xm, stride_wn, stride_sn,
                         SPLIT, RW, BT, NS, SK, XWAIT, TILED)),
            (_consumer, (wsm, ssm, xsm, full, empty, gs_ptr, out_ptr, bias_ptr, part_ptr, lock_ptr, xa_ptr, lb_ptr,
                         lora_scale, M, N, K, stride_om, SPLIT, 0, C, MT, BT, NS, HAS_BIAS, USE_SPLIT, R, PDL, SK, DB,
                         KS, red, done)),
            (_consumer, (wsm, ssm, xsm, full, empty, gs_ptr, out_ptr, bias_ptr, part_ptr, lock_ptr, xa_ptr, lb_ptr,
                         lora_scale, M, N, K, stride_om, SPLIT, 1, C, MT, BT, NS, HAS_BIAS, USE_SPLIT, R, PDL, SK, DB,
                         KS, red, done)),
            (_consumer, (wsm, ssm, xsm, full, empty, gs_ptr, out_ptr, bias_ptr, part_ptr, lock_ptr, xa_ptr, lb_ptr,
                         lora_scale, M, N, K, stride_om, SPLIT, 2, C, MT, BT, NS, HAS_BIAS, USE_SPLIT, R, PDL, SK, DB,
                         KS, red, done)),
            (_consumer, (wsm, ssm, xsm, full, empty, gs_ptr, out_ptr, bias_ptr, part_ptr, lock_ptr, xa_ptr, lb_ptr,
                         lora_scale, M, N, K, stride_om, SPLIT, 3, C, MT, BT, NS, HAS_BIAS, USE_SPLIT, R, PDL, SK, DB,
                         KS, red, done)),
        ], [4, 4, 4, 4], [CREGS, CREGS, CREGS, CREGS])


@gluon.jit(do_not_specialize=["M", "SPLIT"])
def _nvfp4_ws_tma_kernel(
    w_desc, x_desc, ws_ptr, gs_ptr, out_ptr, bias_ptr, part_ptr, lock_ptr,
    M, N, K, stride_om, stride_sn, SPLIT, xa_ptr, lb_ptr, lora_scale,
    HAS_BIAS: gl.constexpr, USE_SPLIT: gl.constexpr, C: gl.constexpr, MT: gl.constexpr, BT: gl.constexpr,
    NS: gl.constexpr, CREGS: gl.constexpr, R: gl.constexpr = 0, PDL: gl.constexpr = False, SK: gl.constexpr = False,
    DB: gl.constexpr = False, KS: gl.constexpr = False, XWAIT: gl.constexpr = False, TILED: gl.constexpr = False,
    TRIG: gl.constexpr = False,
):
    """:func:`_nvfp4_ws_kernel` with the TMA producer (:func:`_fill_tma`); C = 1 | 2 consumers."""
    if TRIG:
        _gdc_launch_dependents()
    RW: gl.constexpr = 64 * MT if KS else 64 * C * MT
    FLAT: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    wsm = gl.allocate_shared_memory(gl.uint8, [NS, RW, 64], w_desc.layout)
    ssm = gl.allocate_shared_memory(gl.int32, [NS, RW, 2], FLAT)
    xsm = gl.allocate_shared_memory(gl.bfloat16, [NS, BT, 128], x_desc.layout)
    full = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(NS):
        mbarrier.init(full.index(s), count=1 + 32 * gl.num_warps())  # the expect-tx arrival + the scales' copies
        mbarrier.init(empty.index(s), count=1 if KS else C)
    gl.static_assert(not (KS and SK), "KS (K split over the consumers) runs on split-K or no split, not stream-K")
    if KS and C > 1:  # the partial sums of consumers 1 … C-1 and the barrier that counts them
        red = gl.allocate_shared_memory(gl.float32, [C - 1, RW, BT], FLAT)
        done = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
        mbarrier.init(done.index(0), count=C - 1)
    else:  # (unused: nothing more allocated, the kernel is the one without KS)
        red = ssm
        done = full
    if C == 1:
        gl.warp_specialize([
            (_producer_tma, (w_desc, x_desc, ws_ptr, wsm, ssm, xsm, full, empty, M, N, K, stride_sn, SPLIT, RW, BT,
                             NS, SK, XWAIT, TILED)),
            (_consumer, (wsm, ssm, xsm, full, empty, gs_ptr, out_ptr, bias_ptr, part_ptr, lock_ptr, xa_ptr, lb_ptr,
                         lora_scale, M, N, K, stride_om, SPLIT, 0, C, MT, BT, NS, HAS_BIAS, USE_SPLIT, R, PDL, SK, DB,
                         KS, red, done)),
        ], [4], [CREGS])
    else:
        gl.static_assert(C == 2, "the TMA kernel takes C = 1 or 2 consumer warpgroups")
        gl.warp_specialize([
            (_producer_tma, (w_desc, x_desc, ws_ptr, wsm, ssm, xsm, full, empty, M, N, K, stride_sn, SPLIT, RW, BT,
                             NS, SK, XWAIT, TILED)),
            (_consumer, (wsm, ssm, xsm, full, empty, gs_ptr, out_ptr, bias_ptr, part_ptr, lock_ptr, xa_ptr, lb_ptr,
                         lora_scale, M, N, K, stride_om, SPLIT, 0, C, MT, BT, NS, HAS_BIAS, USE_SPLIT, R, PDL, SK, DB,
                         KS, red, done)),
            (_consumer, (wsm, ssm, xsm, full, empty, gs_ptr, out_ptr, bias_ptr, part_ptr, lock_ptr, xa_ptr, lb_ptr,
                         lora_scale, M, N, K, stride_om, SPLIT, 1, C, MT, BT, NS, HAS_BIAS, USE_SPLIT, R, PDL, SK, DB,
                         KS, red, done)),
        ], [4, 4], [CREGS, CREGS])


W_TMA_LAYOUT = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8, rank=2)  # rows of 64 B, as read
X_TMA_LAYOUT = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)  # the wgmma B operand


def _ws_static(x, packed, xp, lora_b, has_bias, C, MT, BT, NS, SPLIT, OCC, SK, TMA, DB, KS, pdl, xwait,
               TILED=0, trig=False) -> tuple:
    """:func:`nvfp4_ws_matmul`'s static part (per scope, :func:`qerl_kernels.launch.memo`): ``(RW, tiles, grid, P,
    constexprs, TMA descriptor fields)`` — the descriptors' fields but their base, validated once by
    ``TensorDescriptor.from_tensor`` (shape, strides, alignment and dtype are the scope's)."""
    M, K = x.shape
    N = packed.shape[0]
    if TILED and N % 64:
        raise ValueError(f"nvfp4_ws: TILED weights (qerl_kernels.layout) need N % 64 == 0, got N={N}")
    RW = 64 * MT * (1 if KS else C)
    tiles = launch.cdiv(N, RW) * launch.cdiv(M, BT)
    maxnreg, creg, _ = register_split(C, OCC)
    P = 0
    if SK:
        P = min(int(OCC) * _sms(x.device), tiles * (K // 128))
        grid, SPLIT = (P, 1), 1
    else:
        grid = (tiles, max(1, SPLIT))
    consts = dict(HAS_BIAS=has_bias, USE_SPLIT=SPLIT > 1, C=int(C), MT=int(MT), BT=int(BT), NS=int(NS),
                  CREGS=creg, R=lora_b.shape[1] if lora_b is not None else 0, PDL=bool(pdl), SK=bool(SK), DB=bool(DB),
                  KS=bool(KS), XWAIT=bool(xwait), TILED=bool(TILED), TRIG=bool(trig),
                  num_warps=PRODUCER_WARPS, maxnreg=maxnreg, **({"launch_pdl": True} if pdl or xwait else {}))
    descs = None
    if TMA:
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

        if C not in (1, 2):
            raise ValueError(f"nvfp4_ws: the TMA producer takes C = 1 or 2 consumer warpgroups, got C={C}")
        w = (packed.view(-1, 64), [64, 64]) if TILED else (packed, [RW, 64])  # (TILED: one 4 KB box per tile step)
        descs = tuple({k: v for k, v in vars(TensorDescriptor.from_tensor(t, block, layout)).items() if k != "base"}
                      for t, block, layout in ((*w, W_TMA_LAYOUT), (xp, [BT, 128], X_TMA_LAYOUT)))
    return RW, tiles, grid, P, consts, descs


def _descriptor(t, fields: dict):
    """A gluon ``TensorDescriptor`` of ``t`` with the validated ``fields`` of :func:`_ws_static` (its constructor's
    checks cost ~5 µs of host time per descriptor, two per call)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    d = object.__new__(TensorDescriptor)
    vars(d).update(fields)
    d.base = t
    return d


def nvfp4_ws_matmul(x, packed, scale_u8, gs, bias=None, xa=None, lora_b=None, lora_scale=1.0, *, xp, C=2, MT=1, BT=64,
                    NS=4, SPLIT=1, OCC=1, SK=0, TMA=0, DB=0, KS=0, part=None, lock=None, pdl=False, xwait=False,
                    TILED=0, trig=False):
    """``y [M, N]`` bf16 with :func:`_nvfp4_ws_kernel` (``TMA``: :func:`_nvfp4_ws_tma_kernel`, C = 1 | 2; ``DB``,
    ``KS``: see the module doc); ``xp``: the activations in the kernel's reduction order (:func:`qerl_kernels.nvfp4_wgmma.permute_activations`). ``SK``:
    the stream-K schedule — ``OCC`` programs per SM share the ``tiles · K/128`` (tile, K step) units evenly
    (:func:`qerl_kernels.nvfp4_wgmma.stream_k_plan`, per consumer sub-tile), ``SPLIT`` ignored; else ``SPLIT``
    programs per tile. ``part`` / ``lock``: the workspace (fp32 >= SPLIT·M·N, or 2·P·RW·BT for stream-K) and tickets
    (int32 zeros >= tiles · C), allocated when not given. ``xwait``: ``xp`` comes from the launch right before this
    one (:func:`~qerl_kernels.nvfp4_wgmma.permute_activations` with ``pdl``): this kernel is launched as its
    programmatic dependent and its producer waits for it before the first load, so the launch and the prologue
    overlap the permutation. ``TILED``: ``packed`` and ``scale_u8`` in the tile-contiguous layout
    (:mod:`qerl_kernels.layout`, N % 64 == 0). ``trig`` (the launch chain, :func:`qerl_kernels.launch.chain`): release
    the next launch at the start (it waits for this grid before its first read). Called by :func:`qerl_kernels.ops._launch_wgmma` for ``WS`` configs (validation is the
    caller's)."""
    M, K = x.shape
    N = packed.shape[0]
    RW, tiles, grid, P, consts, descs = launch.memo(_ws_static, x, packed, xp, lora_b, bias is not None, C, MT, BT, NS,
                                                    SPLIT, OCC, SK, TMA, DB, KS, pdl, xwait, TILED, trig)
    out = torch.empty((M, N), device=x.device, dtype=torch.bfloat16)
    if SK:
        SPLIT = 1
        if part is None or part.numel() < 2 * P * RW * BT:
            part = torch.empty(2 * P * RW * BT, device=x.device, dtype=torch.float32)
    elif SPLIT > 1 and part is None:
        part = torch.empty(SPLIT * M * N, device=x.device, dtype=torch.float32)
    elif SPLIT <= 1:
        part = out
    if lock is None or lock.numel() < tiles * C:
        lock = torch.zeros(tiles * C, device=x.device, dtype=torch.int32)
    epilogue = (gs, out, bias if bias is not None else out, part, lock)
    lora = (xa if xa is not None else out, lora_b if lora_b is not None else out, float(lora_scale))
    if TMA:
        w_desc, x_desc = _descriptor(packed, descs[0]), _descriptor(xp, descs[1])
        launch.run(_nvfp4_ws_tma_kernel, grid, (w_desc, x_desc, scale_u8, *epilogue, M, N, K, out.stride(0),
                                                scale_u8.stride(0), max(1, SPLIT), *lora), consts)
    else:
        launch.run(_nvfp4_ws_kernel, grid, (xp, packed, scale_u8, *epilogue, M, N, K, xp.stride(0), out.stride(0),
                                            packed.stride(0), scale_u8.stride(0), max(1, SPLIT), *lora), consts)
    return out
