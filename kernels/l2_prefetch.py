"""Bulk prefetch of byte ranges into L2 (sm_90 ``cp.async.bulk.prefetch.L2``): a decode step warms the cache with
the next projections' NVFP4 weights while the latency-bound parts before them (rotary, attention) leave DRAM
half idle.

One launch takes up to :data:`RANGES` byte ranges ``(address, bytes)``, each 16-byte aligned with a length that is
a multiple of 16 (packed NVFP4 weights and their scales always are). Every thread of a program issues one bulk
prefetch of up to ``PIECE`` bytes and goes on: the copy engine fills L2 after the kernel has finished, nothing
waits for it, nothing is written. Elsewhere (CPU, interpreter) :func:`prefetch_l2` does nothing: a prefetch has no
result to check. :func:`pieces` is the reference of the split (which bytes each instruction asks for).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

RANGES = 4  # byte ranges per launch
PIECE = 16384  # bytes per prefetch instruction
PER = 32  # instructions per program (one warp)


def pieces(nbytes: int, piece: int = PIECE) -> list[tuple[int, int]]:
    """``(offset, size)`` of each prefetch instruction over a range of ``nbytes`` (the kernel's split)."""
    return [(o, min(piece, nbytes - o)) for o in range(0, nbytes, piece)]


@triton.jit
def _one_range(base, nbytes, first, pid, PIECE: tl.constexpr, PER: tl.constexpr):
    idx = (pid - first) * PER + tl.arange(0, PER)
    off = idx.to(tl.int64) * PIECE
    live = (pid >= first) & (off < nbytes)
    size = tl.minimum(nbytes - off, PIECE).to(tl.int32)
    size = tl.where(live, size, 0)
    addr = base.to(tl.int64) + tl.where(live, off, 0)
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.b32 $0, 0; }",
        "=r,l,r", [addr, size], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _prefetch_kernel(a0, n0, a1, n1, a2, n2, a3, n3, f1, f2, f3, PIECE: tl.constexpr, PER: tl.constexpr):
    """Program ``pid`` serves the range whose first program ``f_i <= pid < f_{i+1}`` (``f_0 = 0``)."""
    pid = tl.program_id(0)
    if pid < f1:
        _one_range(a0, n0, 0, pid, PIECE, PER)
    elif pid < f2:
        _one_range(a1, n1, f1, pid, PIECE, PER)
    elif pid < f3:
        _one_range(a2, n2, f2, pid, PIECE, PER)
    else:
        _one_range(a3, n3, f3, pid, PIECE, PER)


def plan(ranges: list[tuple[int, int]]) -> tuple[tuple, int]:
    """The launch arguments for up to :data:`RANGES` ``(address, bytes)`` ranges: ``(args, programs)``."""
    if len(ranges) > RANGES:
        raise ValueError(f"prefetch_l2: at most {RANGES} ranges per launch, got {len(ranges)}")
    for a, n in ranges:
        if a % 16 or n % 16:
            raise ValueError(f"prefetch_l2: ranges must be 16-byte aligned multiples of 16 bytes, got address "
                             f"{a:#x}, {n} bytes")
    ranges = list(ranges) + [(0, 0)] * (RANGES - len(ranges))
    progs = [-(-n // (PIECE * PER)) for _, n in ranges]
    firsts = [sum(progs[:i]) for i in range(1, RANGES)]
    flat = [v for a, n in ranges for v in (a, n)]
    return (*flat, *firsts), sum(progs)


def prefetch_l2(ranges: list[tuple[int, int]]) -> None:
    """Prefetch each ``(address, bytes)`` range of the current CUDA device's memory into L2 (one launch; nothing on
    the CPU). Addresses come from ``tensor.data_ptr()``; CUDA-graph safe (no host sync, no allocation)."""
    if not ranges or not torch.cuda.is_available():
        return
    args, programs = plan(ranges)
    if programs:
        _prefetch_kernel[(programs,)](*args, PIECE=PIECE, PER=PER, num_warps=1)


def tensor_range(t: torch.Tensor, nbytes: int | None = None) -> tuple[int, int]:
    """``(address, bytes)`` of the first ``nbytes`` (default: all, rounded down to 16) of contiguous ``t``."""
    total = t.numel() * t.element_size()
    n = total if nbytes is None else min(nbytes, total)
    return t.data_ptr(), n // 16 * 16
