"""``qerl.train.fused``: the update phase's RMSNorm / SiLU gate routed through the engine's elementwise functions —
the routing, the restoration and the results, on CPU with the eager functions (the compiled ones run on CUDA:
``qerl bench step``)."""
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
