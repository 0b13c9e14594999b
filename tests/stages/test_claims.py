"""`qerl claims`: methods side by side against the paper's claims, from a results tree written here (hand-made
metrics and evaluations with known answers)."""
import csv
import json
import random
import subprocess
import sys
import zlib

import pytest

CONFIG = {
    "configuration": "unit", "models": {"m": {"source": "tiny"}}, "datasets": {"d": {"task": "synthetic"}},
    "variants": {"lora_aqn": {"method": "lora", "overrides": {"aqn": {"enabled": True}}}},
    "experiments": [{"models": ["m"], "datasets": ["d"], "methods": ["lora", "nvfp4_lora", "qerl", "lora_aqn"],
                     "algorithms": ["grpo"], "seeds": [0, 1]}],
    "evaluation": {"benchmarks": ["b"], "local_benchmarks": {"b": {"path": "b.jsonl"}}}, "resources": {"jobs_per_gpu": 2},
    "train": {"optim": {"lr": 1.0e-4}}, "method_overrides": {"qerl": {"optim": {"lr": 3.0e-5}}},
}


def _write(results, method, seed, acc, reward_slope, entropy, step_s, sigma_on, model="m"):
    rng = random.Random(zlib.crc32(f"{'' if model == 'm' else model}{method}{seed}".encode()))
    run = results / "train" / f"{model}/{method}/grpo/d/seed{seed}"
    run.mkdir(parents=True)
    lines = []
    for i in range(50):
        lines.append(json.dumps({"step": i + 1, "reward_mean": 0.1 + reward_slope * i + rng.uniform(-0.01, 0.01),
                                 "accuracy": 0.1, "entropy": entropy + rng.uniform(-0.005, 0.005),
                                 "response_len_mean": 100, "mismatch_kl": 1e-4, "truncated_frac": 0.02 * (i % 2), "sigma": 0.01 if sigma_on and i >= 5
                                 else 0.0, "rollout_seconds": step_s * 0.7 if i else 20.0,
                                 "train_seconds": step_s * 0.3,
                                 "skipped_updates": int(method == "qerl" and seed == 1 and i == 6)}))
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    (run / "summary.json").write_text(json.dumps({"steps": 50}))  # a finished run
    ev = results / "eval" / f"{model}/{method}/grpo/d/seed{seed}"
    ev.mkdir(parents=True)
    per = [1.0 if rng.random() < acc else 0.0 for _ in range(300)]
    (ev / "b.json").write_text(json.dumps({"pass@1": sum(per) / 300, "problems": 300, "samples_per_problem": 1,
                                           "per_problem": per, "seconds": 36.0, "device": "Test GPU",
                                           "adapter_sha256": f"{method}{seed}"}))


@pytest.fixture
def results(tmp_path):
    res = tmp_path / "results"
    for seed in (0, 1):
        _write(res, "lora", seed, 0.40, 0.004, 0.30, 2.0, False)
        _write(res, "lora_aqn", seed, 0.40, 0.004, 0.30, 2.0, True)
        _write(res, "nvfp4_lora", seed, 0.30, 0.002, 0.30, 2.2, False)
        _write(res, "qerl", seed, 0.30, 0.002, 0.40, 2.2, True)
    for base, acc in (("bf16", 0.3), ("nvfp4", 0.25)):
        d = res / "eval" / f"m/{base}/untrained/none/seed0"
        d.mkdir(parents=True)
        (d / "b.json").write_text(json.dumps({"pass@1": acc, "problems": 300, "per_problem": [acc] * 300}))
    return res


def test_report_tables_intervals_and_verdicts(results, tmp_path):
    from qerl.stages.claims import build

    out = tmp_path / "rep"
    got = build(CONFIG, results, out)
    assert got["runs"] == 8
    verdicts = {c["claim"].split()[0]: c["verdict"] for c in got["claims"]}
    # QeRL ~10 points below bf16 LoRA on 300 problems x 2 seeds: falls short of the -2 margin, refuted; slower reward
    # growth: refuted; NVFP4 vs bf16 entropy equal (c1): inconclusive; AQN raises it on NVFP4 (0.40 vs 0.30) but not on
    # bf16 (c2): inconclusive; the runs shared GPUs and no --timing: not judged
    assert verdicts == {"(a)": "refuted", "(b)": "refuted", "(c1)": "inconclusive", "(c2)": "inconclusive",
                        "(d)": "not judged"}
    b_text = next(c["numbers"] for c in got["claims"] if c["claim"].startswith("(b)"))
    assert "(seeds resampled)" in b_text and "steps resampled" not in b_text
    # NVFP4 LoRA and bf16 LoRA train at one rate here (1e-4): (c1) is judged at that matched rate, step 1 beside it
    c1_text = next(c["numbers"] for c in got["claims"] if c["claim"].startswith("(c1)"))
    assert c1_text.startswith("at a matched rate (unit): NVFP4 LoRA vs bf16 LoRA (both at 0.0001)") and \
        "at step 1 (before any update)" in c1_text
    a_text = next(c["numbers"] for c in got["claims"] if c["claim"].startswith("(a)"))
    assert "falls short (margin -2)" in a_text and "gain over its own untrained base (paired by problem)" in a_text
    c_text = next(c["numbers"] for c in got["claims"] if c["claim"].startswith("(c2)"))
    assert "QeRL) vs NVFP4 LoRA (at 3e-05 vs 0.0001): entropy (trainer) early in training 0.4012 vs 0.2997" in \
        c_text and "bf16 LoRA + AQN vs" in c_text
    assert "NVFP4 LoRA vs bf16 LoRA" in next(c["numbers"] for c in got["claims"] if c["claim"].startswith("(c1)"))
    assert "**Decision rule.**" in (out / "claims.md").read_text()
    rows = list(csv.DictReader(open(out / "accuracy.csv")))
    by = {r["method"]: r for r in rows}
    for method in by:
        per = [json.loads((results / "eval" / f"m/{method}/grpo/d/seed{s}/b.json").read_text())["per_problem"]
               for s in (0, 1)]
        mean = 100 * sum(map(sum, per)) / 600
        r = by[method]
        assert abs(float(r["pass1_mean"]) - mean) < 0.006 and float(r["ci95_low"]) < mean < float(r["ci95_high"])
    assert float(by["qerl"]["diff_ci95_high"]) < 0 and by["qerl"]["base_pass1"] == "25.00"
    runs = list(csv.DictReader(open(out / "runs.csv")))
    assert len(runs) == 8 and {r["device"] for r in runs} == {"Test GPU"}
    r0 = next(r for r in runs if r["method"] == "lora" and r["seed"] == "0")
    assert r0["pass1_before"] == "30.00" and r0["adapter_sha256"] == "lora0" and r0["steps"] == "50"
    assert r0["median_step_s"] == "2.000"  # the first step (compilation) left out
    # each run's rate from its resolved training config (a method's override, a variant inheriting its method's) and
    # the share of its training completions cut at the token cap
    assert {(r["method"], r["lr"]) for r in runs} == {("lora", "0.0001"), ("lora_aqn", "0.0001"),
                                                      ("nvfp4_lora", "0.0001"), ("qerl", "3e-05")}
    assert {r["truncated_frac"] for r in runs} == {"0.0100"}
    assert [(r["method"], r["seed"]) for r in runs if r["skipped_updates"] != "0"] == [("qerl", "1")]
    assert next(r for r in runs if r["skipped_updates"] != "0")["skipped_updates"] == "1"
    assert "cut at the new-token cap: median 0.0100 over runs" in (out / "claims.md").read_text()
    assert abs(float(r0["gpu_hours"]) - (20.0 + 0.6 + 49 * 2.0 + 36.0) / 3600) < 1e-4
    assert (out / "curves.png").stat().st_size > 10_000 and "| (a) QeRL" in (out / "claims.md").read_text()
    assert (out / "accuracy.png").stat().st_size > 10_000  # pass@1 per arm, drawn from accuracy.csv and runs.csv
    assert "![pass@1 per arm](accuracy.png)" in (out / "claims.md").read_text()
    first = (out / "accuracy.csv").read_bytes()
    build(CONFIG, results, out)
    assert (out / "accuracy.csv").read_bytes() == first  # seeded bootstrap: a rerun writes the same numbers
    for f in results.glob("train/**/metrics.jsonl"):  # runs that logged the rollout policy's entropy: judged on it
        rows = [json.loads(x) for x in f.read_text().splitlines()]
        f.write_text("".join(json.dumps({**r, "rollout_entropy": r["entropy"] + 0.1}) + "\n" for r in rows))
    c2 = next(c for c in build(CONFIG, results, out)["claims"] if c["claim"].startswith("(c2)"))
    assert "rollout-policy entropy early in training 0.5012 vs 0.3997" in c2["numbers"]


@pytest.mark.parametrize("lo, hi, want", [(0.001, 0.05, "exceeds"), (-0.019, 0.01, "matches"),
                                           (-0.019, -0.001, "matches"), (-0.05, -0.021, "falls short"),
                                           (-0.03, 0.01, "inconclusive"), (-0.03, -0.01, "inconclusive")])
def test_the_accuracy_decision_rule_is_judged_on_the_interval(lo, hi, want):
    """'matches' = non-inferior within -2 points on the interval's lower end; a point estimate >= 0 with an interval
    spanning the margin is inconclusive (the round-1 rule marked it confirmed)."""
    from qerl.stages.claims import accuracy_verdict

    assert accuracy_verdict(lo, hi) == want


def test_a_matching_method_is_confirmed_and_a_nan_is_an_error_naming_the_run(tmp_path):
    from qerl.stages.claims import ClaimsError, build

    res = tmp_path / "results"
    for seed in (0, 1):
        for method in ("lora", "lora_aqn", "nvfp4_lora", "qerl"):
            _write(res, method, seed, 0.40, 0.004, 0.30, 2.0, method in ("qerl", "lora_aqn"))
    for base in ("bf16", "nvfp4"):
        d = res / "eval" / f"m/{base}/untrained/none/seed0"
        d.mkdir(parents=True)
        (d / "b.json").write_text(json.dumps({"pass@1": 0.3, "problems": 300, "per_problem": [0.3] * 300}))
    for seed in (0, 1):  # QeRL solves exactly bf16 LoRA's problems: difference 0, interval [0, 0] -> matches
        src = res / f"eval/m/lora/grpo/d/seed{seed}/b.json"
        (res / f"eval/m/qerl/grpo/d/seed{seed}/b.json").write_text(src.read_text())
    a = next(c for c in build(CONFIG, res, tmp_path / "rep")["claims"] if c["claim"].startswith("(a)"))
    assert a["verdict"] == "confirmed" and "+0.0 points [+0.0, +0.0] (problems x seeds): matches" in a["numbers"]
    metrics = res / "train/m/qerl/grpo/d/seed1/metrics.jsonl"
    rows = [json.loads(x) for x in metrics.read_text().splitlines()]
    rows[7]["reward_mean"] = float("nan")
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ClaimsError, match=r"run m/qerl/grpo/d/seed1: metrics.jsonl step 8 has reward_mean = nan"):
        build(CONFIG, res, tmp_path / "rep2")
    ev = res / "eval/m/lora/grpo/d/seed0/b.json"
    ev.write_text(json.dumps({**json.loads(ev.read_text()), "pass@1": "high"}))
    rows[7]["reward_mean"] = 0.2
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    from qerl.readers import InputFileError

    with pytest.raises(InputFileError, match=r"m/lora/grpo/d/seed0/b.json: pass@1: expected a finite number, got "
                                             "'high'"):
        build(CONFIG, res, tmp_path / "rep3")


def _timed(alone, method, k, s):
    (alone / f"{method}{k}").mkdir(parents=True)
    f = alone / f"{method}{k}" / "metrics.jsonl"
    f.write_text("".join(json.dumps({"step": i, "rollout_seconds": s * 0.7, "train_seconds": s * 0.3, "sigma": 0})
                         + "\n" for i in range(1, 11)))
    return f


def test_timing_from_runs_alone_decides_the_step_claim(results, tmp_path):
    """Claim (d) is judged on >= 5 timed runs a method: the ratio of the geometric means of the run medians with a
    Welch t-interval on the logs. Fewer runs: not judged, with the count. step_alone.csv gives the same runs back."""
    from qerl.stages.claims import ClaimsError, build, read_timing

    alone = tmp_path / "alone"
    jit = (0.0, 0.05, -0.05, 0.02, -0.02)
    files = {m: [_timed(alone, m, k, s + j) for k, j in enumerate(jit)] for m, s in (("lora", 2.0), ("qerl", 1.5))}
    for n in (1, 3):
        got = build(CONFIG, results, tmp_path / f"rep{n}",
                    timing=read_timing([f"{m}={f}" for m in files for f in files[m][:n]]))
        d = next(c for c in got["claims"] if c["claim"].startswith("(d)"))
        assert d["verdict"] == "not judged" and f"{n} QeRL and {n} bf16 LoRA run(s), the rule needs >= 5" in \
            d["numbers"]
    five = read_timing([f"{m}={f}" for m in files for f in files[m]])
    assert [len(five[m]) for m in ("lora", "qerl")] == [5, 5]
    got = build(CONFIG, results, tmp_path / "rep5", timing=five)
    d = next(c for c in got["claims"] if c["claim"].startswith("(d)"))
    lo, hi = (float(x) for x in d["numbers"].split("95% interval [")[1].split("]")[0].split(", "))
    assert d["verdict"] == "confirmed" and "1.33x (geometric means)" in d["numbers"] and 1.05 < lo < 1.33 < hi < 1.45
    assert "Welch t on log run medians" in d["numbers"] and "alone" in d["numbers"]
    again = read_timing([f"{m}={tmp_path / 'rep5' / 'step_alone.csv'}" for m in ("lora", "qerl")])
    assert [[r["rollout_seconds"] for r in run] for run in again["qerl"]] == \
        [[r["rollout_seconds"] for r in run] for run in five["qerl"]]
    for bad, want in (("qerl", "expected METHOD=FILE"), (f"qerl={tmp_path / 'none.jsonl'}", "not found"),
                      (f"qerl={files['qerl'][0]} qerl={files['qerl'][0]}", "given twice")):
        with pytest.raises(ClaimsError, match=want):
            read_timing(bad.split())


def test_the_step_rule_claims_md_writes_is_the_one_applied(results, tmp_path):
    """A case where "a ratio beyond 5% in every seed pair" (the rule once written) and the interval disagree: every
    pair is 1.06x-1.60x faster, but 5 noisy runs a method put the interval's lower end below 1.05 -- inconclusive, as
    claims.md's rule says."""
    from qerl.stages.claims import RULE, build, read_timing

    alone = tmp_path / "alone"
    lora = [3.2, 2.0, 3.6, 2.1, 3.0]
    qerl = [2.0, 1.88, 2.4, 1.95, 2.5]
    assert all(a / b > 1.05 for a, b in zip(lora, qerl))
    specs = [f"lora={_timed(alone, 'lora', k, s)}" for k, s in enumerate(lora)]
    specs += [f"qerl={_timed(alone, 'qerl', k, s)}" for k, s in enumerate(qerl)]
    got = build(CONFIG, results, tmp_path / "rep", timing=read_timing(specs))
    d = next(c for c in got["claims"] if c["claim"].startswith("(d)"))
    lo = float(d["numbers"].split("95% interval [")[1].split(",")[0])
    assert lo < 1.05 and d["verdict"] == "inconclusive"
    assert "Welch t-interval on the logs" in RULE and "at least 5 runs a method" in RULE
    assert "every seed pair" not in RULE
    assert RULE in (tmp_path / "rep" / "claims.md").read_text()


def test_missing_results_are_named(results, tmp_path):
    import shutil

    from qerl.stages.claims import ClaimsError, build

    shutil.rmtree(results / "eval" / "m/lora_aqn")
    got = build(CONFIG, results, tmp_path / "rep")
    assert got["runs"] == 6 and "m/lora_aqn/grpo/d/seed0" in (tmp_path / "rep" / "claims.md").read_text()
    with pytest.raises(ClaimsError, match="no finished run has both metrics.jsonl and a b evaluation"):
        build(CONFIG, tmp_path / "empty", tmp_path / "rep2")


def test_cli(results, tmp_path):
    import yaml

    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump(CONFIG))
    r = subprocess.run([sys.executable, "-m", "qerl", "claims", "--workflow-config", str(cfg), "--results",
                        str(results), "--output", str(tmp_path / "rep")], capture_output=True, text=True)
    assert r.returncode == 0 and "refuted  (a) QeRL reaches at least bf16 LoRA's accuracy" in r.stdout
    r = subprocess.run([sys.executable, "-m", "qerl", "claims", "--workflow-config", str(cfg), "--results",
                        str(tmp_path / "nothing"), "--output", str(tmp_path / "rep3")], capture_output=True, text=True)
    assert r.returncode == 2 and "no finished run has both" in r.stderr and "Traceback" not in r.stderr


def test_the_step_claim_at_7b_to_32b_reads_the_step_tables(tmp_path):
    """(d2): bf16 LoRA / QeRL step time per setting of `qerl bench step` tables; every ratio above 1.05 confirms,
    one setting below 0.95 makes it inconclusive; a missing table is an error naming it."""
    from qerl.stages.claims import ClaimsError, step_table_claim

    head = "device,model,method,batch,prompt_len,gen_len,lengths,nproc,status,total_s\n"
    rows = ["G,7B,lora,8,256,1024,fixed,1,ok,9.0", "G,7B,qerl,8,256,1024,fixed,1,ok,6.0",
            "G,32B,lora,16,256,1024,fixed,1,ok,30.0", "G,32B,qerl,16,256,1024,fixed,1,ok,24.0",
            "G,7B,full,8,256,1024,fixed,1,ok,20.0", "G,0.5B,qerl,8,256,1024,fixed,1,ok,1.0"]
    t = tmp_path / "G.csv"
    t.write_text(head + "\n".join(rows) + "\n")
    c = step_table_claim([t])
    assert c["verdict"] == "confirmed" and "7B batch 8 (256 + 1024 tokens, fixed): 9.0 / 6.0 s = 1.50x" in c["numbers"]
    assert "32B batch 16" in c["numbers"] and "in 2 of 2 settings" in c["numbers"]
    t.write_text(head + "\n".join(rows + ["G,14B,lora,64,256,1024,fixed,1,ok,20.0",
                                          "G,14B,qerl,64,256,1024,fixed,1,ok,25.0"]) + "\n")
    c = step_table_claim([t])
    assert c["verdict"] == "inconclusive" and "slower (< 0.95x) in 1" in c["numbers"]
    with pytest.raises(ClaimsError, match="--step-table .*none.csv: not found"):
        step_table_claim([tmp_path / "none.csv"])


def test_every_qerl_arm_is_judged_against_lora_also_on_another_base(results, tmp_path):
    """A QeRL variant (the paper's recipe at another rate) and QeRL trained on another model's NVFP4 base (block
    ``untrained: [nvfp4]``) are arms of their own: a row in runs/accuracy and an "(a) also" claim each, against
    their own base's score."""
    from qerl.stages.claims import build, label
    from qerl.workflow_config import eval_targets

    cfg = json.loads(json.dumps(CONFIG))
    cfg["models"]["m-best"] = {"source": "tiny"}
    cfg["variants"]["qerl_2x"] = {"method": "qerl", "overrides": {"optim": {"lr": 2e-4}}}
    cfg["experiments"][0]["methods"].append("qerl_2x")
    cfg["experiments"].append({"models": ["m-best"], "datasets": ["d"], "methods": ["qerl"], "algorithms": ["grpo"],
                               "seeds": [0, 1], "untrained": ["nvfp4"]})
    targets = eval_targets(cfg)
    assert "results/eval/m-best/nvfp4/untrained/none/seed0/b.json" in targets
    assert "results/eval/m-best/bf16/untrained/none/seed0/b.json" not in targets
    for seed in (0, 1):
        _write(results, "qerl_2x", seed, 0.05, 0.0, 0.30, 2.2, True)
        _write(results, "qerl", seed, 0.40, 0.002, 0.40, 2.2, True, model="m-best")
    d = results / "eval" / "m-best/nvfp4/untrained/none/seed0"
    d.mkdir(parents=True)
    (d / "b.json").write_text(json.dumps({"pass@1": 0.28, "problems": 300, "per_problem": [0.28] * 300}))
    found = build(cfg, results, tmp_path / "rep")["claims"]
    a = [c for c in found if c["claim"].startswith("(a)")]
    assert [c["claim"] for c in a] == ["(a) QeRL reaches at least bf16 LoRA's accuracy",
                                       "(a) also: qerl_2x (NVFP4 LoRA + AQN (QeRL) variant) against bf16 LoRA",
                                       "(a) also: NVFP4 LoRA + AQN (QeRL) (the m-best base) against bf16 LoRA"]
    assert a[1]["verdict"] == "refuted" and "falls short" in a[1]["numbers"]
    assert a[2]["verdict"] != "refuted" and "(NVFP4 base 28.0)" in a[2]["numbers"]
    with open(tmp_path / "rep/accuracy.csv") as f:
        rows = {r["method"]: r for r in csv.DictReader(f)}
    assert rows["qerl@m-best"]["label"] == label(cfg, "qerl@m-best") == "NVFP4 LoRA + AQN (QeRL) (the m-best base)"
    assert rows["qerl@m-best"]["base_pass1"] == "28.00" and rows["qerl@m-best"]["seeds"] == "2"
    with open(tmp_path / "rep/runs.csv") as f:
        runs_ = [r for r in csv.DictReader(f) if r["method"] == "qerl@m-best"]
    assert [r["model"] for r in runs_] == ["m-best", "m-best"]
    cfg["variants"]["qerl_2x"]["label"] = "QeRL at 2x LoRA's rate"  # a variant's own label wins
    assert label(cfg, "qerl_2x") == "QeRL at 2x LoRA's rate"
    assert label(cfg, "qerl_2x@m-best") == "QeRL at 2x LoRA's rate (the m-best base)"


def test_qlora_is_measured_from_its_own_nf4_base_never_the_bf16_one(results, tmp_path):
    """QLoRA's untrained base is the bitsandbytes NF4 model (``evaluation.untrained: [..., nf4]``): the workflow
    evaluates it, and runs / accuracy take QLoRA's "before" from it. Until it is evaluated the cell is empty, not
    bf16's score."""
    from qerl.stages.claims import build
    from qerl.workflow_config import eval_targets

    cfg = json.loads(json.dumps(CONFIG))
    cfg["experiments"][0]["methods"].append("qlora")
    for seed in (0, 1):
        _write(results, "qlora", seed, 0.33, 0.002, 0.30, 2.5, False)
    assert "results/eval/m/nf4/untrained/none/seed0/b.json" not in eval_targets(cfg)  # default: bf16 and nvfp4

    def before():
        build(cfg, results, tmp_path / "rep")
        with open(tmp_path / "rep/runs.csv") as f:
            rows = [r for r in csv.DictReader(f) if r["method"] == "qlora"]
        with open(tmp_path / "rep/accuracy.csv") as f:
            acc = next(r for r in csv.DictReader(f) if r["method"] == "qlora")
        return [r["pass1_before"] for r in rows], acc["base_pass1"]

    assert before() == (["", ""], "")
    cfg["evaluation"]["untrained"] = ["bf16", "nvfp4", "nf4"]
    assert "results/eval/m/nf4/untrained/none/seed0/b.json" in eval_targets(cfg)
    d = results / "eval" / "m/nf4/untrained/none/seed0"
    d.mkdir(parents=True)
    (d / "b.json").write_text(json.dumps({"pass@1": 0.27, "problems": 300, "per_problem": [0.27] * 300}))
    assert before() == (["27.00", "27.00"], "27.00")


def test_a_curve_claim_on_one_seed_is_not_judged_and_says_why(results, tmp_path):
    """Evidence with one seed an arm: the curve claims say they need >= 2 seeds (a run's steps are not independent
    draws), never a verdict; the accuracy claim (problems resampled) is still judged."""
    import shutil

    from qerl.stages.claims import build

    for d in list(results.glob("train/m/*/grpo/d/seed1")) + list(results.glob("eval/m/*/grpo/d/seed1")):
        shutil.rmtree(d)
    one = {**CONFIG, "experiments": [{**CONFIG["experiments"][0], "seeds": [0]}]}
    got = {c["claim"].split()[0]: c for c in build(one, results, tmp_path / "rep")["claims"]}
    for k in ("(b)", "(c1)"):
        assert got[k]["verdict"] == "not judged", k
        assert "needs >= 2 seeds an arm" in got[k]["numbers"] and "has 1 run(s)" in got[k]["numbers"], k
    assert got["(a)"]["verdict"] == "refuted"
    assert "**not judged**" in (tmp_path / "rep" / "claims.md").read_text()
