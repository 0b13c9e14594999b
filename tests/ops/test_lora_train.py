"""The one-node NVFP4 + LoRA training op against its readable definition and hand-derived gradients."""
import pytest
import torch

from qerl.ops import linear as seam
from qerl.ops.lora_train import _NVFP4LoraFn, nvfp4_lora_train, reference_lora_train
from qerl.quant import nvfp4


def _case(dtype, lead=(3, 5), bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    N, K, R = 48, 64, 8
    p, s, gs = nvfp4.quantize(torch.randn(N, K, generator=g) * 0.05)
    x = (torch.randn(*lead, K, generator=g)).to(dtype)
    a = torch.randn(R, K, generator=g) * 0.1  # fp32 masters
    b = torch.randn(N, R, generator=g) * 0.1
    bb = torch.randn(N, generator=g).to(dtype) if bias else None
    return p, s, gs, bb, x, a, b


def _grads(fn, p, s, gs, bias, x, a, b, scale, dy):
    x, a, b = (t.detach().clone().requires_grad_(True) for t in (x, a, b))
    y = fn(x, p, s, gs, bias, a, b, scale)
    y.backward(dy)
    return y.detach(), x.grad, a.grad, b.grad


def test_fp32_equals_the_hand_derived_gradients():
    """In fp32 (the node itself, not the fp32 fallback): y = xŴᵀ + b + s·xAᵀBᵀ, dX = dY·Ŵ + s·dY·B·A,
    dA = s·(dY·B)ᵀX, dB = s·dYᵀ(X·Aᵀ)."""
    p, s, gs, bias, x, a, b = _case(torch.float32)
    dy = torch.randn(3, 5, 48)
    y, gx, ga, gb = _grads(_NVFP4LoraFn.apply, p, s, gs, bias, x, a, b, 2.0, dy)
    w = nvfp4.dequantize(p, s, gs, dtype=torch.float32)
    x2, d2 = x.reshape(-1, 64), dy.reshape(-1, 48)
    torch.testing.assert_close(y.reshape(-1, 48), x2 @ w.T + bias + 2.0 * (x2 @ a.T) @ b.T, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gx.reshape(-1, 64), d2 @ w + 2.0 * (d2 @ b) @ a, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ga, 2.0 * (d2 @ b).T @ x2, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gb, 2.0 * d2.T @ (x2 @ a.T), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("lead", [(7,), (2, 3, 5)])
def test_bf16_matches_the_composition(bias, lead):
    """bf16 activations, fp32 masters: output and all gradients agree with PEFT-style composition to bf16
    rounding; gradients of the masters arrive in fp32."""
    p, s, gs, bb, x, a, b = _case(torch.bfloat16, lead, bias)
    dy = torch.randn(*lead, 48).to(torch.bfloat16)
    fused = _grads(nvfp4_lora_train, p, s, gs, bb, x, a, b, 0.5, dy)
    ref = _grads(reference_lora_train, p, s, gs, bb, x, a, b, 0.5, dy)
    assert fused[0].dtype == torch.bfloat16 and fused[1].dtype == torch.bfloat16
    assert fused[2].dtype == torch.float32 and fused[3].dtype == torch.float32
    for got, want in zip(fused, ref):
        assert got.shape == want.shape
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


def test_backend_hooks_are_used(monkeypatch):
    """A backend's ``forward_xa`` / ``backward_input_lora`` get the whole projection (2-D, LoRA included)."""
    calls = []

    def fxa(x, p, s, g, bias, xa, lb, sc):
        calls.append(("fxa", x.ndim, xa.shape[1]))
        return torch.addmm(seam.reference_forward(x, p, s, g, bias), xa, lb.t(), alpha=sc)

    def bl(dy, p, s, g, dyb, la, sc):
        calls.append(("bl", dy.ndim, dyb.shape[1]))
        return torch.addmm(seam.reference_backward_input(dy, p, s, g), dyb, la, alpha=sc)

    monkeypatch.setattr(seam, "_BACKENDS", [])
    seam.register_backend(seam.Backend("fake", lambda x, w: True, seam.reference_forward,
                                       seam.reference_backward_input, forward_xa=fxa, backward_input_lora=bl))
    p, s, gs, bb, x, a, b = _case(torch.bfloat16)
    dy = torch.randn(3, 5, 48).to(torch.bfloat16)
    got = _grads(nvfp4_lora_train, p, s, gs, bb, x, a, b, 0.5, dy)
    assert calls == [("fxa", 2, 8), ("bl", 2, 8)]
    monkeypatch.setattr(seam, "_BACKENDS", [])
    monkeypatch.setenv("QERL_FORCE_REFERENCE", "1")
    ref = _grads(nvfp4_lora_train, p, s, gs, bb, x, a, b, 0.5, dy)
    for u, v in zip(got, ref):
        assert torch.equal(u, v)


def test_shape_errors_name_the_shapes():
    p, s, gs, bb, x, a, b = _case(torch.bfloat16)
    with pytest.raises(ValueError, match=r"lora_b \(8, 48\)"):
        nvfp4_lora_train(x, p, s, gs, bb, a, b.T, 1.0)


@pytest.mark.parametrize("bias", [True, False])
def test_dense_base_gives_the_same_products(bias):
    """``dense=`` (the base dequantized once per update phase) computes what the per-call path computes, bit for
    bit on the reference backend (the same GEMMs on the same dequantized weight): output and all gradients; a
    dense weight of another dtype or shape is refused."""
    p, s, gs, bb, x, a, b = _case(torch.bfloat16, (4, 6), bias)
    dy = torch.randn(4, 6, 48).to(torch.bfloat16)
    w = seam.dense_weight(p, s, gs, torch.bfloat16)
    assert torch.equal(w, nvfp4.dequantize(p, s, gs, dtype=torch.bfloat16))
    per_call = _grads(nvfp4_lora_train, p, s, gs, bb, x, a, b, 0.5, dy)
    dense = _grads(lambda *t: nvfp4_lora_train(*t, dense=w), p, s, gs, bb, x, a, b, 0.5, dy)
    for got, want in zip(dense, per_call):
        assert torch.equal(got, want)
    with pytest.raises(ValueError, match=r"dense weight torch.float32 \(48, 64\), expected torch.bfloat16"):
        nvfp4_lora_train(x, p, s, gs, bb, a, b, 0.5, dense=w.float())


def test_dense_base_block_keeps_and_frees_the_copies():
    """``dense_base``: every NVFP4 layer of the model holds its dequantized weight inside the block (its bytes
    yielded), none after — also when the block raises; ``enabled=False`` keeps nothing."""
    from qerl.models.nvfp4_linear import NVFP4Linear, dense_base

    model = torch.nn.Sequential(NVFP4Linear.from_linear(torch.nn.Linear(64, 32).bfloat16()),
                                NVFP4Linear.from_linear(torch.nn.Linear(32, 16, bias=False).bfloat16()))
    with dense_base(model) as kept:
        assert kept == (32 * 64 + 16 * 32) * 2
        for m in model:
            assert torch.equal(m.dense, m.dequantized_weight(torch.bfloat16))
    assert all(m.dense is None for m in model)
    with pytest.raises(RuntimeError, match="boom"), dense_base(model):
        raise RuntimeError("boom")
    assert all(m.dense is None for m in model)
    with dense_base(model, enabled=False) as kept:
        assert kept == 0 and all(m.dense is None for m in model)
    assert "dense" not in model.state_dict().__repr__()  # never a buffer: checkpoints unchanged
