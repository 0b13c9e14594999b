"""``qerl.train.fused``: the update phase's RMSNorm / SiLU gate routed through the engine's elementwise functions —
the routing, the restoration and the results, on CPU with the eager functions (the compiled ones run on CUDA:
``qerl bench step``)."""
import pytest
import torch

from qerl.models.tiny import TinySpec, build_tiny_model
from qerl.rl.aqn import AQN, AQNSettings
from qerl.rollout.engine.forward import EAGER
from qerl.train.fused import fused_elementwise


class _Counting:
    """The eager elementwise functions, counting their calls."""

    def __init__(self):
        self.calls = {"rms": 0, "silu_mul": 0}

    def rms(self, w, h, eps):
        self.calls["rms"] += 1
        return EAGER.rms(w, h, eps)

    def silu_mul(self, g, u):
        self.calls["silu_mul"] += 1
        return EAGER.silu_mul(g, u)


def _model(aqn: bool = False):
    torch.manual_seed(0)
    m, _ = build_tiny_model(TinySpec(), dtype=torch.float32)
    if aqn:
        AQN(m, AQNSettings())
    return m


def test_routes_every_norm_and_gate_and_gives_transformers_results_and_gradients():
    m = _model()
    ids = torch.randint(0, m.config.vocab_size, (2, 9))
    want = m(ids).logits
    (gw,) = torch.autograd.grad(want.square().mean(), [m.model.layers[0].mlp.gate_proj.weight])
    ew = _Counting()
    layers = m.config.num_hidden_layers
    with fused_elementwise(m, ew=ew) as n:
        assert n == 2 * layers + 1 + layers  # two norms per layer and the final one, one MLP per layer
        got = m(ids).logits
        (gg,) = torch.autograd.grad(got.square().mean(), [m.model.layers[0].mlp.gate_proj.weight])
    assert ew.calls == {"rms": 2 * layers + 1, "silu_mul": layers}
    torch.testing.assert_close(got, want, rtol=0, atol=0)  # the same operations in the same order
    torch.testing.assert_close(gg, gw, rtol=0, atol=0)
    # restored: the class forwards again, no per-instance attributes left
    assert all("forward" not in mod.__dict__ and "_qerl_ew" not in mod.__dict__ for mod in m.modules())
    m(ids)
    assert ew.calls == {"rms": 2 * layers + 1, "silu_mul": layers}


def test_aqn_norms_keep_their_noise_and_get_the_fused_forward_without_it():
    m = _model(aqn=True)
    aqn_forwards = {name: mod.forward for name, mod in m.named_modules() if hasattr(mod, "_aqn_original_forward")}
    originals = {name: mod._aqn_original_forward for name, mod in m.named_modules()
                 if hasattr(mod, "_aqn_original_forward")}
    ids = torch.randint(0, m.config.vocab_size, (1, 7))
    ew = _Counting()
    with fused_elementwise(m, ew=ew):
        m(ids)
        quiet = ew.calls["rms"]
        assert quiet == 2 * m.config.num_hidden_layers + 1  # no noise drawn: every norm fused
        aqn = AQN(m, AQNSettings())  # (re-attaching keeps the existing patch)
        aqn.draw(0.05, seed=1)
        m(ids)
        assert ew.calls["rms"] == quiet + 1  # noise drawn: the layer norms take AQN's path, the final norm is fused
        aqn.clear()
    for name, mod in m.named_modules():
        if name in originals:
            assert mod._aqn_original_forward == originals[name] and mod.forward == aqn_forwards[name]


def test_cpu_models_are_left_alone_by_default():
    m = _model()
    with fused_elementwise(m) as n:
        assert n == 0
        assert all("forward" not in mod.__dict__ for mod in m.modules())


def test_the_update_never_takes_the_forward_only_norm_launches():
    """The engine's compiled Elementwise routes CUDA norms / the gate to ``qerl_kernels.norm`` (no backward); the
    update's must not: its Inductor functions have the eager gradient (a regression: the launches once cut the
    gradient through every norm and left gate / up without one)."""
    from qerl.train import fused

    assert fused._compiled().norm_kernels is False


class _ForwardOnlyKernels:
    """A stand-in for ``qerl_kernels.norm``: the definitions, detached as a Triton launch's output is."""

    def __init__(self):
        self.calls = 0

    def rms_norm(self, h, w, eps, d=None, z=None):
        self.calls += 1
        s = h if d is None else h + d
        y = (EAGER.rms_noisy(w, z, s, eps) if z is not None else EAGER.rms(w, s, eps)).detach()
        return y if d is None else (s.detach(), y)

    def silu_mul(self, g, u):
        self.calls += 1
        return EAGER.silu_mul(g, u).detach()


def test_norm_launches_take_only_untracked_calls(monkeypatch):
    from qerl.rollout.engine import forward

    stub = _ForwardOnlyKernels()
    monkeypatch.setattr(forward, "_norm_module", lambda: stub)
    monkeypatch.setattr(forward, "KERNEL_DEVICES", ("cpu",))
    ew = forward.Elementwise(compiled=False)
    ew._norm_kernels()
    assert ew.norm_kernels
    torch.manual_seed(0)
    w, h, d = torch.randn(8), torch.randn(3, 8), torch.randn(3, 8)
    g, u = torch.randn(3, 16), torch.randn(3, 16)
    # untracked (the engine's rollouts): the launches
    torch.testing.assert_close(ew.rms(w, h, 1e-6), EAGER.rms(w, h, 1e-6), rtol=0, atol=0)
    ew.add_rms(h, d, w, 1e-6)
    ew.silu_mul(g, u)
    assert stub.calls == 3
    with torch.no_grad():  # tracked tensors under no_grad: nothing to differentiate, the launches again
        ew.rms(w, h.requires_grad_(), 1e-6)
    assert stub.calls == 4
    # tracked: the functions with a backward, and their gradients are the eager ones
    hs = [h.detach().clone().requires_grad_() for _ in range(2)]
    gs = [g.detach().clone().requires_grad_() for _ in range(2)]
    for f, hh, gg in ((ew, hs[0], gs[0]), (EAGER, hs[1], gs[1])):
        s, y = f.add_rms(hh, d, w, 1e-6)
        (y.square().sum() + s.sum() + f.silu_mul(gg, u).square().sum() + f.rms(w, hh, 1e-6).sum()).backward()
    assert stub.calls == 4
    torch.testing.assert_close(hs[0].grad, hs[1].grad, rtol=0, atol=0)
    torch.testing.assert_close(gs[0].grad, gs[1].grad, rtol=0, atol=0)
    # a tracked weight (a trainable norm) takes the function too
    ew.rms(w.clone().requires_grad_(), h.detach(), 1e-6)
    assert stub.calls == 4


class _DetachedGate(_Counting):
    """The SiLU gate with the right values and no backward (as a forward-only launch)."""

    def silu_mul(self, g, u):
        return super().silu_mul(g, u).detach()


class _Detaching(_DetachedGate):
    """The norms too: the final norm then cuts every parameter from the loss."""

    def rms(self, w, h, eps):
        return super().rms(w, h, eps).detach()


def test_update_check_passes_the_eager_functions_and_flags_forward_only_ones():
    from qerl.bench.update_check import compare
    from qerl.lora import LoraSettings, apply_lora

    policy = apply_lora(_model(), LoraSettings(r=4, alpha=8))
    with torch.no_grad():
        for n, p in policy.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    ids = torch.randint(0, policy.config.vocab_size, (2, 9))
    layers = policy.config.num_hidden_layers
    good = compare(policy, ids, ew=_Counting())
    assert good["ok"] and good["n_missing"] == 0 and good["grad_rel_max"] == 0.0 and good["no_grad_equals_grad"]
    assert good["trainable"] == 2 * 7 * layers
    gate = compare(policy, ids, ew=_DetachedGate())  # gate / up feed only the detached gate: no gradient at all
    assert not gate["ok"] and gate["n_missing"] == 2 * 2 * layers
    assert all(any(k in n for k in ("gate_proj", "up_proj")) for n in gate["missing_gradients"])
    assert gate["grad_rel_max"] > 0.05  # and the layers below lost the MLP's share of their gradient
    cut = compare(policy, ids, ew=_Detaching())
    assert not cut["ok"] and cut["n_missing"] == cut["trainable"]


@pytest.mark.parametrize("ew, match", [(_DetachedGate, r"step 1: 8 of 28 trainable parameters got no gradient \(e\.g\. "
                                                      r".*gate_proj.*\): a forward-only kernel"),
                                       (_Detaching, "step 1: the update's loss does not depend on any trainable")])
def test_update_stops_with_a_clear_error_when_the_forward_cuts_the_gradient(tiny_dirs, monkeypatch, ew, match):
    """The trainer's update phase refuses to step when its forward cuts gradients (the defect of 298c7b2: the
    update's norms and gate through forward-only launches): every trainable parameter must get a gradient, and the
    loss must depend on them; nothing is applied."""
    from qerl.bench import step as bench_step
    from qerl.errors import TrainingError
    from qerl.lora import LoraSettings, apply_lora
    from qerl.models import load_policy
    from qerl.models.random import CountTokenizer
    from qerl.train import fused, update

    policy = apply_lora(load_policy(tiny_dirs["qwen2"], base="nvfp4", dtype=torch.float32), LoraSettings(r=4))
    with torch.no_grad():
        for n, p in policy.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    params = [p for p in policy.parameters() if p.requires_grad]
    before = [p.detach().clone() for p in params]
    opt = torch.optim.AdamW(params, lr=1e-2)
    real = fused.fused_elementwise
    monkeypatch.setattr(update, "fused_elementwise", lambda model, **kw: real(model, ew=ew(), **kw))
    with pytest.raises(TrainingError, match=match):
        bench_step.one_step(policy, CountTokenizer(), None, batch=4, prompt_len=5, gen_len=4, micro=2, optimizer=opt,
                            seed=1)
    assert all(torch.equal(a, p) for a, p in zip(before, params))  # no optimizer step
