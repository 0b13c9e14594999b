"""The Snakemake workflow: lint, dry runs of every shipped config (offline), bad configs, and a real
end-to-end run of the embedded default that is killed mid-way and rerun (only unfinished jobs
redone), then checked: tables, figures and MLflow runs."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def snakemake(*args, cwd=ROOT, check=True, popen=False):
    env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}"}
    env.pop("MLFLOW_TRACKING_URI", None)  # mlflow.set_tracking_uri() in earlier in-process tests exports it
    cmd = [str(BIN / "snakemake"), "--snakefile", str(ROOT / "Snakefile"), *args]
    if popen:
        return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
    out = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    if check and out.returncode != 0:
        raise AssertionError(f"snakemake {args} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return out


def test_lint_is_clean():
    out = snakemake("--lint")
    assert "Congratulations" in out.stdout + out.stderr


def _jobs(dry_output: str) -> dict[str, int]:
    stats, on = {}, False
    for line in dry_output.splitlines():
        if line.startswith("job ") and "count" in line:
            on = True
            continue
        if on:
            parts = line.split()
            if len(parts) == 2 and parts[1].isdigit():
                stats[parts[0]] = int(parts[1])
            elif stats and not line.startswith("-"):
                break
    return stats


def test_paper_config_dag_resolves_offline(tmp_path):
    out = snakemake("--configfile", str(ROOT / "config/paper.yaml"), "--cores", "4", "--directory", str(tmp_path), "-n")
    jobs = _jobs(out.stdout + out.stderr)
    # Table 1: 2 models x 5 methods; Table 2: 4 (7B) + 3 (14B) + 3 (32B) DAPO runs
    assert jobs["train"] == 20 and jobs["download_model"] == 4 and jobs["quantize"] == 4
    assert jobs["evaluate_trained"] == 10 * 1 + 10 * 4
    assert "--limit" not in snakemake("--configfile", str(ROOT / "config/paper.yaml"), "--cores", "4", "--directory",
                                      str(tmp_path), "-n", "-p", "--forcerun", "evaluate_trained").stdout


@pytest.mark.parametrize("ablation", sorted(p.name for p in (ROOT / "config/ablations").glob("*.yaml")))
def test_ablations_are_config_only(tmp_path, ablation):
    out = snakemake("--configfile", str(ROOT / "config/config.yaml"), str(ROOT / "config/ablations" / ablation),
                    "--cores", "2", "--directory", str(tmp_path), "-n")
    assert _jobs(out.stdout + out.stderr)["train"] >= 4


@pytest.mark.parametrize("edit, culprit", [
    ("experiments:\n  - {models: [tiny-qwen2], datasets: [synthetic], methods: [qerl], algorithms: [ppo]}\n", "ppo"),
    ("experiments:\n  - {models: [gpt9], datasets: [synthetic], methods: [qerl], algorithms: [grpo]}\n", "gpt9"),
    ("experiments:\n  - {models: [tiny-qwen2], datasets: [synthetic], methods: [qlora8], algorithms: [grpo]}\n", "qlora8"),
    ("evaluation: {benchmarks: [mmlu]}\n", "mmlu"),
    ("trian: {}\n", "trian"),
])
def test_bad_configs_fail_before_any_job(tmp_path, edit, culprit):
    bad = tmp_path / "bad.yaml"
    bad.write_text(edit)
    out = snakemake("--configfile", str(ROOT / "config/config.yaml"), str(bad), "--cores", "1", "--directory",
                    str(tmp_path), "-n", check=False)
    assert out.returncode != 0
    assert culprit in out.stdout + out.stderr
    assert not (tmp_path / "results").exists()


def test_default_workflow_killed_rerun_and_checked(tmp_path):
    # 1. start the default workflow and kill it (the whole process group) mid-way
    proc = snakemake("--cores", "2", "--directory", str(tmp_path), popen=True)
    deadline = time.time() + 600
    while time.time() < deadline and proc.poll() is None:
        logs = list((tmp_path / ".snakemake/log").glob("*.snakemake.log"))
        if logs and "(Rule: train)" in logs[0].read_text():  # snakemake registered a finished training job
            os.killpg(proc.pid, signal.SIGKILL)
            break
        time.sleep(0.2)
    proc.wait(timeout=60)
    finished = {p: p.stat().st_mtime for p in tmp_path.glob("results/**/*") if p.is_file() and p.name in
                ("summary.json", "quantization_report.json")}
    assert any(p.name == "summary.json" for p in finished) and proc.returncode != 0
    # 2. after a hard kill the working directory stays locked: `--unlock` (as snakemake says), then
    #    a dry rerun plans only unfinished work
    snakemake("--directory", str(tmp_path), "--unlock")
    dry = snakemake("--cores", "2", "--directory", str(tmp_path), "-n")
    jobs = _jobs(dry.stdout + dry.stderr)
    n_trained = sum(p.name == "summary.json" for p in finished)
    assert "warm_start" not in jobs and jobs.get("train", 0) == 6 - n_trained
    quantized = any(p.name == "quantization_report.json" for p in finished)
    assert ("quantize" in jobs) != quantized
    # 3. rerun to completion; completed outputs are untouched
    snakemake("--cores", "2", "--directory", str(tmp_path))
    for p, mtime in finished.items():
        assert p.stat().st_mtime == mtime, f"{p} was redone"
    # 4. the report: tables with the paper's row labels, figures, index
    rep = tmp_path / "reports/default"
    table1 = (rep / "table1.md").read_text()
    for label in ("bf16, untrained", "NVFP4, untrained", "bf16 full fine-tuning", "bf16 LoRA", "NF4 LoRA (QLoRA)",
                  "NVFP4 LoRA", "NVFP4 LoRA + AQN (QeRL)"):
        assert label in table1
    assert "—" not in table1.split("\n", 4)[-1].split("|")[2]  # every row has our number
    assert (rep / "table1.csv").exists() and (rep / "runs.csv").exists()
    for fig in ("curves_tiny-qwen2_synthetic_grpo.png", "curves_tiny-qwen2_synthetic_dapo.png", "aqn_sigma.png",
                "accuracy.png"):
        assert (rep / fig).stat().st_size > 10_000 and f"]({fig})" in (rep / "index.md").read_text()
    # 5. MLflow: one run per job (sft, quantize, 6 train, 8 eval, report), all finished, named by path
    import mlflow

    client = mlflow.tracking.MlflowClient(f"sqlite:///{tmp_path / 'results/mlflow.db'}")
    exp = client.get_experiment_by_name("default")
    runs = client.search_runs([exp.experiment_id], max_results=200)
    names = {r.info.run_name for r in runs if r.info.status == "FINISHED"}
    assert "train/tiny-qwen2/qerl/grpo/synthetic/seed0" in names and "quantize/tiny-qwen2" in names
    assert "eval/tiny-qwen2/nvfp4/untrained/none/seed0/synthetic_test" in names and "report/default" in names
    assert len([n for n in names if n.startswith("train/")]) == 6
    assert len([n for n in names if n.startswith("eval/")]) == 8
    train_run = next(r for r in runs if r.info.run_name == "train/tiny-qwen2/qerl/grpo/synthetic/seed0"
                     and r.info.status == "FINISHED")
    assert {"model", "method", "algo", "dataset", "seed", "git_commit", "config_hash", "device"} <= set(train_run.data.tags)
    assert len(client.get_metric_history(train_run.info.run_id, "reward_mean")) == 40
    summary = json.loads((tmp_path / "results/eval/tiny-qwen2/qerl/grpo/synthetic/seed0/synthetic_test.json").read_text())
    assert summary["problems"] == 200 and summary["samples_per_problem"] == 4
