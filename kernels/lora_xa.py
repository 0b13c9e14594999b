"""LoRA down-projection for the decode kernel, as the *primary* of a programmatic dependent launch (PDL):
``xa [16, R] = x [M <= 16, K] · lora_a [R, K]ᵀ`` (bf16 out, fp32 accumulation; rows >= M are 0).

Why a separate launch: the decode kernel (:mod:`.nvfp4_mmv`) is launched right after this one with
``launch_pdl=True``. Every program here calls ``griddepcontrol.launch_dependents`` (at its start or once its
loads have landed), so the decode kernel's tiles start streaming weights while ``xa`` is being computed, and
each tile runs ``griddepcontrol.wait`` (this grid complete, its writes visible) only in its epilogue,
before the LoRA up-projection. Unlike producer programs inside the decode launch, this kernel's
registers and shared memory are its own: it cannot lower the decode kernel's occupancy (measured: a
register-fragment producer inside the launch took the 32B gate/up M = 1 kernel from 18 to 9 resident
programs per SM and added 32%, ``scripts/lora_trace.py``), and its loads are issued before the weight
stream saturates the memory system.

Program ``p`` of XP reduces the KB-wide K chunks p, p + XP, … (ops: KB = 128, XP = min(64, K / 128))
with ``tl.dot`` into an fp32 partial
``xap [XP, 16, R]``; the last program to finish (a ticket in ``lock``, reset by it) sums the partials
in a fixed order (deterministic) and stores ``xa``. The readable reference is ``x @ lora_a.T``.
"""
from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents

from qerl_kernels.nvfp4_mmv import _stamp


@triton.jit(do_not_specialize=["M", "XP"])
def _lora_xa_kernel(x_ptr, la_ptr, xa_ptr, xap_ptr, lock_ptr, tr_ptr, M, K, stride_xm, XP, R: tl.constexpr,
                    KB: tl.constexpr, QB: tl.constexpr, PDL: tl.constexpr, TRACE: tl.constexpr = False):
    """``PDL`` 0: plain launch; 1: release the dependent launch at once; 2: after this program's loads
    have landed (its chunks' ``tl.dot`` done: the decode kernel's weight stream then cannot delay them).
    ``TRACE`` (diagnostics, ``scripts/lora_trace.py``): ``%globaltimer`` stamps into ``tr_ptr [XP, 8]``
    (int64): start, SM, chunks done, ticket back, and — the last program — ``xa`` stored."""
    p = tl.program_id(0)
    tr = tr_ptr + p * 8
    _stamp(tr, 0, TRACE)
    _stamp(tr, 1, TRACE)
    rows = tl.arange(0, 16)
    rr = tl.arange(0, R)
    kk = tl.arange(0, KB)
    acc = tl.zeros((16, R), tl.float32)
    if PDL == 1:
        gdc_launch_dependents()
    for k0 in range(p * KB, K, XP * KB):
        offs = k0 + kk
        km = offs < K
        xb = tl.load(x_ptr + rows[:, None] * stride_xm + offs[None, :], mask=(rows < M)[:, None] & km[None, :],
                     other=0.0)
        ab = tl.load(la_ptr + rr[:, None] * K + offs[None, :], mask=km[None, :], other=0.0)
        acc += tl.dot(xb, tl.trans(ab))
    _stamp(tr, 2, TRACE)
    if PDL == 2:
        gdc_launch_dependents()
    tile = rows[:, None] * R + rr[None, :]
    tl.store(xap_ptr + p * 16 * R + tile, acc)
    tl.debug_barrier()  # every thread's partial is written before the (releasing) ticket
    ticket = tl.atomic_add(lock_ptr, 1, sem="acq_rel", scope="gpu")
    _stamp(tr, 3, TRACE)
    if ticket == XP - 1:
        qq = tl.arange(0, QB)
        tot = tl.zeros((16, R), tl.float32)
        for q0 in range(0, XP, QB):
            q = q0 + qq
            part = tl.load(xap_ptr + q[:, None, None] * (16 * R) + tile[None, :, :],
                           mask=(q < XP)[:, None, None] & (rows < M)[None, :, None], other=0.0, cache_modifier=".cg")
            tot += tl.sum(part, axis=0)
        tl.store(xa_ptr + tile, tot.to(xa_ptr.dtype.element_ty))
        tl.atomic_xchg(lock_ptr, 0)
        _stamp(tr, 4, TRACE)
