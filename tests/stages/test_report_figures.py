"""The report's figures read what exists: the AQN schedule plots every run that trained with AQN on (an ablation
arm or a variant, whatever its method is called), and a missing evaluation is a labelled gap, never a bar at 0."""
import json

from qerl.workflow_config import runs
from qerl.stages.report_figures import accuracy_bars, aqn_runs, arm_rows, figures, planned_files

CONFIG = {
    "configuration": "unit", "models": {"m": {"source": "tiny"}}, "datasets": {"d": {"task": "synthetic"}},
    "variants": {"sigma_hi": {"method": "qerl", "overrides": {"aqn": {"sigma_start": 0.05}}},
                 "lora_aqn": {"method": "lora", "overrides": {"aqn": {"enabled": True}}}},
    "experiments": [{"models": ["m"], "datasets": ["d"], "methods": ["lora", "qerl", "sigma_hi", "lora_aqn"],
                     "algorithms": ["grpo"], "seeds": [0]}],
    "evaluation": {"benchmarks": ["b"], "untrained": ["bf16"]}, "train": {},
}


def _run(results, method, sigma, acc):
    run = results / "train" / f"m/{method}/grpo/d/seed0"
    run.mkdir(parents=True)
    run.joinpath("metrics.jsonl").write_text("".join(
        json.dumps({"step": i, "reward_mean": 0.1 * i, "sigma": sigma if i < 3 else 0.0}) + "\n" for i in (1, 2, 3, 4)))
    if acc is not None:
        ev = results / "eval" / f"m/{method}/grpo/d/seed0"
        ev.mkdir(parents=True)
        ev.joinpath("b.json").write_text(json.dumps({"pass@1": acc, "problems": 2, "per_problem": [acc, acc]}))


def test_aqn_runs_and_missing_evaluations(tmp_path):
    res = tmp_path / "results"
    _run(res, "lora", 0.0, 0.5)
    _run(res, "qerl", 0.01, 0.25)
    _run(res, "sigma_hi", 0.05, None)  # trained, not evaluated
    _run(res, "lora_aqn", 0.01, 0.75)
    assert [r.method for r, _ in aqn_runs(CONFIG, res)] == ["qerl", "sigma_hi", "lora_aqn"]
    labels, values = accuracy_bars(CONFIG, res, ["b"])
    assert values["b"] == [None, 50.0, 25.0, None, 75.0]  # bf16 untrained and sigma_hi: not evaluated
    assert [lab.endswith("(not evaluated)") for lab in labels] == [True, False, False, True, False]
    out = tmp_path / "fig"
    out.mkdir()
    made = {p.name for p in figures(CONFIG, res, out)}
    assert {"aqn_sigma.png", "accuracy.png"} <= made and (out / "aqn_sigma.png").stat().st_size > 5_000


def test_arms_side_by_side_changes_and_intervals_over_seeds(tmp_path):
    """Each arm's row says what it changes against its base method; pass@1 is the mean over the evaluated seeds with
    a 95% Student-t interval (t = 12.706 for 2 seeds), none from one seed, empty when none is evaluated; the report
    writes exactly the files planned_files names (the workflow's declared outputs)."""
    cfg = {**CONFIG, "experiments": [{**CONFIG["experiments"][0], "seeds": [0, 1]}]}
    res = tmp_path / "results"
    for seed, acc in ((0, 0.25), (1, 0.35)):
        for method, a in (("qerl", acc), ("sigma_hi", None), ("lora", 0.5 if seed == 0 else None)):
            run = res / "train" / f"m/{method}/grpo/d/seed{seed}"
            run.mkdir(parents=True)
            run.joinpath("metrics.jsonl").write_text("".join(json.dumps({"step": i, "reward_mean": 0.1 * i + seed})
                                                             + "\n" for i in range(1, 11)))
            if a is not None:
                ev = res / "eval" / f"m/{method}/grpo/d/seed{seed}"
                ev.mkdir(parents=True)
                ev.joinpath("b.json").write_text(json.dumps({"pass@1": a, "problems": 2, "per_problem": [a, a]}))
    rows = {r[0]: r for r in arm_rows(cfg, res, runs(cfg), "b")}
    assert rows["arm"][2] == "changes"
    assert rows["sigma_hi"][1:3] == ["qerl", "aqn.sigma_start 0.05"] and rows["qerl"][2] == "—"
    assert rows["lora_aqn"][2] == "aqn.enabled True" and rows["lora_aqn"][3:5] == ["0", "0"]
    assert rows["qerl"][3:5] == ["2", "2"] and rows["qerl"][6] == "30.00"
    half = 12.706 * (50 ** 0.5) / (2 ** 0.5)  # sd of (25, 35) is sqrt(50)
    assert abs(float(rows["qerl"][7]) - (30 - half)) < 0.01 and abs(float(rows["qerl"][8]) - (30 + half)) < 0.01
    assert rows["lora"][4:] == ["1", "1.500", "50.00", "", ""]  # last-10% reward over both seeds; one evaluated: no interval
    assert rows["sigma_hi"][6:] == ["", "", ""]  # trained, never evaluated: missing, not 0
    from qerl.stages.report import build_report

    out = tmp_path / "report"
    build_report(cfg, res, out)
    planned = {f.name for f in planned_files(cfg)}
    assert {"arms_m_d_grpo.png", "arms_m_d_grpo.csv", "curves_m_d_grpo.png", "aqn_sigma.png", "runs.csv"} <= planned
    assert all((out / n).is_file() for n in planned)
    runs_csv = (out / "runs.csv").read_text().splitlines()
    assert runs_csv[0].startswith("model,method,base method,changes,") and "sigma_hi,qerl,aqn.sigma_start 0.05" in \
        "\n".join(runs_csv)
    # Table 1 over two seeds: each trained cell's mean with its 95% half-width and seed count; one seed: the mean,
    # with the caveat that one seed does not rank methods; the tables also as HTML (snakemake --report shows them)
    from qerl.stages.report import table1, table1_note

    cfg1 = {**cfg, "report": {"table1": {"benchmark": "b", "algorithm": "grpo", "dataset": "d"}}}
    _, t1 = table1(cfg1, res)
    cell = {r[0]: r[1] for r in t1[1:]}
    assert cell["NVFP4 LoRA + AQN (QeRL)"] == f"30.0 ± {half:.1f} (n=2)" and cell["bf16 LoRA"] == "50.0"
    assert "95% Student-t half-width" in table1_note(cfg1)
    one = {**cfg1, "experiments": [{**cfg1["experiments"][0], "seeds": [0]}]}
    assert "Each trained cell is one seed" in table1_note(one) and "not ranked" in table1_note(one)
    assert "<table>" in (out / "runs.html").read_text() and "sigma_hi" in (out / "runs.html").read_text()
