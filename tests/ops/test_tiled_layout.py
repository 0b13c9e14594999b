"""NVFP4 weights kept in the engine's tile-contiguous layout by the public modules (issue 66, item 2):
``NVFP4Linear.set_layout(True)`` re-lays a layer once, in place; its forward, backward, LoRA (PEFT) and training op
read the layout as it lies (``tiled=True``) and give what the row-major layer gives; the checkpoint it saves stays
row-major; the rollout engine takes a tiled model as it is and leaves it tiled."""
import json
import os
import subprocess
import sys

import pytest
import torch

from qerl.models.nvfp4_linear import NVFP4Linear
from qerl.quant import nvfp4


def _layer(N=128, K=256, bias=True, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    lin = torch.nn.Linear(K, N, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(N, K, generator=g) * 0.05)
        if bias:
            lin.bias.copy_(torch.randn(N, generator=g) * 0.1)
    return NVFP4Linear.from_linear(lin.to(dtype))


def test_a_tiled_layer_computes_what_the_row_major_one_does_and_saves_row_major():
    """Forward and dX bit-equal to the row-major layer (CPU: the reference on a row-major copy); the bytes are
    reordered in place (same tensors), state_dict() is the checkpoint's row-major format, load_state_dict keeps
    the layout; back to rows restores every byte."""
    rows, tiled = _layer(), _layer()
    packed, scale = tiled.weight_packed, tiled.weight_scale
    assert tiled.set_layout(True) and tiled.tiled and not tiled.set_layout(True)
    assert tiled.weight_packed is packed and tiled.weight_scale is scale  # in place: views of them stay valid
    assert not torch.equal(tiled.weight_packed, rows.weight_packed)
    assert "layout=tiled" in repr(tiled) and "layout" not in repr(rows)
    x = torch.randn(3, 5, 256, requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    y, y2 = rows(x), tiled(x2)
    assert torch.equal(y, y2)
    dy = torch.randn_like(y)
    y.backward(dy)
    y2.backward(dy)
    assert torch.equal(x.grad, x2.grad)
    assert torch.equal(tiled.dequantized_weight(torch.float32), rows.dequantized_weight(torch.float32))
    sd, want = tiled.state_dict(), rows.state_dict()
    assert sd.keys() == want.keys()
    assert all(torch.equal(sd[k].view(torch.uint8) if sd[k].dtype == torch.float8_e4m3fn else sd[k],
                           want[k].view(torch.uint8) if want[k].dtype == torch.float8_e4m3fn else want[k]) for k in sd)
    other = _layer(seed=1)
    other.set_layout(True)
    other.load_state_dict(want)  # a row-major checkpoint into a tiled layer: stays tiled, computes the same
    assert other.tiled and torch.equal(other.weight_packed, tiled.weight_packed)
    from qerl.models.nvfp4_linear import LAYOUT_CHANGES

    changes = LAYOUT_CHANGES[0]  # a state dict without the packed tensors (PEFT loading adapters): nothing re-laid
    other.load_state_dict({}, strict=False)
    assert LAYOUT_CHANGES[0] == changes and other.tiled
    assert torch.equal(other(x.detach()), y.detach())
    assert tiled.set_layout(False) and torch.equal(tiled.weight_packed, rows.weight_packed)
    assert torch.equal(tiled.weight_scale.view(torch.uint8), rows.weight_scale.view(torch.uint8))


def test_a_layer_without_whole_tiles_is_refused_naming_its_shape():
    layer = _layer(N=96, K=256)
    assert not layer.can_tile()
    with pytest.raises(nvfp4.NVFP4Error, match=r"\[96, 256\]: the tiled layout needs out_features % 64 == 0"):
        layer.set_layout(True)
    assert not layer.tiled


def test_peft_lora_and_the_training_op_on_a_tiled_base():
    """PEFT LoRA over a tiled NVFP4Linear: the no-grad fused call and the one-node training op (bf16, fp32 masters)
    give the row-major base's outputs and gradients, and the dense update-phase weight (dense_base) is the
    row-major dequantization."""
    peft = pytest.importorskip("peft")
    from qerl.lora import _lora_linear_cls
    from qerl.models.nvfp4_linear import dense_base

    def model(tiled):
        m = torch.nn.Sequential()
        m.add_module("q_proj", _layer(dtype=torch.bfloat16))
        m.register_parameter("anchor", torch.nn.Parameter(torch.zeros(1)))  # (PEFT reads a parameter's device)
        if tiled:
            m.q_proj.set_layout(True)
        config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj"])
        config._register_custom_module({NVFP4Linear: _lora_linear_cls()})
        torch.manual_seed(0)
        pm = peft.get_peft_model(m, config)
        with torch.no_grad():
            for n, p in pm.named_parameters():
                if "lora_B" in n:
                    p.copy_(torch.randn_like(p) * 0.1)
        return pm

    a, b = model(False), model(True)
    x = torch.randn(4, 256, dtype=torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(a(x), b(x))
    outs = []
    for m in (a, b):
        xi = x.clone().requires_grad_(True)
        y = m(xi)
        y.float().pow(2).sum().backward()
        grads = [p.grad for n, p in m.named_parameters() if "lora_" in n]
        outs.append((y.detach(), xi.grad, *grads))
    for got, want in zip(outs[1], outs[0]):
        assert torch.equal(got, want)
    proj = [mod for mod in b.modules() if isinstance(mod, NVFP4Linear)][0]
    with dense_base(b):
        assert torch.equal(proj.dense, proj.dequantized_weight(torch.bfloat16))


def test_the_engine_takes_a_tiled_model_as_it_is_and_leaves_it_tiled(tmp_path):
    """A policy whose NVFP4 layers were re-laid at load: the rollout engine (row-major or tiling engine) draws the
    row-major model's tokens and log-probs, fuses the tiled siblings, and after each generation the layers are
    tiled again (their own layout), so the trainer's forward still equals the row-major model's. Re-laying a layer
    after an engine exists makes engine_for build a new one."""
    from transformers import AutoTokenizer

    from qerl.models import load_policy
    from qerl.models.tiny import TinySpec, save_tiny_model
    from qerl.rollout import SamplingSettings
    from qerl.rollout.engine import RolloutEngine, engine_for
    from qerl.stages.quantize import quantize_checkpoint

    src = save_tiny_model(tmp_path / "t", TinySpec(hidden_size=128, intermediate_size=256, seed=3))
    quantize_checkpoint(src, tmp_path / "q", progress=False)
    tok = AutoTokenizer.from_pretrained(src)
    prompts = ["12+7=", "a b c"]
    rows = load_policy(tmp_path / "q", dtype=torch.float32)
    tiled = load_policy(tmp_path / "q", dtype=torch.float32)
    layers = [m for m in tiled.modules() if isinstance(m, NVFP4Linear)]
    assert layers and all(m.set_layout(True) for m in layers)
    s = SamplingSettings(temperature=0.7, max_new_tokens=8)
    want = RolloutEngine(rows, tok).generate(prompts, s, seed=5, num_samples=2)
    enc = tok(prompts, return_tensors="pt", padding=True)
    with torch.no_grad():
        logits = rows(**enc).logits
    for layout in ("rows", "tiled"):
        eng = RolloutEngine(tiled, tok, weight_layout=layout)
        assert all(p.tiled and p.home for p in eng.view.projs)
        assert len(eng.view.projs) < len(layers)  # q/k/v and gate/up fused, tiled as they were
        got = eng.generate(prompts, s, seed=5, num_samples=2)
        assert torch.equal(got.completion_ids, want.completion_ids) and torch.equal(got.logprobs, want.logprobs)
        assert all(m.tiled for m in layers) and all(p.tiled for p in eng.view.projs)
        with torch.no_grad():
            assert torch.equal(tiled(**enc).logits, logits)
    first = engine_for(tiled, tok)
    assert engine_for(tiled, tok) is first
    fresh = load_policy(tmp_path / "q", dtype=torch.float32)
    other = [m for m in fresh.modules() if isinstance(m, NVFP4Linear)][0]
    other.set_layout(True)  # any layer re-laid since: the cached engine's views and graphs may be stale
    assert engine_for(tiled, tok) is not first


def test_the_kernels_read_tiled_weights_as_they_lie_under_interpreter():
    """On the kernels' path (the Triton interpreter, bf16): nvfp4_linear, its backward, nvfp4_lora_linear and
    nvfp4_lora_train on tiled weights launch the kernels with tiled=True (no row-major copy) and agree with the
    row-major calls to bf16 rounding (the tiled route may take another tile config: ops.tiled_config)."""
    code = """
import json, torch
from qerl.ops import linear, nvfp4_linear, nvfp4_lora_linear, nvfp4_lora_train
from qerl.quant import nvfp4
import qerl_kernels.ops as kops
from qerl_kernels.layout import tile
g = torch.Generator().manual_seed(0)
N, K, R = 128, 256, 16
p, s, gs = nvfp4.quantize(torch.randn(N, K, generator=g) * 0.05)
tp, ts = tile(p, s)
seen = []
real = kops.nvfp4_matmul, kops.nvfp4_matmul_t
def mm(*a, tiled=False, **k):
    seen.append(("fwd", tiled)); return real[0](*a, tiled=tiled, **k)
def mt(*a, tiled=False, **k):
    seen.append(("bwd", tiled)); return real[1](*a, tiled=tiled, **k)
kops.nvfp4_matmul, kops.nvfp4_matmul_t = mm, mt
x = (torch.randn(24, K, generator=g)).to(torch.bfloat16)
la = (torch.randn(R, K, generator=g) * 0.1); lb = (torch.randn(N, R, generator=g) * 0.1)
out = {}
def close(a, b):  # to bf16 rounding, relative to the tensor's size
    return float((a.float() - b.float()).norm() / b.float().norm()) < 1e-2
out["fwd"] = close(nvfp4_linear(x, tp, ts, gs, tiled=True), nvfp4_linear(x, p, s, gs))
out["lora"] = close(nvfp4_lora_linear(x, tp, ts, gs, None, la.bfloat16(), lb.bfloat16(), 0.5, tiled=True),
                    nvfp4_lora_linear(x, p, s, gs, None, la.bfloat16(), lb.bfloat16(), 0.5))
def grads(tiled):
    xi = x.clone().requires_grad_(True); a = la.clone().requires_grad_(True); b = lb.clone().requires_grad_(True)
    y = nvfp4_lora_train(xi, tp if tiled else p, ts if tiled else s, gs, None, a, b, 0.5, tiled=tiled)
    y.float().pow(2).sum().backward()
    xb = x.clone().requires_grad_(True)
    nvfp4_linear(xb, tp if tiled else p, ts if tiled else s, gs, tiled=tiled).float().sum().backward()
    return y, xi.grad, a.grad, b.grad, xb.grad
out["train"] = all(close(u, v) for u, v in zip(grads(True), grads(False)))
out["tiled_calls"] = sorted(set(k for k, t in seen if t))
out["backend"] = linear.select_backend(x, tp).name
print(json.dumps(out))
"""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got == {"fwd": True, "lora": True, "train": True, "tiled_calls": ["bwd", "fwd"],
                   "backend": "triton-nvfp4"}
