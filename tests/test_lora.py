"""LoRA on NVFP4 / bf16 / NF4 bases: gradients, frozen base, PEFT-format round trips, merging."""
import json
import types

import pytest
import torch

import qerl.lora
from qerl.lora import LoraSettings, apply_lora, export_merged, load_adapter, save_adapter
from qerl.models import NVFP4Linear, load_policy

X = torch.randint(3, 250, (2, 10), generator=torch.Generator().manual_seed(0))


def _train(model, steps=3, lr=1e-2):
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    for _ in range(steps):
        loss = model(input_ids=X, labels=X).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    return model


def _packed_state(model):
    return {k: v.view(torch.uint8).clone() for k, v in model.state_dict().items()
            if k.endswith(("weight_packed", "weight_scale", "weight_global_scale"))}


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_gradients_reach_lora_and_inputs_base_stays_bit_identical(arch, quantized_dirs):
    torch.manual_seed(0)
    pm = apply_lora(load_policy(quantized_dirs[arch]), LoraSettings(r=8, alpha=16))
    trainable = {n for n, p in pm.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert len(trainable) == 2 * 7 * pm.config.num_hidden_layers
    before = _packed_state(pm)
    emb = pm.get_input_embeddings()(X).detach().requires_grad_(True)
    loss = pm(inputs_embeds=emb, labels=X).loss
    loss.backward()
    assert emb.grad is not None and emb.grad.abs().sum() > 0  # dX flows through the NVFP4 base
    assert all(p.grad is not None for n, p in pm.named_parameters() if "lora_A" in n)  # B=0 at init
    pm.zero_grad()
    _train(pm, steps=5)
    after = _packed_state(pm)
    assert before.keys() == after.keys() and len(before) == 3 * 7 * pm.config.num_hidden_layers
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert any(p.abs().sum() > 0 for n, p in pm.named_parameters() if "lora_B" in n)


def test_fresh_adapter_is_identity(quantized_dirs):
    base = load_policy(quantized_dirs["qwen2"])
    with torch.no_grad():
        ref = base(X).logits
    pm = apply_lora(base)
    with torch.no_grad():
        assert torch.equal(pm(input_ids=X).logits, ref)


def test_peft_format_round_trip_and_peft_on_dequantized_base(quantized_dirs, tmp_path):
    from peft import PeftModel
    from safetensors import safe_open

    torch.manual_seed(0)
    pm = _train(apply_lora(load_policy(quantized_dirs["qwen2"]), LoraSettings(r=4, alpha=8, dropout=0.1)))
    pm.eval()
    with torch.no_grad():
        ours = pm(input_ids=X).logits
    out = save_adapter(pm, tmp_path / "adapter")
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and cfg["r"] == 4 and cfg["lora_alpha"] == 8
    assert set(cfg["target_modules"]) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    with safe_open(out / "adapter_model.safetensors", "pt") as f:
        keys = list(f.keys())
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in keys
    assert all(k.endswith(("lora_A.weight", "lora_B.weight")) for k in keys)
    # stock PEFT on the dequantized bf16 base reproduces our logits exactly
    stock = PeftModel.from_pretrained(load_policy(quantized_dirs["qwen2"], base="bf16"), str(out))
    with torch.no_grad():
        assert torch.equal(stock(input_ids=X).logits, ours)
    # and our loader on the NVFP4 base
    again = load_adapter(load_policy(quantized_dirs["qwen2"]), out)
    assert isinstance(again.base_model.model.model.layers[0].self_attn.q_proj.base_layer, NVFP4Linear)
    with torch.no_grad():
        assert torch.equal(again(input_ids=X).logits, ours)


def test_export_merged_bf16(quantized_dirs, tmp_path):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    pm = _train(apply_lora(load_policy(quantized_dirs["llama"]), LoraSettings(r=4)))
    with torch.no_grad():
        ours = pm(input_ids=X).logits.float()
    save_adapter(pm, tmp_path / "ad")
    with pytest.raises(RuntimeError, match="export_merged"):
        pm.base_model.model.model.layers[0].self_attn.q_proj.merge()
    export_merged(quantized_dirs["llama"], tmp_path / "ad", tmp_path / "merged")
    cfg = json.loads((tmp_path / "merged" / "config.json").read_text())
    assert "quantization_config" not in cfg
    assert (tmp_path / "merged" / "tokenizer.json").exists()
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    with torch.no_grad():
        # merged weights are rounded to bf16 once: close, not bit-equal
        assert (merged(X).logits.float() - ours).abs().max() < 0.05


def test_lora_on_bf16_and_nf4_bases(tiny_dirs):
    pytest.importorskip("bitsandbytes")
    for base in ("bf16", "nf4"):
        torch.manual_seed(0)
        pm = apply_lora(load_policy(tiny_dirs["qwen2"], base=base), LoraSettings(r=4))
        _train(pm, steps=2)
        assert any(p.abs().sum() > 0 for n, p in pm.named_parameters() if "lora_B" in n)


def test_train_norms_option(quantized_dirs):
    pm = apply_lora(load_policy(quantized_dirs["qwen2"]), LoraSettings(r=4, train_norms=True))
    trainable = [n for n, p in pm.named_parameters() if p.requires_grad]
    assert any("input_layernorm" in n for n in trainable)
    assert any("post_attention_layernorm" in n for n in trainable)


@pytest.mark.parametrize("kwargs, match", [({"r": 0}, "lora.r"), ({"alpha": 0}, "lora.alpha"),
                                           ({"dropout": 1.0}, "lora.dropout"), ({"targets": ()}, "lora.targets")])
def test_settings_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LoraSettings(**kwargs)


def _lora_model_with_nonzero_b(quantized_dirs, **settings):
    torch.manual_seed(0)
    pm = apply_lora(load_policy(quantized_dirs["qwen2"]), LoraSettings(r=8, alpha=16, **settings))
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    return pm


def _spy_seam(monkeypatch):
    import qerl.ops

    calls, real = [], qerl.ops.nvfp4_lora_linear

    def spy(*a, **k):
        calls.append(a[5].shape)
        return real(*a, **k)

    monkeypatch.setattr(qerl.ops, "nvfp4_lora_linear", spy)
    return calls


def test_no_grad_lora_forward_is_one_seam_call_and_equals_peft(quantized_dirs, monkeypatch):
    """Rollouts / evaluation: each NVFP4 LoRA layer is one call of the fused seam (one kernel launch on
    the GPU); on the CPU reference it computes PEFT's own forward op for op, so the logits are equal."""
    pm = _lora_model_with_nonzero_b(quantized_dirs).eval()
    calls = _spy_seam(monkeypatch)
    with torch.no_grad():
        fused = pm(input_ids=X).logits
    assert len(calls) == 7 * pm.config.num_hidden_layers and all(s[0] == 8 for s in calls)
    layer_cls = type(next(m for m in pm.modules() if type(m).__name__ == "LoraNVFP4Linear"))
    monkeypatch.setattr(layer_cls, "_fused_adapter", lambda self, x: None)  # PEFT's forward everywhere
    monkeypatch.setattr(qerl.lora, "_lean_adapter", lambda *a: None)
    with torch.no_grad():
        peft = pm(input_ids=X).logits
    assert len(calls) == 7 * pm.config.num_hidden_layers  # no further seam calls
    assert torch.equal(fused, peft)
    with torch.no_grad():
        assert not torch.equal(peft, load_policy(quantized_dirs["qwen2"])(X).logits)  # the adapter acts


def test_fused_lora_falls_back_to_peft_when_it_would_differ(quantized_dirs, monkeypatch):
    """Training (autograd), dropout in effect, adapters disabled: PEFT's forward, never the fused call."""
    calls = _spy_seam(monkeypatch)
    pm = _lora_model_with_nonzero_b(quantized_dirs)
    pm(input_ids=X, labels=X).loss.backward()  # autograd recording
    with pm.disable_adapter(), torch.no_grad():
        pm(input_ids=X)
    drop = _lora_model_with_nonzero_b(quantized_dirs, dropout=0.1).train()
    with torch.no_grad():
        drop(input_ids=X)
    assert calls == []
    drop.eval()  # dropout off in eval mode: fused again
    with torch.no_grad():
        drop(input_ids=X)
    assert len(calls) == 7 * drop.config.num_hidden_layers


def test_lora_seam_autograd_and_bad_shapes():
    from qerl.ops import nvfp4_lora_linear
    from qerl.ops.linear import reference_lora_forward
    from qerl.quant import nvfp4

    g = torch.Generator().manual_seed(0)
    p, s, gs = nvfp4.quantize(torch.randn(24, 32, generator=g))
    x = torch.randn(3, 32, generator=g, dtype=torch.float32).bfloat16().requires_grad_(True)
    a = torch.randn(4, 32, generator=g).requires_grad_(True)
    b = torch.randn(24, 4, generator=g).requires_grad_(True)
    y = nvfp4_lora_linear(x, p, s, gs, None, a, b, 0.5)
    with torch.no_grad():
        assert torch.equal(y, reference_lora_forward(x, p, s, gs, None, a, b, 0.5))
    y.float().square().sum().backward()
    w = nvfp4.dequantize(p, s, gs, torch.float32)
    dy = 2 * y.detach().float()
    xa = x.detach().float() @ a.detach().T
    assert torch.allclose(b.grad, 0.5 * dy.T @ xa, rtol=1e-4, atol=1e-4)
    assert torch.allclose(a.grad, 0.5 * (dy @ b.detach()).T @ x.detach().float(), rtol=1e-4, atol=1e-4)
    want_dx = dy @ w + 0.5 * (dy @ b.detach()) @ a.detach()
    assert torch.allclose(x.grad.float(), want_dx, rtol=2e-2, atol=2e-2 * want_dx.abs().max().item())
    with pytest.raises(ValueError, match=r"lora_b \(24, 5\)"):
        nvfp4_lora_linear(x, p, s, gs, None, a, torch.zeros(24, 5), 1.0)


def test_fused_layers_bf16_adapter_copies_live_for_one_frozen_block(quantized_dirs, monkeypatch):
    """The bf16 copies of the fp32 adapters (what the GPU kernels read) are reused only inside a
    `frozen_adapters` block (a rollout, a no-grad pass, one update's micro-batches) and made again after an
    in-place change there; outside a block each call casts, so an optimizer that writes raw memory without moving
    the version counters (bitsandbytes' 8-bit AdamW) between two blocks is always seen — with no process-wide
    optimizer hook."""
    import qerl.lora as qlora
    from qerl.lora import frozen_adapters

    monkeypatch.setattr(qlora, "_CAST_DEVICES", {"cuda", "cpu"})  # exercise the cast copies on the CPU
    pm = _lora_model_with_nonzero_b(quantized_dirs).eval()
    layer = next(m for m in pm.modules() if type(m).__name__ == "LoraNVFP4Linear")
    x = torch.randn(2, layer.in_features, dtype=torch.bfloat16)
    with torch.no_grad():
        with frozen_adapters(pm):
            a1, b1, _ = layer._fused_adapter(x)
            with frozen_adapters(pm):  # nested: the outer block's copies
                a2, b2, _ = layer._fused_adapter(x)
            a2b, _, _ = layer._fused_adapter(x)
        assert layer._qerl_casts is None  # dropped with the block
        a_out1, _, _ = layer._fused_adapter(x)
        a_out2, _, _ = layer._fused_adapter(x)
    assert a1.dtype == torch.bfloat16 and a1 is a2 is a2b and b1 is b2  # one copy per block
    assert a_out1 is not a_out2 and torch.equal(a_out1, a1)  # outside a block: a cast per call
    assert torch.equal(a1, layer.lora_A["default"].weight.bfloat16())

    class RawWrites(torch.optim.Optimizer):  # updates through .data: no version bump
        def __init__(self, params):
            super().__init__(params, {})

        def step(self, closure=None):
            for group in self.param_groups:
                for p in group["params"]:
                    p.data.add_(1.0)

    lora_a = layer.lora_A["default"].weight
    version = lora_a._version
    RawWrites([lora_a]).step()
    assert lora_a._version == version
    with torch.no_grad(), frozen_adapters(pm):
        a3, _, _ = layer._fused_adapter(x)
        assert torch.equal(a3, lora_a.bfloat16())
        layer.lora_B["default"].weight.mul_(2)  # in place inside a block: the version counter moves
        _, b4, _ = layer._fused_adapter(x)
    assert torch.equal(b4, layer.lora_B["default"].weight.bfloat16())


def _saved_bytes(fn):
    """Bytes of the tensors autograd saves for the backward while ``fn()`` runs (distinct storages)."""
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(seen.values())


@pytest.mark.parametrize("base", ["bf16", "nvfp4"])
def test_lean_lora_in_bf16_matches_peft_and_saves_no_fp32_activations(base, tiny_dirs, quantized_dirs):
    """Training forward of a bf16 policy: the fp32 adapters are applied in bf16 (lean) — output and gradients
    within bf16 rounding of PEFT's fp32-adapter forward, gradients land on the fp32 masters, and autograd keeps
    fewer bytes (PEFT keeps an fp32 copy of every projection's input)."""
    from peft.tuners.lora.layer import Linear as PeftLoraLinear

    from qerl.lora import LoraSettings, apply_lora
    from qerl.models import load_policy

    src = quantized_dirs["qwen2"] if base == "nvfp4" else tiny_dirs["qwen2"]
    model = apply_lora(load_policy(src, base=base, dtype=torch.bfloat16), LoraSettings(r=8, alpha=16))
    g = torch.Generator().manual_seed(0)
    for n, p in model.named_parameters():
        if "lora_B" in n:
            p.data.copy_(torch.randn(p.shape, generator=g) * 0.1)
    layers = [m for m in model.modules() if isinstance(m, PeftLoraLinear)]
    assert layers and all(m.lora_A["default"].weight.dtype == torch.float32 for m in layers)
    assert all(type(m).__name__ in ("LeanLoraLinear", "LoraNVFP4Linear") for m in layers)
    ids = torch.randint(3, 200, (2, 12), generator=g)

    def run():
        model.zero_grad(set_to_none=True)
        out, saved = _saved_bytes(lambda: model(input_ids=ids).logits.float())
        (out.square().mean()).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        return out.detach(), saved, grads

    lean_out, lean_saved, lean_grads = run()
    if base == "nvfp4":  # each NVFP4 projection is one autograd node (qerl.ops.lora_train)
        seen, todo, names = set(), [model(input_ids=ids).logits.grad_fn], []
        while todo:
            fn = todo.pop()
            if fn is None or fn in seen:
                continue
            seen.add(fn)
            names.append(type(fn).__name__)
            todo.extend(nxt for nxt, _ in fn.next_functions)
        assert names.count("_NVFP4LoraFnBackward") == len(layers), names
    for m in layers:  # PEFT's own forward on the same layers and weights
        m.forward = types.MethodType(PeftLoraLinear.forward, m)
    try:
        peft_out, peft_saved, peft_grads = run()
    finally:
        for m in layers:
            del m.forward
    torch.testing.assert_close(lean_out, peft_out, rtol=0.05, atol=0.05)
    for n, gr in lean_grads.items():
        assert gr.dtype == torch.float32, n
        cos = torch.nn.functional.cosine_similarity(gr.flatten(), peft_grads[n].flatten(), dim=0)
        assert cos > 0.99, (n, float(cos))
    assert lean_saved < 0.8 * peft_saved, (lean_saved, peft_saved)


def test_dense_base_update_is_the_same_training_forward(quantized_dirs, monkeypatch):
    """``dense_update``: inside :func:`qerl.models.nvfp4_linear.dense_base` every NVFP4 LoRA projection of a bf16
    policy multiplies its kept dense weight (the op gets ``dense=``), and the logits and every gradient equal the
    per-call path's bit for bit; after the block the layers hold nothing."""
    import qerl.ops
    from qerl.lora import LoraSettings, apply_lora
    from qerl.models import NVFP4Linear, load_policy
    from qerl.models.nvfp4_linear import dense_base

    model = apply_lora(load_policy(quantized_dirs["qwen2"], base="nvfp4", dtype=torch.bfloat16),
                       LoraSettings(r=8, alpha=16))
    g = torch.Generator().manual_seed(1)
    for n, p in model.named_parameters():
        if "lora_B" in n:
            p.data.copy_(torch.randn(p.shape, generator=g) * 0.1)
    ids = torch.randint(3, 200, (2, 12), generator=g)
    real, denses = qerl.ops.nvfp4_lora_train, []

    def spy(*a, **k):
        denses.append(k.get("dense"))
        return real(*a, **k)

    monkeypatch.setattr(qerl.ops, "nvfp4_lora_train", spy)

    def run():
        model.zero_grad(set_to_none=True)
        out = model(input_ids=ids).logits.float()
        out.square().mean().backward()
        return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}

    per_call = run()
    assert denses and all(d is None for d in denses)
    denses.clear()
    with dense_base(model) as kept:
        dense = run()
    n_layers = sum(isinstance(m, NVFP4Linear) for m in model.modules())
    assert kept > 0 and len(denses) == n_layers and all(d is not None and d.dtype == torch.bfloat16 for d in denses)
    assert torch.equal(dense[0], per_call[0])
    assert all(torch.equal(dense[1][n], per_call[1][n]) for n in per_call[1])
    assert all(m.dense is None for m in model.modules() if isinstance(m, NVFP4Linear))


def test_a_missing_or_cut_adapter_is_one_line_before_peft_reads_it(tiny_dirs, lora_policy, tmp_path):
    """A missing weights file would send the local path to the hub (an HTTP traceback), a cut one a safetensors
    traceback: both are named first, against the adapter's manifest where it has one."""
    import torch

    from qerl.checkpoint import CheckpointError
    from qerl.lora import load_adapter, save_adapter
    from qerl.models import load_policy

    out = save_adapter(lora_policy(tiny_dirs["qwen2"], 0), tmp_path / "adapter")
    assert (out / "qerl_files.json").is_file()
    weights = out / "adapter_model.safetensors"
    data = weights.read_bytes()
    base = load_policy(tiny_dirs["qwen2"], dtype=torch.float32)
    weights.write_bytes(data[:100])
    with pytest.raises(CheckpointError, match="adapter_model.safetensors no longer match what was written"):
        load_adapter(base, out)
    (out / "qerl_files.json").unlink()
    for cut in (data[:100], b""):
        weights.write_bytes(cut)
        with pytest.raises(CheckpointError, match="unreadable .*truncated or empty"):
            load_adapter(base, out)
    weights.unlink()
    with pytest.raises(CheckpointError, match="no adapter_model.safetensors"):
        load_adapter(base, out)
