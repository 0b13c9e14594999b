"""`qerl bench hf` on CPU: the two TRL steps (bf16 + default generation, NVFP4 + qerl's rollout_func) run to a
CSV / Markdown row each on a tiny model's shapes; the `qerl` variant asks for a GPU by name."""
import csv

import pytest


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


def test_qerl_variant_and_bad_batch_are_named(tiny_dirs, tmp_path, monkeypatch):
    import torch

    from qerl.bench import hf

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        hf.main(["--models", str(tiny_dirs["qwen2"]), "--variants", "qerl", "--output", str(tmp_path)])
    with pytest.raises(SystemExit, match="--batch 6 is not a multiple of --generations 4"):
        hf.main(["--batch", "6", "--generations", "4", "--output", str(tmp_path)])
