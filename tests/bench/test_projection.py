"""The cost projection (qerl.bench.projection, `qerl bench cost`, `qerl plan --cost`) against hand-computed values
and the measured rehearsal it is calibrated on."""
import csv
import json
from pathlib import Path

import pytest
import yaml

from qerl.models.shapes import QWEN25
from qerl.bench import projection as cost

ROOT = Path(__file__).resolve().parents[2]


def test_linear_weights_by_hand():
    H, I, L, V = 3584, 18944, 28, 152064  # Qwen2.5 7B: q 3584, k / v 512 each
    per_layer = H * (3584 + 2 * 512) + 3584 * H + 2 * H * I + I * H
    assert cost.linear_weights(QWEN25["7B"]) == L * per_layer + V * H


def test_update_passes():
    s = QWEN25["3B"]
    unit = 2.0 * cost.linear_weights(s) * 1000
    assert cost.update_flops(s, 1000, 4) == unit * (4 * 3 + 1)  # μ = 4: fwd, dX, re-fwd each + the old-log-prob pass
    assert cost.update_flops(s, 1000, 1) == unit * 3  # μ = 1: one pass (old log-probs from the update's forward)
    assert cost.update_flops(s, 1000, 1, checkpointing=False, old_pass=True) == unit * 3
    assert cost.update_flops(s, 1000, 2, full=True, ref_pass=True) == unit * (2 * 4 + 1 + 1)


def test_rollout_closed_form_and_slots():
    a, b = cost.INTERCEPT_SHARE * 10.0, (1 - cost.INTERCEPT_SHARE) * 10.0 / 4
    sec = lambda makespan, total: (a * makespan + b * total) / 1e3  # noqa: E731
    assert cost.rollout_seconds([3, 1, 2], 10.0, 4) == pytest.approx(sec(3, 6))
    assert cost.rollout_seconds([3, 1, 2], 10.0, 4, slots=1) == pytest.approx(sec(6, 6))
    assert cost.rollout_seconds([3, 1, 2], 10.0, 4, slots=2) == pytest.approx(sec(3, 6))  # 2 joins the slot 1 freed
    assert cost.rollout_seconds([4, 4, 4, 4], 10.0, 4) == pytest.approx(4 * 10.0 / 1e3)  # every row active: a + 4 b
    assert cost.rollout_seconds([], 10.0, 4) == 0.0


def test_lpt_makespan():
    assert cost.lpt_makespan([5, 4, 3, 3, 3], 2) == 10  # 5 | 4 -> 5 | 7 -> 8 | 7 -> 8 | 10
    assert cost.lpt_makespan([5, 4, 3], 8) == 5 and cost.lpt_makespan([1, 2], 1) == 3


def test_calibration_reproduces_the_measured_steps():
    for shape, r in cost.REHEARSALS.items():
        assert cost.rollout_seconds([r.cap] * r.rows, r.decode_ms, 128) == pytest.approx(r.rollout_s)
        flops = cost.update_flops(QWEN25[shape], r.rows * cost.PROMPT + r.generated, r.updates)
        assert flops / (r.update_tflops * 1e12) == pytest.approx(r.update_s)
    # and the committed rehearsal report holds these numbers
    rows = {(x["shape"], x["stage"]): x for x in
            csv.DictReader(open(ROOT / "reports" / "reproduce" / "rehearsal_NVIDIA_H100_80GB_HBM3.csv"))}
    for shape, r in cost.REHEARSALS.items():
        train = rows[(shape, "train")]
        assert int(train["generated_tokens"]) == r.generated and f"rollout {r.rollout_s:.1f} s" in train["note"]


def test_benchmark_constants_are_the_committed_measurements():
    """The rollout / step rates the projection takes from the benchmarks are those of the committed H100 reports —
    for the 7B NVFP4 decode steps and the NVFP4 / bf16 rollout ratio, those measured with the GEMM the rehearsals
    ran (v12): the committed reports (later GEMMs) may only be faster, so the projection errs long."""
    rollout = list(csv.DictReader(open(ROOT / "reports" / "rollout" / "NVIDIA_H100_80GB_HBM3.csv")))

    def roll(model, base, batch, field):
        return float(next(r[field] for r in rollout if (r["model"], r["base"], r["engine"], r["batch"], r["lengths"])
                          == (model, base, "qerl", str(batch), "fixed")))

    remeasured = {"7B": (True, True), "14B": (True, False), "32B": (True, False)}  # (batch 64, batch 256)
    for shape, (lo, hi) in cost.BENCH_STEP_MS.items():
        now = (roll(shape, "nvfp4", 64, "ms_per_step"), roll(shape, "nvfp4", 256, "ms_per_step"))
        for v, const, again in zip(now, (lo, hi), remeasured[shape]):
            # re-measured with later code (2026-11-26): faster than the v12 constant; else that very measurement
            assert v < const * 1.01 if again else v == pytest.approx(const, abs=0.01)
    assert cost.BF16_ROLLOUT <= roll("7B", "nvfp4", 128, "tok_s") / roll("7B", "bf16", 128, "tok_s")
    step = list(csv.DictReader(open(ROOT / "reports" / "step" / "NVIDIA_H100_80GB_HBM3.csv")))
    b8 = {r["method"]: float(r["rollout_s"]) for r in step if (r["model"], r["batch"], r["gen_len"], r["lengths"],
          r["micro_batch"], r["engine_cache"]) == ("7B", "8", "1024", "fixed", "2", "released")
          and r["method"] in ("qlora", "qerl")}  # (the QLoRA row's companion: same micro-batch and cache policy)
    # the QeRL row re-measured with later code (2026-11-27, tiled weights: 4.99 -> 4.12 s) may only be faster, so the
    # constant (the two rows of one run) may only understate QLoRA's rollout against it now
    assert b8["qerl"] <= 4.99 * 1.01 and cost.QLORA_ROLLOUT <= b8["qlora"] / b8["qerl"] * 1.05
    assert cost.QLORA_ROLLOUT == pytest.approx(b8["qlora"] / 4.99, rel=0.05)
    assert cost.INTERCEPT_SHARE == pytest.approx(4.23 / 12.33, rel=1e-3)


def test_paper_projection_is_consistent():
    res = cost.paper_projection(yaml.safe_load((ROOT / "config" / "paper.yaml").read_text()))
    t1, t2 = res["tables"]["table1"], res["tables"]["table2"]
    trained = [[x for x in t["runs"] if x["steps"]] for t in (t1, t2)]
    assert [len(r) for r in trained] == [10, 10]
    untrained = [x["run"] for x in t1["runs"] if not x["steps"]]  # bf16 / NVFP4 bases of 3B and 7B on GSM8K
    assert untrained == ["qwen2.5-3b/untrained bf16", "qwen2.5-3b/untrained nvfp4", "qwen2.5-7b/untrained bf16",
                         "qwen2.5-7b/untrained nvfp4"]
    qerl3 = next(x for x in t1["runs"] if x["shape"] == "3B" and x["method"] == "qerl")
    assert qerl3["step_s_cap"] == pytest.approx(285.9, rel=0.02)  # the measured step (519,574 vs 524,288 tokens)
    assert all(x["step_s_assumed"] < x["step_s_cap"] for r in trained for x in r)
    by = {(x["shape"], x["method"]): x for x in t2["runs"]}
    assert by[("32B", "qerl")]["slots"] > 5 * by[("32B", "lora")]["slots"]  # NVFP4's memory: more rows decode at once
    assert by[("32B", "qerl")]["train_h_assumed"] < by[("32B", "lora")]["train_h_assumed"]
    for t in (t1, t2):
        for key in ("cap", "assumed"):
            hours = [x[f"train_h_{key}"] + x[f"eval_h_{key}"] for x in t["runs"]]
            assert t[key]["gpu_hours"] == pytest.approx(sum(hours))
            assert max(hours) / 8 <= t[key]["wall_h_8gpu"] <= sum(hours)


def test_bench_cost_cli_writes_the_report(tmp_path, capsys):
    from qerl.bench import cost as bench_cost

    assert bench_cost.main(["--output", str(tmp_path), "--gpus", "4"]) == 0
    out = json.loads(capsys.readouterr().out.splitlines()[0])
    md = (tmp_path / "cost_NVIDIA_H100_80GB_HBM3.md").read_text()
    assert "| table1 | 14 |" in md and "on 4 GPUs" in md and "lognormal:median=300,sigma=0.9" in md
    rows = list(csv.DictReader(open(tmp_path / "cost_NVIDIA_H100_80GB_HBM3.csv")))
    assert len(rows) == 20 + 4 + 6 and out["tables"]["table1"]["assumed"]["gpu_hours"] > 0  # + untrained bases
    with pytest.raises(SystemExit, match="no such config file"):
        bench_cost.main(["--configfile", str(tmp_path / "nope.yaml")])
    from qerl.workflow_config import ConfigFileError

    empty = tmp_path / "empty.yaml"
    empty.write_text("models: {}\n")  # read by the one strict reader: the schema names what is missing
    with pytest.raises(ConfigFileError, match="empty.yaml: the top level: 'configuration' is a required property"):
        bench_cost.main(["--configfile", str(empty), "--output", str(tmp_path)])
    twice = tmp_path / "twice.yaml"
    twice.write_text("configuration: a\nconfiguration: b\n")
    with pytest.raises(ConfigFileError, match="key 'configuration' is given twice"):
        bench_cost.main(["--configfile", str(twice), "--output", str(tmp_path)])
    default = Path(__file__).resolve().parents[2] / "config/config.yaml"  # tiny models: nothing to project
    with pytest.raises(SystemExit, match="no report.table"):
        bench_cost.main(["--configfile", str(default), "--output", str(tmp_path)])


def test_plan_cost_needs_a_shape_and_a_valid_spec(tmp_path, capsys):
    from qerl.cli import main

    cfg = ROOT / "config" / "train" / "tiny.yaml"
    assert main(["plan", "--config", str(cfg), "--shape", "3B", "--cost", "--set", "steps=10"]) == 0
    text = capsys.readouterr().out
    assert "Projected time on one NVIDIA H100 80GB HBM3 (10 steps" in text and "GPU-hours" in text
    assert main(["plan", "--config", str(cfg), "--shape", "3B", "--cost", "--lengths", "bogus"]) == 2
    assert "unknown distribution 'bogus'" in capsys.readouterr().err
