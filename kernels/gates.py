"""Hardware gates shared by the kernel code and the test skips."""
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
