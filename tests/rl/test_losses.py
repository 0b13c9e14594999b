"""Losses and advantages against hand-computed values."""
import math

import pytest
import torch

from qerl.rl.advantages import group_advantages, informative_groups, overlong_penalty
from qerl.rl.losses import LossSettings, mismatch_stats, policy_loss, truncated_is_weights


def test_group_advantages_by_hand():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5])
    a = group_advantages(r, 4, eps=1e-6)
    s = math.sqrt(1 / 3)  # unbiased std of [1, 0, 0, 1]
    assert torch.allclose(a[:4], torch.tensor([0.5, -0.5, -0.5, 0.5]) / (s + 1e-6))
    assert torch.equal(a[4:], torch.zeros(4))  # equal rewards: zero advantage, no NaN
    assert torch.allclose(group_advantages(r, 4, scale="none"), torch.tensor([.5, -.5, -.5, .5, 0, 0, 0, 0]))
    with pytest.raises(ValueError, match="group_size must be >= 2"):
        group_advantages(r, 1)


def test_informative_groups_and_overlong_penalty():
    r = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0])
    assert informative_groups(r, 2).tolist() == [False, True, False]
    pen = overlong_penalty(torch.tensor([10, 12, 14, 16, 20]), max_len=16, cache_len=4)
    assert pen.tolist() == [0.0, 0.0, -0.5, -1.0, -1.0]


def _inputs():
    logp = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.2, 0.0]])
    old = torch.tensor([[-1.1, -1.5, -0.5], [-0.3, -0.9, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    adv = torch.tensor([1.0, -2.0])
    return logp, old, adv, mask


def _hand(logp, old, adv, mask, lo, hi):
    out = torch.zeros_like(logp)
    for i in range(2):
        for t in range(3):
            r = math.exp(logp[i, t] - old[i, t])
            a = float(adv[i])
            out[i, t] = max(-a * r, -a * min(max(r, 1 - lo), 1 + hi))
    return out * mask


def test_grpo_dapo_drgrpo_aggregation_by_hand():
    logp, old, adv, mask = _inputs()
    tok = _hand(logp, old, adv, mask, 0.2, 0.2)
    loss, info = policy_loss(logp, old, adv, mask, LossSettings("grpo"))
    want = (tok[0].sum() / 3 + tok[1].sum() / 2) / 2
    assert loss.item() == pytest.approx(want.item(), rel=1e-6)
    tok_d = _hand(logp, old, adv, mask, 0.2, 0.28)
    loss, _ = policy_loss(logp, old, adv, mask, LossSettings("dapo", clip_high=0.28))
    assert loss.item() == pytest.approx((tok_d.sum() / 5).item(), rel=1e-6)
    loss, _ = policy_loss(logp, old, adv, mask, LossSettings("dr_grpo", max_len=4))
    assert loss.item() == pytest.approx((tok.sum() / (2 * 4)).item(), rel=1e-6)
    # clip fraction: token (0,0) has ratio e^0.1 > 1.2? no; (0,1) e^-0.5=0.61 with A>0 -> not clipped
    # (clipping only binds when it lowers the objective); (1,1) ratio e^-0.3=0.74 with A<0 -> clipped
    assert info["clip_frac"] == pytest.approx(1 / 5)
    assert info["ratio_max"] == pytest.approx(math.exp(0.1), rel=1e-6)


def test_kl_k3_and_gradient():
    logp, old, adv, mask = _inputs()
    logp = logp.clone().requires_grad_(True)
    ref = torch.tensor([[-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]])
    loss, info = policy_loss(logp, old, adv, mask, LossSettings("grpo", kl_coef=0.1), ref_logp=ref)
    d = ref - logp.detach()
    k3 = torch.exp(d) - d - 1
    assert info["kl"] == pytest.approx(((k3 * mask).sum() / mask.sum()).item(), rel=1e-6)
    loss.backward()
    assert logp.grad[1, 2] == 0  # masked token gets no gradient
    with pytest.raises(ValueError, match="ref_logp"):
        policy_loss(logp, old, adv, mask, LossSettings("grpo", kl_coef=0.1))


def test_on_policy_gradient_is_minus_advantage():
    # at ratio 1 the gradient wrt logp of the GRPO loss is -A / (len * B)
    logp = torch.zeros(2, 2, requires_grad=True)
    loss, _ = policy_loss(logp, logp.detach(), torch.tensor([1.0, -1.0]), torch.ones(2, 2), LossSettings("grpo"))
    loss.backward()
    assert torch.allclose(logp.grad, torch.tensor([[-0.25, -0.25], [0.25, 0.25]]))


def test_tis_and_mismatch():
    old = torch.log(torch.tensor([[0.5, 0.2]]))
    roll = torch.log(torch.tensor([[0.25, 0.4]]))
    w = truncated_is_weights(old, roll, cap=1.5)
    assert torch.allclose(w, torch.tensor([[1.5, 0.5]]))
    st = mismatch_stats(old, roll, torch.ones(1, 2))
    r = torch.tensor([2.0, 0.5])
    assert st["mismatch_kl"] == pytest.approx(float((r - 1 - r.log()).mean()), rel=1e-6)
    assert st["is_ratio_max"] == pytest.approx(2.0)


def test_gspo_sequence_ratio_loss_and_gradient_by_hand():
    """GSPO (Zheng et al. 2025, eq. 5-7): s_i = exp(mean_t (logp − old)) over completion i's tokens, the loss
    -(1/G) Σ_i min(s_i A_i, clip(s_i, 1 − 3e-4, 1 + 4e-4) A_i), and its gradient s_i A_i / |y_i| on each token of
    an unclipped completion, 0 on a clipped one, by hand."""
    old = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.2, 0.0], [-0.7, -0.7, -0.7]])
    delta = torch.tensor([[3e-4, -1e-4, 0.0], [2e-3, 4e-3, 9.0], [-5e-4, -5e-4, 7e-4]])  # row 1's last: padding
    logp = (old + delta).requires_grad_()
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    adv = torch.tensor([1.0, 2.0, -1.0])
    settings = LossSettings("gspo")
    assert (settings.aggregation, settings.ratio_level, settings.clip_low, settings.clip_high) == \
        ("sequence-mean", "sequence", 3e-4, 4e-4)
    loss, info = policy_loss(logp, old, adv, mask, settings)
    s = [math.exp((3e-4 - 1e-4) / 3), math.exp((2e-3 + 4e-3) / 2), math.exp((-5e-4 - 5e-4 + 7e-4) / 3)]
    terms = [max(-a * r, -a * min(max(r, 1 - 3e-4), 1 + 4e-4)) for r, a in zip(s, (1.0, 2.0, -1.0))]
    assert loss.item() == pytest.approx(sum(terms) / 3, rel=1e-6)
    # row 0: s = e^(6.7e-5) inside the clip; row 1: s = e^0.003 > 1 + 4e-4 with A > 0: clipped (no gradient);
    # row 2: s = e^(-1e-4) inside the clip
    assert info["clip_frac"] == pytest.approx(2 / 8)  # row 1's two tokens of 8
    loss.backward()
    want = torch.zeros(3, 3)
    want[0, :] = -1.0 * s[0] / 3 / 3
    want[2, :] = 1.0 * s[2] / 3 / 3
    assert torch.allclose(logp.grad, want, rtol=1e-5, atol=1e-9), logp.grad
    # the same ratio on every token: GRPO's token ratios differ, GSPO's mean is s_i on each of the row's tokens
    assert info["ratio_mean"] == pytest.approx((3 * s[0] + 2 * s[1] + 3 * s[2]) / 8, rel=1e-6)


def test_axes_override_a_preset_and_bad_axes_are_named():
    """A preset's axes can be set one by one (GRPO with sequence-level ratios is GSPO's ratio under GRPO's ε); an
    unknown aggregation or ratio level is a ValueError naming the axis."""
    logp, old, adv, mask = _inputs()
    a, _ = policy_loss(logp, old, adv, mask, LossSettings("grpo", ratio_level="sequence"))
    b, _ = policy_loss(logp, old, adv, mask, LossSettings("gspo", clip_low=0.2, clip_high=0.2))
    assert a.item() == b.item()
    c, _ = policy_loss(logp, old, adv, mask, LossSettings("grpo", aggregation="token-mean", clip_high=0.28))
    d, _ = policy_loss(logp, old, adv, mask, LossSettings("dapo"))
    assert c.item() == d.item()
    with pytest.raises(ValueError, match=r"LossSettings.aggregation: 'mean' is not one of"):
        LossSettings("grpo", aggregation="mean")
    with pytest.raises(ValueError, match=r"LossSettings.ratio_level: 'group' is not one of \('token', 'sequence'\)"):
        LossSettings("grpo", ratio_level="group")


@pytest.mark.parametrize("kwargs, match", [({"algorithm": "ppo"}, "algorithm"), ({"clip_low": -0.1}, "ε"),
                                           ({"kl_coef": -1}, "kl_coef"), ({"algorithm": "dr_grpo"}, "max_len")])
def test_settings_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LossSettings(**kwargs)


@pytest.mark.parametrize("algorithm", ["grpo", "dapo", "dr_grpo", "gspo"])
def test_policy_loss_without_sync_gives_the_same_info_as_tensors(algorithm):
    """``sync=False`` (the training loop's: nothing waits for the GPU) returns the same loss and, as detached 0-dim
    tensors, the same diagnostics as the default floats — also with a row and a whole batch of no tokens."""
    g = torch.Generator().manual_seed(1)
    logp = -torch.rand(3, 5, generator=g)
    old = logp + 0.3 * torch.randn(3, 5, generator=g)
    adv, ent = torch.randn(3, generator=g), torch.rand(3, 5, generator=g)
    s = LossSettings(algorithm, 0.2, 0.28, 0.1, 5)
    for mask in (torch.tensor([[1, 1, 1, 0, 0], [0] * 5, [1, 1, 1, 1, 1]]), torch.zeros(3, 5)):
        loss, info = policy_loss(logp, old, adv, mask, s, ref_logp=old - 0.1, entropy=ent)
        loss2, info2 = policy_loss(logp, old, adv, mask, s, ref_logp=old - 0.1, entropy=ent, sync=False)
        assert torch.equal(loss, loss2) and info.keys() == info2.keys()
        for k, v in info.items():
            assert isinstance(v, float) and torch.is_tensor(info2[k]) and info2[k].ndim == 0
            assert info2[k].item() == pytest.approx(v, rel=1e-6, abs=1e-7), k
    assert info["ratio_min"] == info["ratio_max"] == info["ratio_mean"] == 1.0  # (no tokens: the ratio is 1)
    m = torch.tensor([[1, 1, 0, 0, 0], [1, 0, 0, 0, 0], [0] * 5])
    _, info = policy_loss(logp, old, adv, m, s, ref_logp=old)
    log_r = logp - old
    if s.ratio_level == "sequence":  # (GSPO: each row's mean log ratio on each of its tokens)
        log_r = ((log_r * m).sum(1) / m.sum(1).clamp(min=1)).unsqueeze(1).expand_as(logp)
    r = torch.exp(log_r)[m.bool()]
    assert (info["ratio_min"], info["ratio_max"]) == (r.min().item(), r.max().item())
    assert info["ratio_mean"] == pytest.approx(r.mean().item(), rel=1e-6)
