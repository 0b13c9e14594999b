"""AQN: schedule, the paper's norm/row-scaling equivalence, non-accumulation, no effect when off."""
import math

import pytest
import torch

from qerl.models import load_policy
from qerl.rl.aqn import AQN, AQNSettings, active_noise, sigma_at, stage_of, target_norms


def test_stage_boundaries_and_exponential_sigma():
    s = AQNSettings(sigma_start=1e-2, sigma_end=5e-4, stages=10)
    total = 110  # 11 intervals of 10 steps: stage 0 then 10 noise levels
    assert [stage_of(t, total, 10) for t in (0, 9, 10, 19, 20, 109)] == [0, 0, 1, 1, 2, 10]
    assert sigma_at(0, total, s) == 0.0 and sigma_at(9, total, s) == 0.0
    assert sigma_at(10, total, s) == pytest.approx(1e-2)  # first noisy step: exactly σ_start
    for k in range(1, 11):
        want = 1e-2 * (5e-4 / 1e-2) ** ((k - 1) / 9)
        assert sigma_at(10 * k, total, s) == pytest.approx(want, rel=1e-12)
        assert sigma_at(10 * k + 9, total, s) == pytest.approx(want, rel=1e-12)
    assert sigma_at(109, total, s) == pytest.approx(5e-4)  # last stage: exactly σ_end


@pytest.mark.parametrize("schedule", ["linear", "cosine", "logarithmic", "exponential"])
def test_all_schedules_go_from_start_to_end_monotonically(schedule):
    s = AQNSettings(sigma_start=5e-2, sigma_end=5e-4, stages=5, schedule=schedule)
    sig = [sigma_at(t, 60, s) for t in range(0, 60, 10)]
    assert sig[0] == 0 and sig[1] == pytest.approx(5e-2) and sig[-1] == pytest.approx(5e-4)
    assert all(a >= b for a, b in zip(sig[1:], sig[2:]))


@pytest.mark.parametrize("kwargs, match", [({"stages": 0}, "K"), ({"sigma_end": 0.1}, "sigma_end"),
                                           ({"schedule": "step"}, "schedule"), ({"apply_to": "train"}, "apply_to")])
def test_settings_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AQNSettings(**kwargs)


def _x(model, n=5):
    g = torch.Generator().manual_seed(3)
    return torch.randn(2, n, model.config.hidden_size, generator=g).to(torch.bfloat16)


def test_noise_on_norm_equals_row_scaling_of_next_quantized_weights(quantized_dirs):
    model = load_policy(quantized_dirs["qwen2"], base="nvfp4", dtype=torch.float32)
    layer = model.model.layers[0]
    aqn = AQN(model, AQNSettings())
    x = _x(model).float()
    aqn.draw(0.05, seed=11)
    z = active_noise(layer.input_layernorm)
    w = layer.input_layernorm.weight.detach().float()
    noisy_q = layer.self_attn.q_proj(layer.input_layernorm(x))
    aqn.clear()
    clean_h = layer.input_layernorm(x)
    wq = layer.self_attn.q_proj.dequantized_weight(torch.float32)  # [N, K]
    scaled = wq * (1 + z / w).unsqueeze(0)  # (1 + Z/w) scales the K (input) rows of Ŵᵀ
    want = clean_h @ scaled.T + layer.self_attn.q_proj.bias.float()
    assert torch.allclose(noisy_q, want, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(noisy_q, layer.self_attn.q_proj(clean_h), atol=1e-4)


def test_targets_exactly_the_norms_feeding_quantized_linears(quantized_dirs):
    model = load_policy(quantized_dirs["llama"])
    names = set(target_norms(model))
    n = model.config.num_hidden_layers
    assert len(names) == 2 * n and not any(nm.endswith("model.norm") for nm in names)
    assert len(target_norms(model, final_norm=True)) == 2 * n + 1


def test_no_accumulation_and_no_effect_when_off(quantized_dirs):
    model = load_policy(quantized_dirs["qwen2"])
    ids = torch.randint(3, 250, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(ids).logits
        weights = {k: v.clone() for k, v in model.state_dict().items()}
        aqn = AQN(model, AQNSettings())
        assert torch.equal(model(ids).logits, before)  # attached but no draw: bit-identical
        for step in range(50):
            with aqn.noise(1e-2, seed=step):
                noisy = model(ids).logits
            assert not torch.equal(noisy, before)
        after = model(ids).logits
        with aqn.noise(0.0, seed=1):  # σ = 0 (stage 0): the original forward
            zero = model(ids).logits
    assert torch.equal(after, before) and torch.equal(zero, before)
    assert all(torch.equal(v.view(torch.uint8) if v.dtype == torch.float8_e4m3fn else v,
                           weights[k].view(torch.uint8) if v.dtype == torch.float8_e4m3fn else weights[k])
               for k, v in model.state_dict().items())


def test_small_sigma_survives_bf16(quantized_dirs):
    # σ = 5e-4 is below bf16 spacing near 1.0: written into a bf16 weight it would vanish
    model = load_policy(quantized_dirs["qwen2"])
    norm = model.model.layers[0].input_layernorm
    assert torch.equal((norm.weight + 5e-4).to(torch.bfloat16), norm.weight)  # the trap
    aqn = AQN(model, AQNSettings())
    x = _x(model, 256)
    with torch.no_grad():
        clean = norm(x)
        with aqn.noise(5e-4, seed=0):
            noisy = norm(x)
            z = active_noise(norm)
    changed = noisy != clean
    assert changed.float().mean() > 0.03
    # the shifts follow the noise: sign(noisy - clean) == sign(z * x) where they differ
    agree = torch.sign((noisy - clean).float()) == torch.sign(z * x.float())
    assert agree[changed].float().mean() > 0.9


def test_seeded_draws_are_reproducible(quantized_dirs):
    model = load_policy(quantized_dirs["qwen2"])
    aqn = AQN(model, AQNSettings())
    aqn.draw(1e-2, seed=5)
    a = {k: v.clone() for k, v in aqn.current().items()}
    aqn.draw(1e-2, seed=6)
    b = aqn.current()
    aqn.draw(1e-2, seed=5)
    c = aqn.current()
    assert all(torch.equal(a[k], c[k]) for k in a) and not all(torch.equal(a[k], b[k]) for k in a)
    z = torch.cat([v for v in a.values()])
    assert z.std().item() == pytest.approx(1e-2, rel=0.2) and math.isfinite(z.sum().item())
