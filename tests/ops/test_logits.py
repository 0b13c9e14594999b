"""Chunked log-probs from hidden states (qerl.ops.logits) against the full-logits definition, on CPU."""
import pytest
import torch

from qerl.ops.logits import logits_fp32, token_logprobs


def _full(h, w, b, t, temp):
    lsm = (torch.nn.functional.linear(h.float(), w.float(), None if b is None else b.float()) / temp).log_softmax(-1)
    return lsm.gather(-1, t[..., None])[..., 0], -(lsm.exp() * lsm).sum(-1)


@pytest.mark.parametrize("chunk", [1, 3, 256])
@pytest.mark.parametrize("bias", [False, True])
def test_token_logprobs_equal_full_logits_values_and_grads(chunk, bias):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(2, 7, 16, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(40, 16, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(40, generator=g, dtype=torch.float64) if bias else None
    t = torch.randint(0, 40, (2, 7), generator=g)
    # float64 in, fp32 math: compare with the same fp32 definition
    lp, ent = token_logprobs(h, w, t, 0.7, b, with_entropy=True, chunk=chunk)
    ref_lp, ref_ent = _full(h, w, b, t, 0.7)
    assert lp.dtype == torch.float32 and lp.shape == (2, 7) and not ent.requires_grad
    torch.testing.assert_close(lp, ref_lp, rtol=0, atol=1e-5)
    torch.testing.assert_close(ent, ref_ent.detach(), rtol=0, atol=1e-5)
    coef = torch.randn(2, 7, generator=g)
    gh, gw = torch.autograd.grad((lp * coef).sum(), (h, w))
    rh, rw = torch.autograd.grad((ref_lp * coef).sum(), (h, w))
    torch.testing.assert_close(gh, rh, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gw, rw, rtol=1e-5, atol=1e-6)


def test_logits_stay_fp32_for_bf16_activations():
    """bf16 hidden states and weight: logits are the exact products accumulated in fp32, not rounded to bf16."""
    g = torch.Generator().manual_seed(1)
    h = torch.randn(3, 64, generator=g).bfloat16()
    w = torch.randn(50, 64, generator=g).bfloat16()
    out = logits_fp32(h, w)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, h.double().matmul(w.double().t()).float(), rtol=1e-6, atol=1e-5)
    assert (out - out.bfloat16().float()).abs().max() > 0  # bf16 would have rounded them


def test_no_grad_path_and_temperature_zero_means_one():
    h, w = torch.randn(1, 4, 8), torch.randn(10, 8)
    t = torch.randint(0, 10, (1, 4))
    with torch.no_grad():
        a, none = token_logprobs(h, w, t, 0.0)
    assert none is None
    torch.testing.assert_close(a, _full(h, w, None, t, 1.0)[0])
