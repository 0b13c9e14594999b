"""The report's figures read what exists: the AQN schedule plots every run that trained with AQN on (an ablation
arm or a variant, whatever its method is called), and a missing evaluation is a labelled gap, never a bar at 0."""
import json

from qerl.stages.report import accuracy_bars, aqn_runs, figures

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
