"""The fused rotary + KV-cache write of a decode step (``qerl_kernels.rope_cache``) against its torch definition
under the Triton interpreter (a subprocess: the interpreter must be on before triton is imported), on strided q/k/v
views of a fused projection output, GQA head counts that do not fill a head block, bf16 and fp32; and the engine's
eager path (the activation dtype op by op) against the same definition within one rounding. The GPU judge:
``python -m qerl.bench.engine_check`` (greedy == transformers, rollout vs trainer log-probs) with the kernel in the
CUDA-graph engine."""
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")


def test_kernel_equals_the_definition_under_interpreter():
    code = r"""
import torch
from qerl_kernels.rope_cache import reference, rope_cache_write
torch.manual_seed(0)
for B, Hq, Hkv, D, dt, hb in [(3, 4, 2, 16, torch.float32, 8), (2, 7, 1, 32, torch.bfloat16, 4), (5, 6, 2, 16, torch.bfloat16, 8)]:
    qkv = torch.randn(B, (Hq + 2 * Hkv) * D, dtype=dt)
    q, k, v = qkv.split([Hq * D, Hkv * D, Hkv * D], -1)
    q, k, v = q.reshape(B, Hq, D), k.reshape(B, Hkv, D), v.reshape(B, Hkv, D)
    ang = torch.rand(B, D // 2) * 6.0
    cos, sin = torch.cat((ang.cos(), ang.cos()), -1).to(dt), torch.cat((ang.sin(), ang.sin()), -1).to(dt)
    R = 11
    flat = torch.randperm(R)[:B]
    kc0, vc0 = torch.randn(R, Hkv, D, dtype=dt), torch.randn(R, Hkv, D, dtype=dt)
    kc1, vc1, kc2, vc2 = kc0.clone(), vc0.clone(), kc0.clone(), vc0.clone()
    out = rope_cache_write(q, k, v, cos, sin, kc1, vc1, flat, heads_per_program=hb)
    ref = reference(q, k, v, cos, sin, kc2, vc2, flat)
    tol = 0 if dt == torch.float32 else 1e-2
    assert out.shape == (B, Hq, D) and out.dtype == dt
    assert (out.float() - ref.float()).abs().max() <= tol * (1 + ref.float().abs().max()), (B, Hq, Hkv)
    assert (kc1.float() - kc2.float()).abs().max() <= tol * (1 + kc2.float().abs().max())
    assert torch.equal(vc1, vc2)
    untouched = torch.ones(R, dtype=torch.bool)
    untouched[flat] = False
    assert torch.equal(kc1[untouched], kc0[untouched]) and torch.equal(vc1[untouched], vc0[untouched])
print("ok")
"""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr


def test_engine_eager_path_matches_the_definition():
    """The engine's eager rotary + copies (op by op in the activation dtype) == the fp32 definition in fp32, and
    within one bf16 rounding step in bf16."""
    from qerl.rollout.engine.forward import _rope_write
    from qerl_kernels.rope_cache import reference

    g = torch.Generator().manual_seed(1)
    for dt in (torch.float32, torch.bfloat16):
        B, Hq, Hkv, D, R = 3, 4, 2, 16, 7
        q, k, v = (torch.randn(B, h, D, generator=g).to(dt) for h in (Hq, Hkv, Hkv))
        ang = torch.rand(B, D // 2, generator=g)
        cos, sin = torch.cat((ang.cos(), ang.cos()), -1).to(dt), torch.cat((ang.sin(), ang.sin()), -1).to(dt)
        flat = torch.tensor([4, 0, 6])
        kc1, vc1 = torch.zeros(R, Hkv, D, dtype=dt), torch.zeros(R, Hkv, D, dtype=dt)
        kc2, vc2 = kc1.clone(), vc1.clone()
        a = _rope_write(q, k, v, cos, sin, kc1, vc1, flat)
        b = reference(q, k, v, cos, sin, kc2, vc2, flat)
        tol = 1e-6 if dt == torch.float32 else 2 ** -6
        assert (a.float() - b.float()).abs().max() <= tol * 4 and torch.equal(vc1, vc2)
        assert (kc1.float() - kc2.float()).abs().max() <= tol * 4
