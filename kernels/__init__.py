"""qerl_kernels: Triton GPU kernels for NVFP4 weight-only (W4A16) linears on Hopper.

Shipped from the repository's ``kernels/`` directory under the import name ``qerl_kernels``
(``package-dir`` in pyproject.toml). Never a top-level ``kernels`` module: Hugging Face libraries
(transformers, bitsandbytes) probe for a PyPI package of that name and would import ours.

The model code reaches these kernels only through the seam :mod:`qerl.ops.nvfp4_linear`; off-GPU
the pure-torch reference there is used.
"""
from __future__ import annotations


def triton_available() -> bool:
    """Triton is importable (it also runs on CPU under ``TRITON_INTERPRET=1``)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def cuda_available() -> bool:
    """A CUDA device is present and Triton can compile for it (the GPU fast path's gate)."""
    import torch

    return torch.cuda.is_available() and triton_available()
