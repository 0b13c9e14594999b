"""gemlite's ``A16W4_NVFP`` linear as a peer in ``qerl bench kernels`` (when ``gemlite`` is importable).

gemlite (mobiusml, pure Python + Triton, ``pip install gemlite``) is the one installable NVFP4 weight-only
(W4A16) kernel library that reads the layout we store: nibble-packed ``[N, K/2]`` uint8 e2m1 codes,
``[N, K/16]`` float8_e4m3fn block scales and a global scale, with ``W ≈ q · s / global_scale``
(``docs/nvfp4.md``; gemlite's ``meta_scale``). Nothing else in qerl uses it.
"""
from __future__ import annotations

import importlib.util

import torch


def available() -> bool:
    """True when ``gemlite`` can be imported (it needs Triton and a CUDA GPU to run)."""
    return importlib.util.find_spec("gemlite") is not None


def version() -> str | None:
    if not available():
        return None
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as v

    try:
        return v("gemlite")
    except PackageNotFoundError:
        return "unknown"


def linear(packed: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor,
           dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    """A gemlite module computing ``x · Ŵᵀ`` for our packed weight (no copy of a dequantized W).

    packed: ``[N, K/2]`` uint8; scales: ``[N, K/16]`` float8_e4m3fn (or its uint8 bits); global_scale:
    0-d / ``[1]`` fp32. Returns a module mapping ``[M, K]`` ``dtype`` -> ``[M, N]`` ``dtype``.
    """
    if packed.dtype != torch.uint8 or packed.dim() != 2:
        raise ValueError(f"packed must be a 2-D uint8 tensor, got {packed.dtype} {tuple(packed.shape)}")
    N, half_k = packed.shape
    if tuple(scales.shape) != (N, 2 * half_k // 16):
        raise ValueError(f"scales must be [{N}, {2 * half_k // 16}] for packed {tuple(packed.shape)}, "
                         f"got {tuple(scales.shape)}")
    from gemlite.helper import A16W4_NVFP

    return A16W4_NVFP(device=packed.device, dtype=dtype).from_packed_weights(
        packed, scales=scales.view(torch.float8_e4m3fn), meta_scale=global_scale.float().reshape(()))


def relative_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    """``‖y − ref‖ / ‖ref‖`` in fp32: the agreement of a peer's output with our reference."""
    y, ref = y.float(), ref.float()
    return float((y - ref).norm() / ref.norm().clamp_min(1e-30))
