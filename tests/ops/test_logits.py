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


_FUSED_SCRIPT = r"""
import torch
from qerl.ops import logits as L

g = torch.Generator().manual_seed(3)
out = []
for bias, V, temp, ent in ((False, 5000, 0.7, True), (True, 1000, 1.0, False)):
    h = (torch.randn(3, 5, 32, generator=g) * 0.5).bfloat16().requires_grad_()
    w = (torch.randn(V, 32, generator=g) * 0.5).bfloat16().requires_grad_()
    b = (torch.randn(V, generator=g) * 0.1).bfloat16() if bias else None
    t = torch.randint(0, V, (3, 5), generator=g)
    t[0, 0], t[1, 1] = 0, V - 1  # the first and the last id
    coef = torch.randn(3, 5, generator=g)
    res = {}
    for fused in (True, False):
        L.FUSED[0] = fused
        lp, e = L.token_logprobs(h, w, t, temp, b, with_entropy=ent, chunk=4)  # blocks of 1 row x 4 tokens
        gh, gw = torch.autograd.grad((lp * coef).sum(), (h, w))
        res[fused] = (lp, e, gh, gw)
    (lp, e, gh, gw), (rlp, re, rgh, rgw) = res[True], res[False]
    assert lp.dtype == torch.float32 and lp.shape == (3, 5) and gh.dtype == torch.bfloat16
    torch.testing.assert_close(lp, rlp, rtol=0, atol=2e-5)
    if ent:
        assert not e.requires_grad
        torch.testing.assert_close(e, re, rtol=0, atol=2e-5)
    else:
        assert e is None and re is None
    # the exact gradients (float64 from the same bf16 values): the fused path rounds the logits' gradient to bf16 once
    # before the backward GEMMs (as torch's CUDA path, _LogitsFP32, does; the CPU composite keeps it fp32), and the
    # GEMMs round to bf16: within a few bf16 ulps of exact as a whole
    h64, w64 = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    z = (h64 @ w64.t() + (0 if b is None else b.double())) / temp
    xh, xw = torch.autograd.grad((z.log_softmax(-1).gather(-1, t[..., None])[..., 0] * coef).sum(), (h64, w64))
    rel = lambda a, x: ((a.double() - x).norm() / x.norm()).item()
    for a, r, x in ((gh, rgh, xh), (gw, rgw, xw)):
        assert rel(a, x) < 8e-3 and rel(r, x) < 8e-3, (rel(a, x), rel(r, x))
    out.append((lp - rlp).abs().max().item())
print("OK", out)
"""


def test_fused_blocks_equal_the_torch_composite_values_and_grads():
    """The fused log-prob blocks (qerl_kernels.token_logprob, in the Triton interpreter) against torch's composite:
    log-probs and entropies within fp32 rounding of the sums' order, the gradients of h and of the lm_head weight
    equal up to the one bf16 rounding both make; vocabulary sizes below and above the forward's block, the first and
    last ids, with and without a bias, temperature 0.7 and 1."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-c", _FUSED_SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout + r.stderr
