"""The layer's elementwise launches (``qerl_kernels.norm``: RMSNorm, residual add + RMSNorm, AQN noise, SiLU gate)
against their torch definitions and the engine's eager functions under the Triton interpreter (a subprocess: the
interpreter must be on before triton is imported): fp32 equal to the definition within float rounding of the
statistics, bf16 within one rounding step (the interpreter truncates where the GPU rounds); strided inputs (the fused gate/up output's halves), hidden sizes that are
not a power of two, 3-D inputs (prefill), empty inputs; and the errors. The GPU judge is
``python -m qerl.bench.engine_check`` with the kernels in the CUDA-graph engine's launch chain."""
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")


def test_kernels_equal_the_definitions_under_interpreter():
    code = r"""
import torch
from qerl.rollout.engine import forward as fw
from qerl_kernels.norm import rms_norm, rms_reference, silu_mul, silu_mul_reference
torch.manual_seed(0)
for shape, dt in [((3, 96), torch.float32), ((2, 5, 80), torch.bfloat16), ((4, 128), torch.bfloat16), ((0, 64), torch.float32)]:
    H = shape[-1]
    x, d = torch.randn(shape).to(dt), torch.randn(shape).to(dt)
    w, z = (1 + 0.1 * torch.randn(H)).to(dt), 0.01 * torch.randn(H)
    tol = 2e-6 if dt == torch.float32 else 2e-2  # (a few truncated bf16 roundings in a chain)
    def close(a, b):  # (the interpreter truncates fp32 -> bf16 where the GPU rounds: platform.md)
        assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape, a.dtype, b.dtype)
        if a.numel():
            assert (a.float() - b.float()).abs().max() <= tol * (1 + b.float().abs().max()), (shape, dt)
    close(rms_norm(x, w, 1e-6), rms_reference(x, w, 1e-6))
    close(rms_norm(x, w, 1e-6), fw._rms(w, x, 1e-6))
    close(rms_norm(x, w, 1e-6, z=z), fw._rms_noisy(w, z, x, 1e-6))
    s, y = rms_norm(x, w, 1e-6, d=d)
    s0, y0 = fw._add_rms(x, d, w, 1e-6)
    close(s, s0)  # one rounding of the same fp32 sum (fp32: equal)
    assert dt != torch.float32 or torch.equal(s, s0)
    close(y, y0)
    s, y = rms_norm(x, w, 1e-6, d=d, z=z)
    s0, y0 = fw._add_rms_noisy(x, d, w, z, 1e-6)
    close(s, s0)
    close(y, y0)
    # a float32 weight on bf16 activations promotes, as torch does
    close(rms_norm(x, w.float(), 1e-6), fw._rms(w.float(), x, 1e-6))
for M, I, dt in [(3, 1500, torch.float32), (2, 2048, torch.bfloat16), (1, 40, torch.bfloat16)]:
    gu = (3 * torch.randn(M, 2 * I)).to(dt)
    g, u = gu.split(I, -1)  # row stride 2 I: the fused projection's halves
    tol = 2e-6 if dt == torch.float32 else 2e-2
    out, ref = silu_mul(g, u), fw._silu_mul(g, u)
    assert out.shape == ref.shape and out.dtype == dt and out.is_contiguous()
    assert (out.float() - ref.float()).abs().max() <= tol * (1 + ref.float().abs().max()), (M, I, dt)
print("ok")
"""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and "ok" in out.stdout, out.stdout + out.stderr


def test_errors_name_the_problem():
    from qerl_kernels.norm import rms_norm, silu_mul

    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match=r"w \[8\]"):
        rms_norm(x, torch.ones(4), 1e-6)
    with pytest.raises(ValueError, match="unit last stride"):
        rms_norm(torch.randn(8, 2).T, torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match="must match"):
        silu_mul(torch.randn(2, 4), torch.randn(2, 5))
