"""LoRA on NVFP4 / bf16 / NF4 bases: gradients, frozen base, PEFT-format round trips, merging."""
import json

import pytest
import torch

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
