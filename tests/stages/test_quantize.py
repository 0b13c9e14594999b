"""``qerl quantize``: format, fidelity to the source, streaming shards, atomicity, bad input."""
import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from qerl.checkpoint import CheckpointError
from qerl.models.arch import UnsupportedArchitectureError
from qerl.quant import nvfp4
from qerl.quant.format import quantization_config
from qerl.stages import quantize as qstage
from qerl.stages.quantize import quantize_checkpoint

PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _all_tensors(d):
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_checkpoint_format_and_fidelity(arch, tiny_dirs, quantized_dirs):
    src, dst = tiny_dirs[arch], quantized_dirs[arch]
    cfg = json.loads((dst / "config.json").read_text())
    assert cfg["quantization_config"] == quantization_config(["lm_head"])
    assert cfg["model_type"] == arch
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja"):
        assert (dst / f).read_bytes() == (src / f).read_bytes()
    source, out = _all_tensors(src), _all_tensors(dst)
    n_layers = cfg["num_hidden_layers"]
    for i in range(n_layers):
        fused = {}
        for p in PROJ:
            parent = "self_attn" if p in PROJ[:4] else "mlp"
            pre = f"model.layers.{i}.{parent}.{p}"
            w = source[f"{pre}.weight"]
            assert f"{pre}.weight" not in out
            packed, scale, gs = (out[f"{pre}.{s}"] for s in ("weight_packed", "weight_scale", "weight_global_scale"))
            assert packed.dtype == torch.uint8 and packed.shape == (w.shape[0], w.shape[1] // 2)
            assert scale.dtype == torch.float8_e4m3fn and scale.shape == (w.shape[0], w.shape[1] // 16)
            assert gs.dtype == torch.float32 and gs.shape == (1,)
            fused.setdefault("qkv" if p in PROJ[:3] else "gu" if p in PROJ[4:6] else p, []).append((w, gs))
            # bit-exact with quantizing the source tensor under the stored (fused) global scale
            rp, rs, _ = nvfp4.quantize(w, global_scale=gs)
            assert torch.equal(rp, packed) and torch.equal(rs.view(torch.uint8), scale.view(torch.uint8))
            if f"{pre}.bias" in source:
                assert torch.equal(out[f"{pre}.bias"], source[f"{pre}.bias"])
        for key in ("qkv", "gu"):
            ws, gss = zip(*fused[key])
            assert all(torch.equal(g, gss[0]) for g in gss)  # one global scale per fused group
            assert torch.equal(gss[0], nvfp4.fused_global_scale(ws))
    # everything that is not a quantized linear is copied unchanged
    for name, t in source.items():
        if not any(f".{p}." in name for p in PROJ):
            assert torch.equal(out[name], t), name
    report = json.loads((dst / "quantization_report.json").read_text())
    assert report["summary"]["quantized_linears"] == 7 * n_layers
    assert all(0.05 < r["rel_fro_error"] < 0.15 and r["sqnr_db"] > 15 for r in report["layers"].values())


def test_transformers_with_compressed_tensors_reads_it(quantized_dirs):
    pytest.importorskip("compressed_tensors")
    from transformers import AutoModelForCausalLM

    from qerl.models import load_policy

    for arch, d in quantized_dirs.items():
        hf = AutoModelForCausalLM.from_pretrained(d)  # transformers' own compressed-tensors loader
        ours = load_policy(d, base="nvfp4")
        x = torch.randint(3, 250, (2, 9))
        with torch.no_grad():
            assert torch.equal(hf(x).logits, ours(x).logits), arch


def test_rerun_is_up_to_date_and_other_model_is_refused(tiny_dirs, quantized_dirs, tmp_path):
    summary = quantize_checkpoint(tiny_dirs["qwen2"], quantized_dirs["qwen2"], progress=False)
    assert summary["up_to_date"]
    with pytest.raises(CheckpointError, match="different model.*--force"):
        quantize_checkpoint(tiny_dirs["llama"], quantized_dirs["qwen2"], progress=False)
    other = tmp_path / "other"
    other.mkdir()
    (other / "keep.txt").write_text("user data")
    with pytest.raises(CheckpointError, match="--force"):
        quantize_checkpoint(tiny_dirs["qwen2"], other, progress=False)
    from qerl.owned import NotOwned

    with pytest.raises(NotOwned, match="holds keep.txt, which no qerl command wrote there"):  # --force neither
        quantize_checkpoint(tiny_dirs["llama"], other, force=True, progress=False)
    assert (other / "keep.txt").read_text() == "user data" and sorted(p.name for p in other.iterdir()) == ["keep.txt"]
    (other / "keep.txt").unlink()
    quantize_checkpoint(tiny_dirs["llama"], other, force=True, progress=False)
    assert json.loads((other / "config.json").read_text())["model_type"] == "llama"


def test_sharded_output_and_index(tiny_dirs, tmp_path):
    dst = tmp_path / "sharded"
    quantize_checkpoint(tiny_dirs["qwen2"], dst, max_shard_size="40KB", progress=False)
    shards = sorted(dst.glob("model-*.safetensors"))
    assert len(shards) > 1
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {s.name for s in shards}
    for name, shard in index["weight_map"].items():
        with safe_open(dst / shard, "pt") as f:
            assert name in f.keys()
    single = _all_tensors(tmp_path / "sharded")
    assert len(single) == len(index["weight_map"])


def test_crash_midway_leaves_no_checkpoint(tiny_dirs, tmp_path, monkeypatch):
    calls = {"n": 0}
    real = qstage._quantize_unit

    def flaky(*a, **k):
        calls["n"] += 1
        if calls["n"] == 5:
            raise RuntimeError("simulated crash")
        return real(*a, **k)

    monkeypatch.setattr(qstage, "_quantize_unit", flaky)
    dst = tmp_path / "out"
    with pytest.raises(RuntimeError, match="simulated"):
        quantize_checkpoint(tiny_dirs["qwen2"], dst, progress=False)
    assert not dst.exists()
    assert list(tmp_path.iterdir()) == []  # no temporary directory left behind either


def test_bad_sources(tiny_dirs, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(tiny_dirs["qwen2"], bad)
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt2"}))
    with pytest.raises(UnsupportedArchitectureError, match="gpt2.*supported"):
        quantize_checkpoint(bad, tmp_path / "o1", progress=False)
    (bad / "config.json").write_text(json.dumps(cfg))
    shard = bad / "model.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="model.safetensors.*truncated"):
        quantize_checkpoint(bad, tmp_path / "o2", progress=False)
    tensors = load_file(tiny_dirs["qwen2"] / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    from safetensors.torch import save_file

    save_file(tensors, str(shard), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="model.layers.1.mlp.up_proj.weight.*missing"):
        quantize_checkpoint(bad, tmp_path / "o3", progress=False)
    with pytest.raises(CheckpointError, match="no such model directory"):
        quantize_checkpoint(tmp_path / "nope", tmp_path / "o4", progress=False)
    assert not any((tmp_path / f"o{i}").exists() for i in range(1, 5))


def test_hub_id_without_network_says_what_to_do(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(CheckpointError, match="not in this machine's Hugging Face cache and the hub is off "
                                              r"\(HF_HUB_OFFLINE\): run `qerl fetch --configfile"):
        quantize_checkpoint("Qwen/Qwen2.5-7B-Instruct", tmp_path / "o", progress=False)


def test_cli_quantize(tiny_dirs, tmp_path, capsys):
    from qerl.cli import main

    dst = tmp_path / "cli"
    assert main(["quantize", "--model", str(tiny_dirs["llama"]), "--output", str(dst), "--no-progress"]) == 0
    assert json.loads(capsys.readouterr().out.split("per-layer")[0])["quantized_linears"] == 14
    assert main(["quantize", "--model", str(tiny_dirs["qwen2"]), "--output", str(dst), "--no-progress"]) == 2
    assert "--force" in capsys.readouterr().err


def test_four_over_six_checkpoint_reports_the_rule_and_lower_error(tiny_dirs, tmp_path):
    """`--scale-rule four-over-six`: an ordinary NVFP4 checkpoint (our loader reads it), the rule in its report
    and manifest (so switching rules re-quantizes instead of calling the old one up to date), and a lower
    relative error than max6 on (nearly) every layer of the tiny model — the report names any exception."""
    import json

    from qerl.models import load_policy

    out = {r: tmp_path / r for r in ("max6", "four-over-six")}
    for rule, dst in out.items():
        summary = quantize_checkpoint(tiny_dirs["qwen2"], dst, progress=False, scale_rule=rule)
        assert summary["scale_rule"] == rule
    layers = {r: json.loads((d / "quantization_report.json").read_text())["layers"] for r, d in out.items()}
    worse = [n for n in layers["max6"]
             if layers["four-over-six"][n]["rel_fro_error"] > layers["max6"][n]["rel_fro_error"]]
    assert len(worse) <= len(layers["max6"]) // 10, worse
    # the four-over-six report carries max6's error of each layer beside its own, and names where it is worse
    fos = json.loads((out["four-over-six"] / "quantization_report.json").read_text())
    n = next(iter(layers["max6"]))
    assert abs(fos["layers"][n]["max6_rel_fro_error"] - layers["max6"][n]["rel_fro_error"]) < 1e-3
    assert fos["summary"]["layers_worse_than_max6"] == worse
    assert fos["summary"]["sqnr_db_mean"] > fos["summary"]["max6_sqnr_db_mean"]
    load_policy(out["four-over-six"], base="nvfp4", dtype=torch.float32)
    again = quantize_checkpoint(tiny_dirs["qwen2"], out["four-over-six"], progress=False, scale_rule="four-over-six")
    assert again["up_to_date"]
    with pytest.raises(CheckpointError, match="already holds a different model or quantization"):
        quantize_checkpoint(tiny_dirs["qwen2"], out["four-over-six"], progress=False, scale_rule="max6")


def test_last_layers_kept_in_bf16_by_rule(tiny_dirs, tmp_path):
    """`--keep-bf16-last`: the last decoder layers stay bf16, named in the checkpoint's ignore list; our loader
    builds the mixed model from it (NVFP4 below, nn.Linear in the kept layer), the engine's greedy rollout on it
    equals the reference sampler's; bad counts are named."""
    import json

    from transformers import AutoTokenizer

    from qerl.models import load_policy
    from qerl.models.nvfp4_linear import NVFP4Linear
    from qerl.quant.format import last_layers_pattern
    from qerl.rollout import SamplingSettings, generate

    assert last_layers_pattern(28, 0.15) == "re:(.*\\.)?layers\\.(23|24|25|26|27)\\."
    assert last_layers_pattern(28, 0) is None and last_layers_pattern(4, 1) == "re:(.*\\.)?layers\\.(3)\\."
    for bad, msg in ((2.5, "a layer count"), (-1, "a layer count"), (40, "the model has 28 decoder layers")):
        with pytest.raises(ValueError, match=msg):
            last_layers_pattern(28, bad)
    dst = tmp_path / "mixed"
    summary = quantize_checkpoint(tiny_dirs["qwen2"], dst, progress=False, keep_bf16_last=1)
    cfg = json.loads((dst / "config.json").read_text())
    assert cfg["quantization_config"]["ignore"] == ["lm_head", "re:(.*\\.)?layers\\.(1)\\."]
    assert summary["quantized_linears"] == 7  # layer 0's seven projections; layer 1 whole in bf16
    model = load_policy(dst, base="nvfp4", dtype=torch.float32)
    layers = model.model.layers
    assert isinstance(layers[0].self_attn.q_proj, NVFP4Linear) and type(layers[1].mlp.down_proj) is torch.nn.Linear
    tok = AutoTokenizer.from_pretrained(dst)
    outs = [generate(model, tok, ["12+7=", "ab"], SamplingSettings(temperature=0, max_new_tokens=6, engine=e))
            for e in ("engine", "reference")]
    assert outs[0].texts == outs[1].texts
    # the trainer: QeRL (LoRA on both kinds of layer, AQN) trains on the mixed model
    import yaml

    from qerl.cli import main

    cfg = {"method": "qerl", "output_dir": str(tmp_path / "run"), "steps": 2, "prompts_per_step": 2,
           "micro_batch_size": 4, "device": "cpu", "model": {"path": str(dst), "dtype": "float32"},
           "data": {"task": "synthetic"}, "rollout": {"max_new_tokens": 4}, "algorithm": {"group_size": 2},
           "lora": {"r": 4, "alpha": 8}, "reward": {"correctness": "exact"}, "tracking": {"backend": "none"}}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["train", "--config", str(tmp_path / "run.yaml"), "--no-progress"]) == 0
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 2
    # transformers' own compressed-tensors loader reads the same mixed model (its ignore regex as ours)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(dst)
    x = torch.randint(3, 250, (2, 9))
    with torch.no_grad():
        assert torch.equal(hf(x).logits, load_policy(dst, base="nvfp4")(x).logits)
