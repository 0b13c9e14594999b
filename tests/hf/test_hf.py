"""qerl in the Hugging Face stack: ``from_pretrained(quantization_config=QerlNVFP4Config())`` (a packed checkpoint
and quantize-on-load, both bit-equal to qerl's own loader / ``qerl quantize``), ``save_pretrained`` writing the
compressed-tensors checkpoint, ``get_peft_model`` with a plain ``LoraConfig`` giving qerl's fused NVFP4 LoRA layer,
and TRL's ``GRPOTrainer`` training two steps with ``qerl.hf.rollout_func`` and ``AQNCallback``."""
from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _same_state(a: dict, b: dict) -> list[str]:
    assert set(a) == set(b), (set(a) ^ set(b))
    return [k for k in a if not torch.equal(_bytes(a[k]), _bytes(b[k]))]


def test_packed_checkpoint_loads_packed_and_equal_to_qerls_loader(quantized_dirs):
    from transformers import AutoModelForCausalLM

    from qerl.hf import QerlNVFP4Config
    from qerl.models import load_policy
    from qerl.models.nvfp4_linear import NVFP4Linear

    for arch, d in quantized_dirs.items():
        model = AutoModelForCausalLM.from_pretrained(d, quantization_config=QerlNVFP4Config())
        layers = [m for m in model.modules() if isinstance(m, NVFP4Linear)]
        assert len(layers) == 7 * model.config.num_hidden_layers, arch
        assert all(not hasattr(m, "weight") for m in layers)  # no dense copy of a quantized weight
        assert model.is_quantized and model.hf_quantizer.is_trainable
        assert not _same_state(model.state_dict(), load_policy(d, base="nvfp4").state_dict()), arch
    dense = model.dequantize()  # transformers' own call: the bf16 model of the same weights
    assert not [m for m in dense.modules() if isinstance(m, NVFP4Linear)] and not dense.is_quantized
    x = torch.randint(3, 250, (2, 9))
    with torch.no_grad():
        assert torch.equal(dense(x).logits, load_policy(d, base="bf16")(x).logits)
    if importlib.util.find_spec("compressed_tensors"):  # without our config: transformers' own loader, untouched
        plain = AutoModelForCausalLM.from_pretrained(d)
        assert type(plain.hf_quantizer).__name__ == "CompressedTensorsHfQuantizer"


def test_quantize_on_load_equals_qerl_quantize_and_saves_the_checkpoint(tiny_dirs, tmp_path):
    from transformers import AutoModelForCausalLM

    from qerl.hf import QerlNVFP4Config
    from qerl.models import load_policy
    from qerl.stages.quantize import quantize_checkpoint

    src = tiny_dirs["qwen2"]
    for rule, keep in (("max6", 0), ("four-over-six", 1)):
        ref_dir = quantize_checkpoint(src, tmp_path / f"ref-{rule}", scale_rule=rule, keep_bf16_last=keep,
                                      progress=False) and tmp_path / f"ref-{rule}"
        model = AutoModelForCausalLM.from_pretrained(
            src, quantization_config=QerlNVFP4Config(scale_rule=rule, keep_bf16_last=keep))
        ref = load_policy(ref_dir, base="nvfp4")
        assert not _same_state(model.state_dict(), ref.state_dict()), rule  # fused global scales included
        saved = tmp_path / f"saved-{rule}"
        model.save_pretrained(saved)
        qc = json.loads((saved / "config.json").read_text())["quantization_config"]
        assert qc == json.loads((ref_dir / "config.json").read_text())["quantization_config"]
        x = torch.randint(3, 250, (2, 9))
        with torch.no_grad():
            assert torch.equal(load_policy(saved, base="nvfp4")(x).logits, model(x).logits)


def test_weight_layout_tiled_relays_at_load_and_saves_the_row_major_checkpoint(tmp_path):
    """``QerlNVFP4Config(weight_layout="tiled")``: every layer with whole tiles keeps its weights in the engine's
    tile-contiguous layout from load on; the model computes what the row-major one does, its state_dict and its
    saved checkpoint are the row-major format. ``auto`` tiles on CUDA only (rows here)."""
    from transformers import AutoModelForCausalLM

    from qerl.hf import QerlNVFP4Config
    from qerl.models.nvfp4_linear import NVFP4Linear
    from qerl.models.tiny import TinySpec, save_tiny_model
    from qerl.stages.quantize import quantize_checkpoint

    src = save_tiny_model(tmp_path / "t", TinySpec(hidden_size=128, intermediate_size=256, seed=2))
    quantize_checkpoint(src, tmp_path / "q", progress=False)
    rows = AutoModelForCausalLM.from_pretrained(tmp_path / "q", quantization_config=QerlNVFP4Config())
    tiled = AutoModelForCausalLM.from_pretrained(tmp_path / "q", quantization_config=QerlNVFP4Config(
        weight_layout="tiled"))
    auto = AutoModelForCausalLM.from_pretrained(tmp_path / "q", quantization_config=QerlNVFP4Config(
        weight_layout="auto"))
    layers = [m for m in tiled.modules() if isinstance(m, NVFP4Linear)]
    assert layers and all(m.tiled for m in layers)
    assert not any(m.tiled for m in auto.modules() if isinstance(m, NVFP4Linear))  # CPU: the checkpoint's layout
    assert not _same_state(tiled.state_dict(), rows.state_dict())
    x = torch.randint(3, 250, (2, 9))
    with torch.no_grad():
        assert torch.equal(tiled(x).logits, rows(x).logits)
    tiled.save_pretrained(tmp_path / "saved")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "saved", quantization_config=QerlNVFP4Config())
    assert not _same_state(again.state_dict(), rows.state_dict())


def test_auto_layout_tiles_cuda_layers_whose_decode_keeps_its_kernel(monkeypatch):
    """``weight_layout="auto"`` (:func:`qerl.hf.quantizer.tiles_on_load`): a CUDA layer is tiled when its one-row
    forward keeps its tuned config on tiles (``qerl_kernels.ops.tiled_keeps(1, N, K, device)``, asked with the
    layer's own shape and device), else it stays row-major; CPU layers and layers without whole tiles never are;
    ``tiled`` tiles every layer with whole tiles, ``rows`` none."""
    from types import SimpleNamespace

    import qerl_kernels.ops as kops
    from qerl.hf.quantizer import tiles_on_load

    asked = []
    monkeypatch.setattr(kops, "tiled_keeps", lambda M, N, K, device: asked.append((M, N, K, device)) or N != 128)

    def layer(n, k, cuda=True, whole=True):
        w = SimpleNamespace(is_cuda=cuda, device=f"cuda:{int(cuda)}" if cuda else "cpu")
        return SimpleNamespace(out_features=n, in_features=k, weight_packed=w, can_tile=lambda: whole)

    assert tiles_on_load(layer(256, 512), "auto") and asked == [(1, 256, 512, "cuda:1")]
    assert not tiles_on_load(layer(128, 512), "auto")  # its decode would leave its tuned kernel
    assert not tiles_on_load(layer(256, 512, cuda=False), "auto") and not tiles_on_load(layer(256, 512, whole=False),
                                                                                         "auto")
    assert len(asked) == 2  # (neither a CPU layer nor one without whole tiles asks)
    assert tiles_on_load(layer(128, 512, cuda=False), "tiled") and not tiles_on_load(layer(128, 512, whole=False),
                                                                                      "tiled")
    assert not tiles_on_load(layer(256, 512), "rows")


def test_bad_config_values_are_named():
    from qerl.hf import QerlNVFP4Config

    with pytest.raises(ValueError, match=r"weight_layout 'blocked', expected one of \['rows', 'tiled', 'auto'\]"):
        QerlNVFP4Config(weight_layout="blocked")

    with pytest.raises(ValueError, match="scale_rule 'max5'"):
        QerlNVFP4Config(scale_rule="max5")
    with pytest.raises(ValueError, match="keep_bf16_last 1.5: a layer count"):
        QerlNVFP4Config(keep_bf16_last=1.5)
    with pytest.raises(ValueError, match="not a valid regular expression"):
        QerlNVFP4Config(ignore=["re:(("])
    # issue 80 S8, S9, S11: the Python API validates like the CLI, naming the parameter
    assert QerlNVFP4Config(ignore="lm_head").ignore == ["lm_head"]  # one name, never its letters
    assert QerlNVFP4Config(targets="Linear").targets == ["Linear"]
    with pytest.raises(TypeError, match="unknown keyword.s. group_size"):
        QerlNVFP4Config(group_size=32)
    for bad in (True, float("nan"), "0.15", -1):
        with pytest.raises(ValueError, match="QerlNVFP4Config: keep_bf16_last"):
            QerlNVFP4Config(keep_bf16_last=bad)
    with pytest.raises(TypeError, match=r"ignore \[1\]: a list of module names"):
        QerlNVFP4Config(ignore=[1])
    # what transformers hands back from a saved checkpoint's quantization_config is still taken
    cfg = QerlNVFP4Config()
    again = QerlNVFP4Config(**{k: v for k, v in cfg.to_dict().items() if k != "ignore"}, ignore=cfg.ignore)
    assert again.to_dict() == cfg.to_dict()


def test_plain_lora_config_gets_the_fused_layer_and_adapters_load_on_bf16(quantized_dirs, tmp_path):
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    from qerl.hf import QerlNVFP4Config
    from qerl.models import load_policy

    d = quantized_dirs["qwen2"]
    model = AutoModelForCausalLM.from_pretrained(d, quantization_config=QerlNVFP4Config(), dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                  init_lora_weights=False))
    wrapped = {type(m).__name__ for n, m in peft_model.named_modules() if n.endswith("_proj")}
    assert wrapped == {"LoraNVFP4Linear"}  # all seven projections of every layer, none left out
    assert "lm_head" not in str(peft_model.peft_config["default"].target_modules)
    with pytest.raises(RuntimeError, match="qerl export-merged"):
        peft_model.merge_and_unload()
    peft_model.save_pretrained(tmp_path / "adapter")
    bf16 = PeftModel.from_pretrained(load_policy(d, base="bf16", dtype=torch.float32), tmp_path / "adapter")
    x = torch.randint(3, 250, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(bf16(x).logits, peft_model(x).logits, rtol=1e-5, atol=1e-5)


def _trl_setup(quantized_dirs, tmp_path, **aqn):
    from datasets import Dataset
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    import qerl.hf
    from qerl.models.tiny import build_tokenizer

    model = AutoModelForCausalLM.from_pretrained(quantized_dirs["qwen2"], dtype=torch.float32,
                                                 quantization_config=qerl.hf.QerlNVFP4Config())
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    dataset = Dataset.from_dict({"prompt": ["1+1=", "2+3=", "4+4=", "5+1="]})

    def reward(completions, **kwargs):  # longer answers pay: any learning signal will do here
        return [len(c) / 10 for c in completions]

    args = GRPOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=8, max_steps=2, learning_rate=1e-2, report_to=[], use_cpu=True,
                      bf16=False, logging_steps=1, save_strategy="no", temperature=1.0, seed=0)
    callback = qerl.hf.AQNCallback(stages=1, **aqn)
    rollouts = []
    base = qerl.hf.rollout_func(seed=3)

    def spy(prompts, trainer):
        out = base(prompts, trainer)
        rollouts.append((list(prompts), out))
        return out

    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=dataset,
                          processing_class=build_tokenizer(), rollout_func=spy, callbacks=[callback])
    return trainer, model, callback, rollouts, base


def test_grpo_trainer_trains_on_qerl_rollouts(quantized_dirs, tmp_path):
    pytest.importorskip("trl")
    from peft import PeftModel

    from qerl.models import load_policy

    trainer, model, callback, rollouts, base = _trl_setup(quantized_dirs, tmp_path)
    before = {k: v.detach().clone() for k, v in model.named_parameters() if v.requires_grad}
    trainer.train()
    changed = [k for k, v in model.named_parameters() if v.requires_grad and not torch.equal(before[k], v)]
    assert len(changed) == len(before) > 0  # every adapter moved
    assert len(rollouts) == 2 and all(len(out["completion_ids"]) == 4 for _, out in rollouts)
    assert callback.history == [(0, 0.0), (1, 0.01)] and callback.rollouts == 2  # stage 0 clean, then σ_start
    assert trainer.state.log_history[1]["aqn/sigma"] == 0.01

    # the engine's log-probs are TRL's own recomputation of the same sequences (no noise: σ = 0)
    callback.sigma = 0.0
    prompts = rollouts[0][0]
    out_seed = base.seed + base.calls
    out = base(prompts, trainer)
    rows = [torch.tensor(p + c) for p, c in zip(out["prompt_ids"], out["completion_ids"])]
    assert len({len(p) for p in out["prompt_ids"]}) == 1 and len({len(c) for c in out["completion_ids"]}) == 1
    ids = torch.stack(rows)
    T = len(out["completion_ids"][0])
    with torch.no_grad():
        logps, _, _ = trainer._get_per_token_logps_and_entropies(model, ids, torch.ones_like(ids), T, batch_size=4)
    torch.testing.assert_close(logps, torch.tensor(out["logprobs"]), rtol=0, atol=1e-5)

    # a rollout reproduces from its seed, and AQN's draw reaches it (σ > 0 moves the sampling policy's log-probs)
    import qerl.hf

    again = qerl.hf.rollout_func(seed=out_seed)(prompts, trainer)
    assert again == out
    callback.sigma = 0.5
    noisy = qerl.hf.rollout_func(seed=out_seed)(prompts, trainer)
    assert noisy["logprobs"] != out["logprobs"]
    assert all(z is None for z in callback.aqn.current().values())  # the draw ends with the rollout
    callback.sigma = 0.0

    # the trained adapter, saved, loads in PEFT on the bf16 base
    model.save_pretrained(tmp_path / "adapter")
    loaded = PeftModel.from_pretrained(load_policy(quantized_dirs["qwen2"], base="bf16", dtype=torch.float32),
                                       tmp_path / "adapter")
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-5)


def test_aqn_on_rollouts_without_qerl_rollouts_is_an_error(quantized_dirs, tmp_path):
    pytest.importorskip("trl")
    trainer, *_ = _trl_setup(quantized_dirs, tmp_path)
    trainer.rollout_func = None  # TRL's own generate: AQN on rollouts would silently do nothing
    with pytest.raises(RuntimeError, match="rollout_func=qerl.hf.rollout_func"):
        trainer.train()


def test_a_7b_model_loads_in_under_6_gb():
    """The module tree QerlNVFP4Config loads a Qwen2.5-7B checkpoint into (built on the meta device): 4.5 bits a
    quantized weight, bf16 embeddings / lm_head / norms, no dense copy of any quantized Linear."""
    from transformers import Qwen2ForCausalLM

    from qerl.hf import QerlNVFP4Config, QerlNVFP4HfQuantizer
    from qerl.models.random import qwen_config

    with torch.device("meta"):
        model = Qwen2ForCausalLM(qwen_config("7B")).to(torch.bfloat16)
    QerlNVFP4HfQuantizer(QerlNVFP4Config(), pre_quantized=True)._process_model_before_weight_loading(
        model, dtype=torch.bfloat16)
    sizes = {k: t.numel() * t.element_size() for k, t in model.state_dict().items()}
    assert not [k for k in sizes if k.endswith("_proj.weight")]
    total = sum(sizes.values())
    assert 5.5e9 < total <= 6e9, total  # 3.7 GB of packed projections + 2.2 GB of bf16 embeddings and lm_head


def test_the_aqn_callback_validates_its_arguments_naming_each():
    """issue 80 item 4: AQNCallback's parameters checked at construction, each named in one line."""
    from qerl.hf import AQNCallback

    for kw, want in ((dict(sigma_start=-1), "sigma_start -1: a finite number > 0"),
                     (dict(sigma_start="0.01"), "sigma_start '0.01'"), (dict(sigma_end=float("nan")), "sigma_end nan"),
                     (dict(stages=2.5), "stages 2.5: a whole number >= 1"), (dict(stages=True), "stages True"),
                     (dict(seed="a"), "seed 'a': a whole number >= 0"), (dict(final_norm="no"), "final_norm 'no'"),
                     (dict(schedule="x"), "aqn.schedule must be one of"), (dict(apply_to="all"), "aqn.apply_to")):
        with pytest.raises(ValueError, match=want):
            AQNCallback(**kw)
    assert AQNCallback(stages=3, seed=1, final_norm=True).settings.stages == 3
