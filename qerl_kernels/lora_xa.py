"""LoRA down-projection for the decode kernel, as the *primary* of a programmatic dependent launch (PDL):
``xa [16, R] = x [M <= 16, K] · lora_a [R, K]ᵀ`` (bf16 out, fp32 accumulation; rows >= M are 0); with a
second grid dimension of B row blocks (the warpgroup-MMA kernel, M <= 64): ``xa [16 B, R]``, each block
with its own partials ``xap[b]`` and ticket ``lock[b]``.

Why a separate launch: the decode kernel (:mod:`.nvfp4_mmv`) is launched right after this one with
``launch_pdl=True``. Every program here calls ``griddepcontrol.launch_dependents`` (at its start or once its
loads have landed), so the decode kernel's tiles start streaming weights while ``xa`` is being computed, and
each tile runs ``griddepcontrol.wait`` (this grid complete, its writes visible) only in its epilogue,
before the LoRA up-projection. Unlike producer programs inside the decode launch, this kernel's
registers and shared memory are its own: it cannot lower the decode kernel's occupancy (measured: a
register-fragment producer inside the launch took the 32B gate/up M = 1 kernel from 18 to 9 resident
programs per SM and added 32%, ``tools/lora_trace.py``), and its loads are issued before the weight
stream saturates the memory system.

Program ``p`` of XP reduces the KB-wide K chunks p, p + XP, … (ops: KB = 128, XP = ``ops.xa_shares``: ~14 chunks each)
with ``tl.dot`` into an fp32 partial ``xap [XP, 16, R]``; the last program to finish (a ticket in
``lock``, reset by it) sums the partials in a fixed order (deterministic) and stores ``xa`` — the same
two steps as the fused producers (:func:`.nvfp4_mmv._xa_partial`, :func:`.nvfp4_mmv._xa_sum`). The
readable reference is ``x @ lora_a.T``.
"""
from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents

from qerl_kernels.nvfp4_mmv import _stamp, _xa_partial, _xa_sum


@triton.jit(do_not_specialize=["M", "XP"])
def _lora_xa_kernel(x_ptr, la_ptr, xa_ptr, xap_ptr, lock_ptr, tr_ptr, M, K, stride_xm, XP, R: tl.constexpr,
                    KB: tl.constexpr, QB: tl.constexpr, PDL: tl.constexpr, TRACE: tl.constexpr = False,
                    STAGES: tl.constexpr = 1, RB: tl.constexpr = 0):
    """``PDL`` 0: plain launch; 1: release the dependent launch at once; 2: after this program's loads
    have landed (its chunks' ``tl.dot`` done: the decode kernel's weight stream then cannot delay them).
    ``TRACE`` (diagnostics, ``tools/lora_trace.py``): ``%globaltimer`` stamps into ``tr_ptr [XP, 8]``
    (int64): start, SM, chunks done, ticket back, and — the last program — ``xa`` stored (``[B·XP, 8]`` with B
    row blocks). ``STAGES`` > 1 (``ops._xa_stages``: 3): the chunk loop pipelined. ``RB`` (< R, a
    divisor): the ranks in chunks of RB, one program per (rank chunk, K share) — ``program_id(0)`` runs over
    ``XP · R / RB``, each chunk with its own partials, ticket and final sum (:func:`.nvfp4_mmv._xa_sum` on its
    columns of ``xa``): at R = 128 the whole-rank program took 255 registers with spills, and its one final sum of
    ``XP`` partials ``[16, R]`` took the launch to 41 µs (7B q/k/v, H100; ``ops.xa_rank_chunk``)."""
    p = tl.program_id(0)
    rb = tl.program_id(1)  # block of 16 activation rows (M up to 16 x the grid's second dimension)
    x_ptr += rb * 16 * stride_xm
    xa_ptr += rb * 16 * R
    xap_ptr += rb * XP * 16 * R
    lock_ptr += rb * (R // RB if RB else 1)  # one ticket per row block (and rank chunk)
    M -= rb * 16
    tr = tr_ptr + (rb * XP + p) * 8
    _stamp(tr, 0, TRACE)
    _stamp(tr, 1, TRACE)
    if PDL == 1:
        gdc_launch_dependents()
    if RB:  # rank chunk pr: its own partials xap[pr] [XP, 16, RB], ticket and columns of xa (stamps: start only)
        pr = p // XP
        acc = _xa_partial(p % XP, x_ptr, la_ptr + pr * RB * K, M, K, stride_xm, XP, RB, KB, STAGES)
        if PDL == 2:
            gdc_launch_dependents()
        _xa_sum(p % XP, acc, xa_ptr + pr * RB, xap_ptr + pr * XP * 16 * RB, lock_ptr + pr, XP, RB, QB, tr, False, R)
        return
    acc = _xa_partial(p, x_ptr, la_ptr, M, K, stride_xm, XP, R, KB, STAGES)
    _stamp(tr, 2, TRACE)
    if PDL == 2:
        gdc_launch_dependents()
    if _xa_sum(p, acc, xa_ptr, xap_ptr, lock_ptr, XP, R, QB, tr, TRACE):
        _stamp(tr, 4, TRACE)
