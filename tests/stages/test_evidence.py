"""Committed evidence (qerl.stages.evidence): packed from a results tree, merged a batch at a time, byte-stable,
unpacked into what `qerl claims` reads; the committed learning-rate sweep is rebuilt from its evidence alone."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from qerl.stages import evidence

ROOT = Path(__file__).resolve().parents[2]


def _results(root: Path, runs: dict[str, float]) -> Path:
    for run, acc in runs.items():
        t = root / "train" / run
        t.mkdir(parents=True)
        t.joinpath("summary.json").write_text("{}")
        t.joinpath("metrics.jsonl").write_text("".join(json.dumps({"step": i, "reward_mean": acc * i}) + "\n"
                                                       for i in (1, 2, 3)))
        e = root / "eval" / run
        e.mkdir(parents=True)
        e.joinpath("b.json").write_text(json.dumps({"pass@1": acc, "problems": 2, "per_problem": [acc, acc]}))
    return root


CFG = ("configuration: {name}\nmodels: {{m: {{source: tiny}}}}\ndatasets: {{d: {{task: synthetic}}}}\ntrain: {{}}\n"
       "experiments: [{{models: [m], datasets: [d], methods: [lora, qerl], algorithms: [grpo]}}]\n"
       "evaluation: {{benchmarks: [b], local_benchmarks: {{b: {{path: b.jsonl}}}}}}\n")


def test_pack_merges_batches_is_byte_stable_and_unpacks(tmp_path):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(CFG.format(name="unit"))
    a = _results(tmp_path / "a", {"m/lora/grpo/d/seed0": 0.5})
    out = tmp_path / "ev"
    assert evidence.pack(a, cfg, out) == {"runs": 1, "evaluations": 1, "completions": 0}
    first = {p.name: p.read_bytes() for p in out.iterdir()}
    evidence.pack(a, cfg, out)  # the same results again: the same bytes (no timestamps, sorted lines)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == first
    b = _results(tmp_path / "b", {"m/qerl/grpo/d/seed0": 0.25, "m/lora/grpo/d/seed0": 0.75})  # a later batch
    assert evidence.pack(b, cfg, out) == {"runs": 2, "evaluations": 2, "completions": 0}  # lora seed0 replaced
    config = evidence.unpack(out, tmp_path / "r")
    assert config["configuration"] == "unit"
    rows = [json.loads(x) for x in (tmp_path / "r/train/m/lora/grpo/d/seed0/metrics.jsonl").read_text().split("\n")
            if x]
    assert [r["reward_mean"] for r in rows] == [0.75, 1.5, 2.25]
    assert json.loads((tmp_path / "r/eval/m/qerl/grpo/d/seed0/b.json").read_text())["per_problem"] == [0.25, 0.25]
    other = tmp_path / "other.yaml"
    other.write_text(CFG.format(name="another"))
    with pytest.raises(evidence.EvidenceError, match="holds the evidence of configuration 'unit', not 'another'"):
        evidence.pack(b, other, out)
    with pytest.raises(evidence.EvidenceError, match="no config.yaml"):
        evidence.unpack(tmp_path / "a", tmp_path / "r2")
    c = _results(tmp_path / "c", {"m/lora/grpo/d/seed1": 0.5})  # a run cut short: metrics, no summary.json
    (c / "train/m/lora/grpo/d/seed1/summary.json").unlink()
    assert evidence.pack(c, cfg, out) == {"runs": 2, "evaluations": 3, "completions": 0,
                                          "unfinished": ["m/lora/grpo/d/seed1"]}


def test_the_committed_sweep_is_rebuilt_from_its_evidence_alone(tmp_path):
    """`qerl claims --evidence reports/real/evidence/real-lr-sweep --sweep` writes the committed lr_sweep.csv and
    lr_sweep.md byte for byte (bootstrap intervals with a fixed seed), and names the rates real.yaml uses."""
    r = subprocess.run([sys.executable, "-m", "qerl", "claims", "--evidence",
                        str(ROOT / "reports/real/evidence/real-lr-sweep"), "--sweep", "--output", str(tmp_path)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "chosen learning rates: lora 0.0001, qerl 3e-05" in r.stdout
    for name in ("lr_sweep.csv", "lr_sweep.md"):
        assert (tmp_path / name).read_text() == (ROOT / "reports/real" / name).read_text(), name
    assert (tmp_path / "lr_sweep.png").stat().st_size > 10_000  # drawn from lr_sweep.csv, compared above
    import yaml

    real = yaml.safe_load((ROOT / "config/real/real.yaml").read_text())
    assert real["method_overrides"]["lora"]["optim"]["lr"] == 1e-4
    assert real["method_overrides"]["qerl"]["optim"]["lr"] == 3e-5


def test_the_committed_matrix_report_is_rebuilt_from_its_evidence_alone(tmp_path):
    """`qerl claims --evidence reports/real/evidence/real --output DIR` (with the runs timed alone and the step
    tables, as reports/real/README.md gives it) writes the committed runs / accuracy tables, claims.md and
    step_alone.csv byte for byte, and the training-curve figure's data (curves.csv); the runs keep the rate the sweep
    chose for their method and the new-token cap that cuts few completions."""
    import csv

    real = ROOT / "reports/real"
    timed = real / "evidence/timing"  # claim (d): the runs timed alone, as reports/real/README.md's command
    r = subprocess.run([sys.executable, "-m", "qerl", "claims", "--evidence", str(real / "evidence/real"),
                        "--output", str(tmp_path), "--timing",
                        *(f"{m}={timed}/{m}_seed{s}.metrics.jsonl.gz" for m in ("lora", "qerl") for s in range(5)),
                        "--step-table", *(str(ROOT / f"reports/step/{d}.csv") for d in ("NVIDIA_H100_80GB_HBM3",
                                                                                       "NVIDIA_H200"))],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    for name in ("runs.csv", "runs.md", "accuracy.csv", "accuracy.md", "claims.md", "curves.csv", "step_alone.csv"):
        assert (tmp_path / name).read_text() == (real / name).read_text(), name
    assert (tmp_path / "curves.png").stat().st_size > 10_000 and (tmp_path / "accuracy.png").stat().st_size > 10_000
    runs = list(csv.DictReader(open(real / "runs.csv")))
    rates = {"lora": "0.0001", "qerl": "3e-05", "nvfp4_lora": "3e-05", "qlora": "3e-05", "lora_aqn": "0.0001",
             "qerl_2x_lora_lr": "0.0002", "qerl@q05b-awq-fos-tail": "3e-05"}
    assert runs and all(row["lr"] == rates[row["method"]] for row in runs)
    assert all(int(row["steps"]) >= 200 and int(row["problems"]) >= 500 for row in runs)
    assert sorted(float(row["truncated_frac"]) for row in runs)[len(runs) // 2] <= 0.05


def test_the_committed_bases_table_is_rebuilt_from_its_evidence_alone(tmp_path):
    """`qerl claims --evidence reports/real/evidence/real-bases --base-kl ...` (a bases-only config) writes the
    committed bases.csv / bases.md byte for byte, and its chosen base is the one real.yaml trains QeRL on."""
    bases = ROOT / "reports/real/bases"
    r = subprocess.run([sys.executable, "-m", "qerl", "claims", "--evidence",
                        str(ROOT / "reports/real/evidence/real-bases"), "--output", str(tmp_path), "--base-kl",
                        str(bases / "base_kl_NVIDIA_H200.csv")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "chosen base: q05b-awq-fos-tail" in r.stdout
    for name in ("bases.csv", "bases.md"):
        assert (tmp_path / name).read_text() == (bases / name).read_text(), name
    assert (tmp_path / "bases.png").stat().st_size > 10_000  # drawn from bases.csv, compared above
    import yaml

    real = yaml.safe_load((ROOT / "config/real/real.yaml").read_text())
    best = [b for b in real["experiments"] if b["models"] == ["q05b-awq-fos-tail"]]
    assert len(best) == 1 and best[0]["methods"] == ["qerl"] and best[0]["untrained"] == ["nvfp4"]
    assert len(best[0]["seeds"]) >= 4


def test_the_bases_choice_reads_only_the_selection_split(tmp_path):
    """The chosen base is the best on the first benchmark (validation) whatever the reported one says; a tie goes to
    the base listed first; a missing evaluation or a second bf16 base is an error naming it."""
    from qerl.stages.bases import bases_rows
    from qerl.stages.claims import ClaimsError

    config = {"models": {m: {"source": "tiny"} for m in ("ref", "a", "b", "c")},
              "experiments": [], "quantize": {"scale_rule": "max6"},
              "evaluation": {"benchmarks": ["val", "test"],
                             "base_models": {"ref": ["bf16"], "a": ["nvfp4"], "b": ["nvfp4"], "c": ["nvfp4"]}}}
    scores = {"ref": (0.5, 0.5), "a": (0.40, 0.10), "b": (0.45, 0.20), "c": (0.45, 0.49)}
    for model, (val, test) in scores.items():
        base = "bf16" if model == "ref" else "nvfp4"
        for bench, p in (("val", val), ("test", test)):
            f = tmp_path / "eval" / model / base / "untrained/none/seed0" / f"{bench}.json"
            f.parent.mkdir(parents=True, exist_ok=True)
            per = [1.0] * int(100 * p) + [0.0] * (100 - int(100 * p))
            f.write_text(json.dumps({"pass@1": p, "per_problem": per, "problems": 100}))
    rows, info = bases_rows(config, tmp_path)
    assert info["chosen"] == "b" and info["selection"] == "val" and info["reported"] == "test"
    assert [r[0] for r in rows[1:] if r[-1] == "yes"] == ["b"] and rows[2][9] == "-40.00"
    (tmp_path / "eval/c/nvfp4/untrained/none/seed0/test.json").unlink()
    with pytest.raises(ClaimsError, match="bases without a val or test evaluation: c/nvfp4/untrained/none/seed0"):
        bases_rows(config, tmp_path)


def test_the_sweep_choice_its_tie_rule_and_bad_values(tmp_path):
    """The rate with the best validation pass@1 per method; a tie goes to the lower rate; a NaN reward or a missing
    evaluation is an error naming the run, never a ranking."""
    from qerl.stages.claims import ClaimsError
    from qerl.stages.sweep import chosen_rates, sweep_rows

    variants = {f"{m}_{lr}": {"method": m, "overrides": {"optim": {"lr": lr}}}
                for m in ("lora", "qerl") for lr in (1e-5, 1e-4, 3e-4)}
    config = {"models": {"m": {"source": "tiny"}}, "datasets": {"d": {"task": "synthetic"}}, "variants": variants,
              "experiments": [{"models": ["m"], "datasets": ["d"], "methods": list(variants), "algorithms": ["grpo"],
                               "seeds": [0]}], "evaluation": {"benchmarks": ["b"]}, "train": {"optim": {"lr": 1e-3}}}
    acc = {"lora_1e-05": 0.30, "lora_0.0001": 0.40, "lora_0.0003": 0.40, "qerl_1e-05": 0.35, "qerl_0.0001": 0.20,
           "qerl_0.0003": 0.0}
    res = _results(tmp_path / "r", {f"m/{v}/grpo/d/seed0": acc[v] for v in variants})
    rows = sweep_rows(config, res)
    assert chosen_rates(rows) == {"lora": 1e-4, "qerl": 1e-5}  # lora: 1e-4 and 3e-4 tie at 40.0 -> the lower
    assert [r[2] for r in rows[1:4]] == ["1e-05", "0.0001", "0.0003"] and rows[2][-1] == "yes"
    m = res / "train/m/qerl_0.0001/grpo/d/seed0/metrics.jsonl"
    m.write_text(m.read_text().replace('"reward_mean": 0.4}', '"reward_mean": NaN}'))
    with pytest.raises(ClaimsError, match=r"run m/qerl_0.0001/grpo/d/seed0: metrics.jsonl step 2 has reward_mean = nan"):
        sweep_rows(config, res)
    (res / "eval/m/qerl_0.0001/grpo/d/seed0/b.json").unlink()
    with pytest.raises(ClaimsError, match=r"without metrics or a b evaluation: m/qerl_0.0001/grpo/d/seed0"):
        sweep_rows(config, res)


def test_completions_are_packed_with_their_evaluation_and_replaced_as_a_whole(tmp_path):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(CFG.format(name="unit"))
    a = _results(tmp_path / "a", {"m/lora/grpo/d/seed0": 0.5})
    sample = {"problem": 0, "sample": 0, "prompt": "p " * 50, "completion": "so \\boxed{4}", "extracted": "4",
              "gold": "4", "correct": True}
    (a / "eval/m/lora/grpo/d/seed0/b.samples.jsonl").write_text(
        "".join(json.dumps({**sample, "problem": p, "sample": s}) + "\n" for p in (0, 1) for s in (0, 1)))
    out = tmp_path / "ev"
    assert evidence.pack(a, cfg, out)["completions"] == 4
    rows = evidence.read_completions(out)
    assert {r["path"] for r in rows} == {"m/lora/grpo/d/seed0/b.json"} and "prompt" not in rows[0]
    (a / "eval/m/lora/grpo/d/seed0/b.samples.jsonl").write_text(json.dumps(sample) + "\n")  # a rerun: one sample
    assert evidence.pack(a, cfg, out)["completions"] == 1
    (a / "eval/m/lora/grpo/d/seed0/b.samples.jsonl").write_text(json.dumps({"problem": 0}) + "\n")
    with pytest.raises(evidence.EvidenceError, match="line 1 has no sample, completion, extracted, gold, correct"):
        evidence.pack(a, cfg, out)


def test_the_committed_completions_regrade_to_the_committed_scores():
    """The grader can be audited: every committed evaluation's per-problem scores are the mean of its committed
    samples' grades, and a seeded sample of 150 completions graded again by the reward function (math-verify) gets
    the grades they were committed with."""
    import gzip
    import random

    from qerl.rewards.registry import RewardSettings, build_reward

    ev = ROOT / "reports/real/evidence/real-matched-rate"
    rows = evidence.read_completions(ev)
    evals = {e["path"]: e for e in (json.loads(x) for x in gzip.open(ev / "evaluations.jsonl.gz", "rt"))}
    assert rows and {r["path"] for r in rows} == set(evals)
    for path, e in evals.items():
        mine = [r for r in rows if r["path"] == path]
        assert len(mine) == e["problems"] * e["samples_per_problem"], path
        per = [0.0] * e["problems"]
        for r in mine:
            per[r["problem"]] += float(r["correct"]) / e["samples_per_problem"]
        assert all(abs(a - b) < 1e-9 for a, b in zip(per, e["per_problem"])), path
    reward = build_reward(RewardSettings(correctness="math"))
    picked = random.Random(0).sample(rows, 150)
    assert sum(r["correct"] for r in picked) >= 5  # the sample holds right answers, not only wrong ones
    for r in picked:
        assert reward(r["completion"], r["gold"]) == float(r["correct"]), (r["path"], r["problem"], r["sample"])


def test_the_committed_matched_rate_report_is_rebuilt_from_its_evidence(tmp_path):
    """Before its training runs land, the matched-rate configuration's report is its untrained bases on GSM8K and
    the three math benchmarks (no verdict), rebuilt from the evidence byte for byte."""
    real = ROOT / "reports/real"
    r = subprocess.run([sys.executable, "-m", "qerl", "claims", "--evidence",
                        str(real / "evidence/real-matched-rate"), "--output", str(tmp_path)],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "no training run yet" in r.stdout
    for name in ("benchmarks.csv", "benchmarks.md", "claims.md"):
        assert (tmp_path / name).read_text() == (real / "matched_rate" / name).read_text(), name
    text = (tmp_path / "benchmarks.md").read_text()
    assert "| bf16 (untrained) | 1 | 21.4 [18.9, 24.1]" in text and "math500_local" in text and "amc23_local" in text
