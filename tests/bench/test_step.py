"""`qerl bench step`: merging runs of one device, the figure, the random models it builds (no GPU)."""
import csv

import pytest
import torch

from qerl.bench import step as bench_step


def _row(model, method, batch, gen, total, device="GPU X"):
    return {"device": device, "model": model, "method": method, "batch": batch, "prompt_len": 256, "gen_len": gen,
            "status": "ok", "rollout_s": total - 1.0, "logprob_s": 0.25, "update_s": 0.75, "total_s": total,
            "tokens_per_s": 100.0, "peak_gb": 30.0, "checkpointing": False, "micro_batch": 2}


def test_merge_later_rows_win_and_order(tmp_path):
    a, _ = bench_step.write([_row("7B", "qerl", 8, 1024, 7.0), _row("32B", "qerl", 8, 2048, 45.0)],
                            tmp_path / "a", "GPU X")
    b, _ = bench_step.write([_row("7B", "qerl", 8, 1024, 6.5), _row("14B", "lora", 8, 2048, 37.0)],
                            tmp_path / "b", "GPU X")
    assert bench_step.main(["--merge", str(a), str(b), "--output", str(tmp_path / "m")]) == 0
    csv_path, md = tmp_path / "m" / "GPU_X.csv", tmp_path / "m" / "GPU_X.md"
    with open(csv_path, newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["model"], r["method"], r["total_s"]) for r in rows] == [
        ("7B", "qerl", "6.5"), ("14B", "lora", "37.0"), ("32B", "qerl", "45.0")]
    assert "| 7B | qerl | 8 | 256 | 1024 | fixed | 1 | ok | 5.50 | 0.25 | 0.75 | 6.50 |" in md.read_text()
    # merged into --output's file set: a new run alone keeps the rows already there (its own replace theirs)
    c, _ = bench_step.write([_row("7B", "qerl", 8, 1024, 6.0)], tmp_path / "c", "GPU X")
    assert bench_step.main(["--merge", str(c), "--output", str(tmp_path / "m")]) == 0
    with open(csv_path, newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["model"], r["method"], r["total_s"]) for r in rows] == [
        ("7B", "qerl", "6.0"), ("14B", "lora", "37.0"), ("32B", "qerl", "45.0")]


def test_merge_keeps_other_micro_batches_and_engine_cache_apart(tmp_path):
    base = _row("7B", "qerl", 8, 1024, 6.7)
    kept = {**_row("7B", "qerl", 8, 1024, 6.4), "engine_cache": "kept"}
    micro4 = {**_row("7B", "qerl", 8, 1024, 6.3), "micro_batch": 4}
    parked = {**_row("7B", "qerl", 8, 1024, 6.9), "optimizer_states": "parked"}
    a, _ = bench_step.write([base], tmp_path / "a", "GPU X")
    b, _ = bench_step.write([kept, micro4, parked], tmp_path / "b", "GPU X")
    csv_path, md = bench_step.merge([a, b], tmp_path / "m")
    with open(csv_path, newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["total_s"], r["micro_batch"], r["engine_cache"], r["optimizer_states"]) for r in rows] == [
        ("6.7", "2", "released", "gpu"), ("6.9", "2", "released", "parked"), ("6.4", "2", "kept", "gpu"),
        ("6.3", "4", "released", "gpu")]
    assert "| False | 2 | kept | gpu |" in md.read_text() and "| False | 2 | released | parked |" in md.read_text()
    png = csv_path.with_suffix(".png")  # the step-split figure, linked from the Markdown
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"]({png.name})" in md.read_text()
    from qerl.bench.step_plot import _label
    assert [_label(r) for r in (base, kept, micro4, parked)] == [
        "7B qerl b8 × 1024", "7B qerl b8 × 1024 [cache kept]", "7B qerl b8 × 1024 [μ4]",
        "7B qerl b8 × 1024 [states parked]"]
    assert _label({**base, "lengths": "lognormal:median=300,sigma=0.9"}) == "7B qerl b8 × 1024 [lognormal lengths]"


def test_merge_keeps_grpo_shaped_rows_apart_and_shows_the_engine_split(tmp_path):
    """``--grpo-shaped`` rows (``samples_per_prompt`` G) do not replace the distinct-prompt rows of the same
    configuration; files written before the column read as 1 per prompt; the engine's split is in the Markdown."""
    real = "lognormal:median=300,sigma=0.9"
    old = {**_row("7B", "qerl", 64, 1024, 10.0), "lengths": real}
    old_file, _ = bench_step.write([old], tmp_path / "a", "GPU X")
    with open(old_file, newline="") as f:  # a file written before the samples_per_prompt column
        rows = list(csv.DictReader(f))
    with open(old_file, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=[c for c in rows[0] if c != "samples_per_prompt"], extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    assert "samples_per_prompt" not in old_file.read_text()
    new = {**_row("7B", "qerl", 64, 1024, 9.0), "lengths": real, "samples_per_prompt": 16, "prefill_s": 0.03,
           "capture_s": 0.25, "host_s": 0.05}
    b, _ = bench_step.write([new], tmp_path / "b", "GPU X")
    csv_path, md = bench_step.merge([old_file, b], tmp_path / "m")
    with open(csv_path, newline="") as f:
        rows = list(csv.DictReader(f))
    assert sorted((r["total_s"], r["samples_per_prompt"]) for r in rows) == [("10.0", "1"), ("9.0", "16")]
    assert f"| {real}, 16 samples per prompt | 1 | ok |" in md.read_text()
    assert "| 0.03 / 0.25 / 0.05 |" in md.read_text()


def test_merge_refuses_two_devices(tmp_path):
    a, _ = bench_step.write([_row("7B", "qerl", 8, 1024, 7.0)], tmp_path / "a", "GPU X")
    b, _ = bench_step.write([_row("7B", "qerl", 8, 1024, 7.0, device="GPU Y")], tmp_path / "b", "GPU Y")
    with pytest.raises(ValueError, match="different devices"):
        bench_step.merge([a, b], tmp_path / "m")


def test_scaling_table_from_one_and_two_gpu_rows(tmp_path):
    """Both readings: 2 GPUs at batch 16 against 1 GPU at 16 (10.0 / 5.5 = 1.82x, 91%) and at 8 per GPU
    (2 x 6.0 / 5.5 = 2.18x sequences per second); batch 32 on 2 GPUs has only the per-GPU comparison."""
    one, one8 = _row("7B", "qerl", 16, 1024, 10.0), _row("7B", "qerl", 8, 1024, 6.0)
    two = {**_row("7B", "qerl", 16, 1024, 5.5), "nproc": 2, "rank_idle_s": 0.22}
    two32 = {**_row("7B", "qerl", 32, 1024, 10.4), "nproc": 2, "rank_idle_s": 0.0}
    _, md = bench_step.write([one, one8, two, two32], tmp_path, "GPU X")
    text = md.read_text()
    assert "| 7B | qerl | 16 | 256 | 1024 | fixed | 2 | ok |" in text
    assert ("| 7B | qerl | 1024 | fixed | 2 | 16 | 8 | 5.50 | 10.00 s: **1.82×** (91%) | 6.00 s: **2.18×** | "
            "0.22 s (4.0%) |") in text
    assert "| 7B | qerl | 1024 | fixed | 2 | 32 | 16 | 10.40 | — | 10.00 s: **1.92×** | 0.00 s (0.0%) |" in text
    assert bench_step.scaling_lines([one]) == []  # nothing to compare
    # drawn completion lengths are their own configuration: compared only with one GPU at the same lengths
    lens = "lognormal:median=300,sigma=0.9"
    real = [{**r, "lengths": lens} for r in (one, {**two, "total_s": 6.0, "rank_idle_s": 0.9})]
    text = "\n".join(bench_step.scaling_lines([one, one8, two, two32] + real))
    assert (f"| 7B | qerl | 1024 | {lens} | 2 | 16 | 8 | 6.00 | 10.00 s: **1.67×** (83%) | — | 0.90 s (15.0%) |"
            in text)


def test_projected_scaling_from_one_gpu_rows(tmp_path):
    """T₁(B) / T₁(B/2): a rank of a 2-GPU step at batch 16 does the 1-GPU step at batch 8."""
    rows = [_row("7B", "qerl", 16, 1024, 8.0), _row("7B", "qerl", 8, 1024, 6.4), _row("7B", "lora", 16, 1024, 9.0)]
    _, md = bench_step.write(rows, tmp_path, "GPU X")
    text = md.read_text()
    assert "## Projected 2-GPU data-parallel scaling" in text
    # rollout 7.0 / 5.4 s; step 8.0 / 6.4 s = 1.25x, 62% (lora has no batch-8 row: no line)
    assert "| 7B | qerl | 16 | 1024 | 8.00 | 6.40 | 1.30× | 1.25× | 62% |" in text
    assert "| 7B | lora | 16 |" not in text.split("## Projected")[1]


@pytest.mark.parametrize("base", ["bf16", "nvfp4"])
def test_bench_models_build_with_grad_enabled(monkeypatch, base):
    """The benches build one base after another with autograd on (a bf16 build after the QeRL one failed on the
    GPU when `build` lost its no-grad decorator): weights filled in place, parameters still trainable leaves."""
    from qerl.models import random as bench_models

    from qerl.models.shapes import QWEN25, Shape

    monkeypatch.setitem(QWEN25, "7B", Shape(64, 128, 1, 4, 2, 16, 256))
    assert torch.is_grad_enabled()
    lm = bench_models.build("7B", base, device="cpu")
    w = lm.model.layers[0].self_attn.q_proj
    assert (w.weight if base == "bf16" else w.dequantized_weight()).abs().sum() > 0
    assert torch.is_grad_enabled()

