"""Shared by the kernel tests that record launches instead of running them (CPU tensors); the compile tests import
the lab's ``tools/inspect_ir.py`` (sm_90 compiles without a GPU; not installed) as ``inspect_ir``."""
import sys
import types
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))


def _name(kernel) -> str:
    return getattr(kernel, "__name__", None) or kernel.fn.__name__


@pytest.fixture
def recorded(monkeypatch):
    """``qerl_kernels.launch.run`` recorded, not run: a list of ``(kernel name, grid, args, keywords)``."""
    launch = pytest.importorskip("qerl_kernels.launch")
    calls = []
    monkeypatch.setattr(launch, "run", lambda kernel, grid, args, kw: calls.append((_name(kernel), grid, args, kw)))
    return calls


@pytest.fixture
def projection_call():
    """A factory of forward ``qerl_kernels.ops._Call``s of a resolved ``cfg`` on zero weights (bf16 activations
    ``[M, K]``, packed ``[N, K/2]``); ``lora``: a rank-``r`` adapter through the PDL primary."""
    ops = pytest.importorskip("qerl_kernels.ops")

    def make(cfg: dict, lora: bool, M=8, N=128, K=256, r=32, bias=False, tiled=True):
        la = torch.zeros(r, K, dtype=torch.bfloat16) if lora else None
        lb = torch.zeros(N, r, dtype=torch.bfloat16) if lora else None
        b = torch.zeros(N, dtype=torch.bfloat16) if bias else None
        return ops._Call("fwd", torch.randn(M, K, dtype=torch.bfloat16), torch.zeros(N, K // 2, dtype=torch.uint8),
                         torch.zeros(N, K // 16, dtype=torch.uint8), torch.ones(1), N, (b, None, lb), 1.0,
                         r if lora else 0, False, types.MappingProxyType(cfg), la, lora, tiled)

    return make
