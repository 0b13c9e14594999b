"""`qerl bench hf` on CPU: the two TRL steps (bf16 + default generation, NVFP4 + qerl's rollout_func) run to a
CSV / Markdown row each on a tiny model's shapes; the `qerl` variant asks for a GPU by name."""
import csv
import json
import os

import pytest


@pytest.fixture(autouse=True)
def _visible_gpus_restored():
    """hf.main narrows CUDA_VISIBLE_DEVICES to one GPU (gpu_claim.keep_one): later tests see the environment as it
    was."""
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    yield
    if before is None:
        os.environ.pop("CUDA_VISIBLE_DEVICES", None)
    else:
        os.environ["CUDA_VISIBLE_DEVICES"] = before


def test_trl_steps_write_rows(tiny_dirs, tmp_path):
    pytest.importorskip("trl")
    from qerl.bench import hf

    out = tmp_path / "hf"
    assert hf.main(["--models", str(tiny_dirs["qwen2"]), "--variants", "trl-bf16", "trl-qerl", "--batch", "4",
                    "--generations", "4", "--prompt-len", "6", "--gen-len", "5", "--output", str(out)]) == 0
    rows = list(csv.DictReader(open(out / "cpu.csv")))
    assert [r["variant"] for r in rows] == ["trl-bf16", "trl-qerl"]
    for r in rows:
        assert r["status"] == "ok" and float(r["step_s"]) > 0 and r["device"] == "cpu"
        assert float(r["mean_completion"]) == 5.0  # every sequence sampled exactly gen_len tokens
    md = (out / "cpu.md").read_text()
    assert "| trl-qerl | 4 | 6 | 5 |" in md and "vs trl-bf16" in md


def test_trl_qerl_step_on_tiled_weights(tiny_dirs, tmp_path):
    """``--weight-layout tiled``: the trl-qerl step's NVFP4 layers with whole tiles are re-laid as ``from_pretrained``
    re-lays them (here on the CPU, which computes on row-major copies), and the row says how many."""
    pytest.importorskip("trl")
    from qerl.bench import hf
    from qerl_kernels.layout import tileable

    out = tmp_path / "hf"
    assert hf.main(["--models", str(tiny_dirs["qwen2"]), "--variants", "trl-qerl", "--batch", "4", "--generations",
                    "4", "--prompt-len", "6", "--gen-len", "5", "--output", str(out), "--weight-layout", "tiled"]) == 0
    (row,) = list(csv.DictReader(open(out / "cpu.csv")))
    spec = json.loads((tiny_dirs["qwen2"] / "config.json").read_text())
    h, i = spec["hidden_size"], spec["intermediate_size"]
    kv = spec["num_key_value_heads"] * h // spec["num_attention_heads"]
    shapes = [(h, h), (kv, h), (kv, h), (h, h), (i, h), (i, h), (h, i)]  # q, k, v, o, gate, up, down: [N, K]
    n = spec["num_hidden_layers"]
    want = f"{n * sum(tileable(*s) for s in shapes)} of {n * len(shapes)}"
    assert row["status"] == "ok" and row["weight_layout"] == "tiled" and row["tiled_layers"] == want
    assert f'`weight_layout="tiled"`, {want} re-laid tiled' in (out / "cpu.md").read_text()


def test_qerl_variant_and_bad_batch_are_named(tiny_dirs, tmp_path, monkeypatch):
    import torch

    from qerl.bench import hf

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        hf.main(["--models", str(tiny_dirs["qwen2"]), "--variants", "qerl", "--output", str(tmp_path)])
    with pytest.raises(SystemExit, match="--batch 6 is not a multiple of --generations 4"):
        hf.main(["--batch", "6", "--generations", "4", "--output", str(tmp_path)])


def test_one_visible_gpu_unless_torchrun(monkeypatch):
    """Several visible GPUs make TRL's Trainer use nn.DataParallel, which GRPOTrainer refuses: the bench keeps the
    first (qerl.gpu_claim.keep_one, before CUDA starts), and leaves torchrun's processes and an explicit single
    choice alone."""
    from qerl.gpu_claim import keep_one

    monkeypatch.setattr("qerl.workflow_config.visible_gpus", lambda: 2)  # two device nodes, no variable
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert keep_one() == "0" and os.environ["CUDA_VISIBLE_DEVICES"] == "0"
    monkeypatch.undo()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3, 1")
    assert keep_one() == "3" and os.environ["CUDA_VISIBLE_DEVICES"] == "3"
    for kept in ({"CUDA_VISIBLE_DEVICES": "2"}, {"CUDA_VISIBLE_DEVICES": ""},
                 {"WORLD_SIZE": "2", "CUDA_VISIBLE_DEVICES": "0,1"}):
        monkeypatch.delenv("WORLD_SIZE", raising=False)
        for k, v in kept.items():
            monkeypatch.setenv(k, v)
        assert keep_one() is None and os.environ["CUDA_VISIBLE_DEVICES"] == kept["CUDA_VISIBLE_DEVICES"]
