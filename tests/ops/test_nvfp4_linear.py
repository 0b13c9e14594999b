"""The compute seam: reference forward/backward, backend dispatch, the debugging switch."""
import pytest
import torch

from qerl.ops import linear as seam
from qerl.quant import nvfp4


@pytest.fixture
def packed():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 64, generator=g) * 0.05
    return w, nvfp4.quantize(w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lead", [(1,), (3, 5), (2, 1, 7)])
def test_forward_and_input_grad_match_dense(packed, dtype, lead):
    _, (p, s, gs) = packed
    bias = torch.randn(48, dtype=dtype)
    w = nvfp4.dequantize(p, s, gs, dtype=dtype)
    x = torch.randn(*lead, 64, dtype=dtype, requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    y = seam.nvfp4_linear(x, p, s, gs, bias)
    y_ref = torch.nn.functional.linear(x2, w, bias)
    assert y.dtype == dtype and torch.equal(y, y_ref)
    g = torch.randn_like(y)
    y.backward(g)
    y_ref.backward(g)
    assert torch.allclose(x.grad, x2.grad, rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-3)


def test_mismatched_k_is_a_clear_error(packed):
    _, (p, s, gs) = packed
    with pytest.raises(ValueError, match="K = 32.*K = 64"):
        seam.nvfp4_linear(torch.randn(2, 32), p, s, gs)


def test_registered_backend_is_used_and_env_forces_reference(packed, monkeypatch):
    _, (p, s, gs) = packed
    calls = []

    def fwd(x, *a):
        calls.append("fwd")
        return seam.reference_forward(x, *a)

    def bwd(g, *a):
        calls.append("bwd")
        return seam.reference_backward_input(g, *a)

    monkeypatch.setattr(seam, "_BACKENDS", [])
    seam.register_backend(seam.Backend("fake", lambda x, w: True, fwd, bwd))
    x = torch.randn(4, 64, requires_grad=True)
    seam.nvfp4_linear(x, p, s, gs).sum().backward()
    assert calls == ["fwd", "bwd"]
    monkeypatch.setenv("QERL_FORCE_REFERENCE", "1")
    calls.clear()
    seam.nvfp4_linear(x, p, s, gs).sum().backward()
    assert calls == []
