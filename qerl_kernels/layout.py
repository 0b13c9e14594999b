"""The tile-contiguous layout of packed NVFP4 weights (``TILED``; issue 45, item 1): the same bytes as the
compressed-tensors layout — ``packed [N, K/2]`` uint8 (two e2m1 codes per byte) and ``scale [N, K/16]`` (one FP8 E4M3
byte per 16 weights), row-major — reordered so that each 64-row tile's 128-wide K steps lie one after another:

    packed  [N/64, K/128, 64 rows, 64 bytes]      scale  [N/64, K/128, 64 rows, 8 bytes]

A tile starts at the same byte as in the row-major layout (row ``n0`` of a tile at ``n0 · K/2``); inside it, rows
are 64 bytes apart within a step and steps 4096 bytes apart (scales: 8 and 512). A decode kernel that reads one
step of 64 rows per program then reads one contiguous 4 KB block instead of 64 separate 64-byte pieces 1–14 KB
apart. On the H100, the routed warpgroup-MMA kernel at M = 8 took 7B gate/up from 44.0 to 37.0 µs, 32B gate/up from
102.8 to 73.1, and 14B / 32B q/k/v and o 7-8% less, with bit-equal outputs (reports/kernels, "Tile-contiguous
weights").

The checkpoint on disk stays row-major; this module is the reference of the reordering (:func:`tile`,
:func:`untile`) and of the byte offsets the kernels compute (:func:`offsets`).
"""
from __future__ import annotations

import torch

ROWS = 64  # weight rows per tile (one warpgroup's m64)
STEP = 64  # packed bytes per row and 128-wide K step
SSTEP = 8  # scale bytes per row and K step


def tileable(N: int, K: int) -> bool:
    """Whether an ``[N, K]`` weight has whole 64-row tiles and 128-wide K steps (the layout's one condition)."""
    return N % ROWS == 0 and K % (2 * STEP) == 0


def _check(packed: torch.Tensor, scale: torch.Tensor) -> tuple[int, int]:
    if packed.dtype != torch.uint8 or packed.ndim != 2:
        raise ValueError(f"layout: packed must be 2-D uint8 [N, K/2], got {packed.dtype} {tuple(packed.shape)}")
    N, kb = packed.shape
    if not tileable(N, 2 * kb):
        raise ValueError(f"layout: the tiled layout needs N % {ROWS} == 0 and K % 128 == 0, got N={N}, K={2 * kb}")
    if tuple(scale.shape) != (N, kb // 8):
        raise ValueError(f"layout: scale must be [N, K/16] = [{N}, {kb // 8}], got {tuple(scale.shape)}")
    return N, kb


def _reorder(a: torch.Tensor, width: int, inverse: bool) -> torch.Tensor:
    N = a.shape[0]
    steps = a.shape[1] // width
    if inverse:  # [N/64, K/128, 64, width] -> [N/64, 64, K/128, width]
        return a.reshape(N // ROWS, steps, ROWS, width).permute(0, 2, 1, 3).reshape(a.shape).contiguous()
    return a.reshape(N // ROWS, ROWS, steps, width).permute(0, 2, 1, 3).reshape(a.shape).contiguous()


def tile(packed: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-major ``packed [N, K/2]`` uint8 and ``scale [N, K/16]`` (uint8 or float8_e4m3fn) -> the tiled layout,
    same shapes and dtypes (new tensors). Raises unless N % 64 == 0 and K % 128 == 0."""
    _check(packed, scale)
    s = _reorder(scale.view(torch.uint8), SSTEP, False)
    return _reorder(packed, STEP, False), s.view(scale.dtype)


def untile(packed: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of :func:`tile`."""
    _check(packed, scale)
    s = _reorder(scale.view(torch.uint8), SSTEP, True)
    return _reorder(packed, STEP, True), s.view(scale.dtype)


def offsets(n: torch.Tensor, col: torch.Tensor, row_bytes: int, width: int = STEP) -> torch.Tensor:
    """Byte offset in the tiled layout of byte ``col`` of row ``n`` (broadcasting int tensors), for rows of
    ``row_bytes`` bytes (K/2 for the packed weights with ``width`` 64, K/16 for the scales with ``width`` 8): the
    address a kernel computes instead of ``n · row_bytes + col``."""
    return (n // ROWS) * (ROWS * row_bytes) + (col // width) * (ROWS * width) + (n % ROWS) * width + col % width
