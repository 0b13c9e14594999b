"""The Snakemake workflow: lint, dry runs of every shipped config (offline), bad configs, and a real
end-to-end run of the embedded default that is killed mid-way and rerun (only unfinished jobs
redone), then checked: tables, figures and MLflow runs."""
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def snakemake(*args, cwd=ROOT, check=True, popen=False):
    """``.venv/bin/snakemake`` with the venv not on PATH (jobs run qerl through snakemake's own interpreter)."""
    env = {**os.environ, "PATH": "/usr/local/bin:/usr/bin:/bin"}
    env.pop("MLFLOW_TRACKING_URI", None)  # mlflow.set_tracking_uri() in earlier in-process tests exports it
    cmd = [str(BIN / "snakemake"), "--snakefile", str(Path(cwd) / "Snakefile"), *args]
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


def _finished(log: str) -> dict[str, int]:
    """Jobs a snakemake run finished, per rule (its "Finished jobid: N (Rule: R)" lines)."""
    out: dict[str, int] = {}
    for rule in re.findall(r"Finished jobid: \d+ \(Rule: (\w+)\)", log):
        out[rule] = out.get(rule, 0) + 1
    return out


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


PAPER_8_GPUS = (str(ROOT / "config/paper.yaml"), str(ROOT / "config/resources/gpus8.yaml"))


def test_paper_config_dag_resolves_offline(tmp_path):
    out = snakemake("--configfile", *PAPER_8_GPUS, "--cores", "4", "--directory", str(tmp_path), "-n")
    jobs = _jobs(out.stdout + out.stderr)
    # Table 1: 2 models x 5 methods; Table 2: 4 (7B) + 3 (14B) + 3 (32B) DAPO runs
    assert jobs["train"] == 20 and jobs["download_model"] == 4 and jobs["quantize"] == 4
    assert jobs["evaluate_trained"] == 10 * 1 + 10 * 4
    assert "--limit" not in snakemake("--configfile", *PAPER_8_GPUS, "--cores", "4", "--directory",
                                      str(tmp_path), "-n", "-p", "--forcerun", "evaluate_trained").stdout


def test_a_dry_run_names_the_jobs_that_cannot_fit_their_gpus(tmp_path):
    """The paper's matrix on one 80 GB GPU: the 14B and 32B full fine-tunes do not fit (the memory planner `qerl
    train` applies); the dry run says which, how much each needs and the overlay that fixes it, before any job."""
    out = snakemake("--configfile", str(ROOT / "config/paper.yaml"), "--cores", "4", "--directory", str(tmp_path),
                    "-n", check=False)
    said = out.stdout + out.stderr
    assert out.returncode != 0 and "2 training job(s) cannot fit the GPUs they are given" in said
    for run in ("qwen2.5-14b/full/dapo/bigmath_l345/seed0", "qwen2.5-32b/full/dapo/bigmath_l45/seed0"):
        line = next(x for x in said.splitlines() if f"train {run}: needs ~" in x)
        assert "GB per GPU" in line and "add the overlay config/resources/gpus8.yaml" in line
    assert not (tmp_path / "results").exists()


def test_the_paper_matrix_on_local_weights_through_the_shipped_overlay(tmp_path, tiny_dirs):
    """config/paper_local.yaml switches every model of config/paper.yaml to `source: local` (the hub keys dropped,
    saying so); with its paths pointed at local directories the matrix dry-runs offline, no download planned and no
    model copied. A local model without a path, or a typo in the overlay, is one line."""
    import yaml

    local = yaml.safe_load((ROOT / "config/paper_local.yaml").read_text())
    assert set(local["models"]) == set(yaml.safe_load((ROOT / "config/paper.yaml").read_text())["models"])
    (tmp_path / "models").mkdir()
    paths = {}
    for name, entry in local["models"].items():  # the overlay's layout, under this test's directory
        where = tmp_path / "models" / Path(entry["path"]).name
        where.symlink_to(tiny_dirs["qwen2"], target_is_directory=True)
        paths[name] = {"path": str(where)}
    (tmp_path / "paths.yaml").write_text(yaml.safe_dump({"models": paths}))
    overlays = ("--configfile", *PAPER_8_GPUS, str(ROOT / "config/paper_local.yaml"), str(tmp_path / "paths.yaml"))
    out = snakemake(*overlays, "--cores", "4", "--directory", str(tmp_path / "w"), "-n")
    said = out.stdout + out.stderr
    jobs = _jobs(said)
    assert "download_model" not in jobs and jobs["train"] == 20 and jobs["quantize"] == 4
    assert "qerl: models.qwen2.5-7b: source 'local' (" in said and "does not read hub_id, revision" in said
    # a local model without its path; a typo in the overlay
    (tmp_path / "nopath.yaml").write_text("models:\n  qwen2.5-7b: {source: local}\n")
    bad = snakemake("--configfile", *PAPER_8_GPUS, str(tmp_path / "nopath.yaml"), "--directory", str(tmp_path / "w2"),
                    "-n", check=False)
    assert bad.returncode != 0 and "qwen2.5-7b" in bad.stdout + bad.stderr and "'path' is a required property" in \
        bad.stdout + bad.stderr
    (tmp_path / "typo.yaml").write_text("models:\n  qwen2.5-7b: {source: local, pth: /x}\n")
    bad = snakemake("--configfile", *PAPER_8_GPUS, str(tmp_path / "typo.yaml"), "--directory", str(tmp_path / "w3"),
                    "-n", check=False)
    assert bad.returncode != 0 and "unknown key 'models.qwen2.5-7b.pth' (did you mean 'path'?)" in \
        bad.stdout + bad.stderr


def test_multi_gpu_training_launches_through_torchrun(tmp_path):
    """resources.train.gpu > 1: the train jobs run `qerl train --nproc <gpu>` (one process per GPU); 1: plain."""
    edit = ROOT / "config/resources/gpus8.yaml"  # the shipped 8-GPU overlay
    args = ("--configfile", str(ROOT / "config/paper.yaml"), str(edit), "--cores", "4", "--directory", str(tmp_path),
            "-n", "-p", "--forcerun", "train")
    shells = [ln for ln in snakemake(*args).stdout.splitlines() if "qerl train --config" in ln]
    assert shells and all("--rerun --no-progress --nproc 8 >" in ln for ln in shells)
    from qerl import workflow_config as wc
    import yaml as _yaml

    cfg = {}
    for f in (ROOT / "config/paper.yaml", edit):  # snakemake's deep merge of the two files
        cfg = wc._merge(cfg, _yaml.safe_load(f.read_text()))
    full = [r for r in wc.runs(cfg) if r.method == "full"]
    assert full and all(wc.train_config(cfg, r, "x")["sharding"] == "fsdp" for r in full)  # FSDP2 for the full method
    assert all(wc.train_config(cfg, r, "x").get("sharding") is None for r in wc.runs(cfg) if r.method != "full")
    assert wc.train_config(cfg, full[0], "x")["optim"]["lr"] == 1.0e-6  # paper.yaml's override kept
    # the paper's 32B full BigMath run plans to fit 8 x 80 GB: FSDP2, micro-batches of one (the overlay), its AdamW
    # states parked in host memory during the rollout and the rollout in waves (optim.offload: auto, the planner)
    from qerl.train.config import TrainConfig, from_dict, validate
    from qerl.train.plan import plan_config

    big = next(r for r in full if r.model == "qwen2.5-32b")
    plan = plan_config(validate(from_dict(TrainConfig, wc.train_config(cfg, big, "x"))), shape="32B",
                       available=80e9, world=8)
    assert plan["fits"] and plan["offload"] and plan["estimate"]["waves"] == 4, plan["markdown"]
    table1 = tmp_path / "table1.yaml"  # Table 1's runs (3B / 7B, GSM8K) fit one GPU each
    table1.write_text(_yaml.safe_dump({"experiments": _yaml.safe_load((ROOT / "config/paper.yaml").read_text())
                                       ["experiments"][:1]}))
    one = snakemake("--configfile", str(ROOT / "config/paper.yaml"), str(table1), "--cores", "4", "--directory",
                    str(tmp_path), "-n", "-p", "--forcerun", "train").stdout
    assert "--nproc" not in one and "qerl train --config" in one


def test_a_local_run_keeps_gpu_jobs_within_the_visible_gpus(tmp_path, monkeypatch):
    """Snakemake runs jobs whose `gpu` resource has no limit side by side, and every job would open cuda:0. A local
    run of a config whose jobs ask for GPUs gets `gpu` = the visible GPUs (unless `--resources gpu=N`) and exports
    QERL_GPU_LOCKS, which each GPU job's `QERL_CLAIM_GPUS=<its gpu> qerl ...` uses to lock GPUs of its own
    (tests/test_gpu_claim.py); a cluster executor (nodes set) or a CPU-only config is left alone."""
    from qerl import workflow_config as wc

    paper = {"resources": {"train": {"gpu": 1}, "quantize": {"gpu": 0}}}
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    assert wc.visible_gpus() == 2 and wc.local_gpus({}, paper) == 2
    assert wc.local_gpus({"_nodes": 32}, paper) is None  # --executor slurm (jobs: 32)
    assert wc.local_gpus({}, {"resources": {"train": {"gpu": 0}}}) is None  # the CPU default
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,-1,2")  # CUDA stops at the first invalid entry
    assert wc.visible_gpus() == 1
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert wc.visible_gpus() == 0 and wc.local_gpus({}, paper) is None
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    import yaml

    table1 = tmp_path / "table1.yaml"  # the paper's Table 1 runs: one GPU each
    table1.write_text(yaml.safe_dump({"experiments": yaml.safe_load((ROOT / "config/paper.yaml").read_text())
                                      ["experiments"][:1]}))
    args = ("--configfile", str(ROOT / "config/paper.yaml"), str(table1), "--cores", "2", "--directory",
            str(tmp_path), "-n", "-p", "--forcerun", "train")
    out = snakemake(*args)
    assert "qerl: local run on 2 visible GPU(s): GPU jobs use at most 2 at a time, each its own" in out.stderr
    assert "QERL_CLAIM_GPUS=1 qerl train --config" in out.stdout
    out = snakemake(*args, "--resources", "gpu=1")
    assert "GPU jobs use at most 1 at a time" in out.stderr
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # no GPU: nothing to limit (GPU jobs fail in their own code)
    assert "qerl: local run" not in snakemake(*args).stderr


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
    # the runs' qerl-train configs: a bad value, an unknown key (checked by `qerl train`'s own rules)
    ("train: {algorithm: {group_size: eight}}\n", "algorithm.group_size: expected an integer, got 'eight'"),
    ("method_overrides: {qerl: {aqn: {sigma_strat: 0.01}}}\n", "sigma_strat"),
    ("train: {steps: 3}\ntrain: {steps: 9}\n", "key 'train' is given twice (lines 1 and 2)"),
    ("evalaution: {samples: 2}\n", "bad.yaml: unknown key 'evalaution' (did you mean 'evaluation'?)"),
    ("models: {tiny-qwen2: {sft_step: 3}}\n", "unknown key 'models.tiny-qwen2.sft_step' (did you mean 'sft_steps'?)"),
])
def test_bad_configs_fail_before_any_job(tmp_path, edit, culprit):
    bad = tmp_path / "bad.yaml"
    bad.write_text(edit)
    out = snakemake("--configfile", str(ROOT / "config/config.yaml"), str(bad), "--cores", "1", "--directory",
                    str(tmp_path), "-n", check=False)
    assert out.returncode != 0
    assert culprit in out.stdout + out.stderr
    assert not (tmp_path / "results").exists()


def fresh_copy(dest: Path) -> Path:
    """The repository as a fresh clone has it: tracked (and untracked, not ignored) files only, so no
    results/, logs/ or .snakemake/."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.split()
    for f in files:
        src = ROOT / f
        if f.startswith("reports/"):
            continue
        (dest / f).parent.mkdir(parents=True, exist_ok=True)
        if src.is_symlink():  # e.g. profiles -> workflow/profiles (snakemake's default profile, as a clone has it)
            os.symlink(os.readlink(src), dest / f)
        elif src.is_file():
            shutil.copy2(src, dest / f)
    assert (dest / "profiles/default/config.yaml").exists()
    return dest


def make_run(repo: Path, *args: str, check=True):
    """`make run` in ``repo`` with this test's environment as the venv (marked installed: ``-o``), and a PATH
    without it: jobs must find qerl through the interpreter snakemake runs under."""
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "VIRTUAL_ENV")}
    env["PATH"] = "/usr/local/bin:/usr/bin:/bin"
    venv = Path(sys.prefix)
    out = subprocess.run(["make", "run", f"VENV={venv}", "-o", str(venv / ".qerl-installed"), *args], cwd=repo,
                         env=env, capture_output=True, text=True)
    if check and out.returncode != 0:
        raise AssertionError(f"make run {args} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return out


def _outputs(repo: Path) -> dict[Path, float]:
    return {p: p.stat().st_mtime for p in (repo / "results").rglob("*") if p.is_file() and p.name != "mlflow.db"}


def _finished_outputs(log: str) -> set[str]:
    """Output paths of the jobs a snakemake log reports finished (``output:`` / ``jobid:`` of a rule block, then
    ``Finished jobid: N``)."""
    import re

    outputs = {}
    for block in re.findall(r"rule \w+:\n((?:    .*\n)+)", log):
        out = re.search(r"^    output: (.*)$", block, re.M)
        job = re.search(r"^    jobid: (\d+)$", block, re.M)
        if out and job:
            outputs[job.group(1)] = [x.strip() for x in out.group(1).split(",")]
    return {o for j in re.findall(r"Finished jobid: (\d+)", log) for o in outputs.get(j, [])}


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    """The default workflow in a fresh copy: started, killed mid-way (the whole process group), unlocked, dry-run
    (only unfinished work planned), completed by `make run`. ``(repo, finished-before-the-kill mtimes, make run)``."""
    repo = fresh_copy(tmp_path_factory.mktemp("default") / "qerl")
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    env["PATH"] = "/usr/local/bin:/usr/bin:/bin"  # `.venv/bin/snakemake` called directly, venv not on PATH
    # 1. start the default workflow and kill it (the whole process group) mid-way
    proc = subprocess.Popen([str(BIN / "snakemake"), "--cores", "2"], cwd=repo, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    deadline = time.time() + 600
    while time.time() < deadline and proc.poll() is None:
        logs = list((repo / ".snakemake/log").glob("*.snakemake.log"))
        if logs and "(Rule: train)" in logs[0].read_text():  # snakemake registered a finished training job
            os.killpg(proc.pid, signal.SIGKILL)
            break
        time.sleep(0.2)
    proc.wait(timeout=60)
    # finished = outputs of jobs the log calls finished (a job killed just after writing its output is not: snakemake
    # marked it incomplete and reruns it, rerun-incomplete in the default profile)
    done = _finished_outputs(next((repo / ".snakemake/log").glob("*.snakemake.log")).read_text())
    finished = {p: p.stat().st_mtime for p in repo.glob("results/**/*") if p.is_file() and p.name in
                ("summary.json", "quantization_report.json") and str(p.relative_to(repo)) in done}
    assert any(p.name == "summary.json" for p in finished) and proc.returncode != 0
    # 2. after a hard kill the working directory stays locked: `--unlock` (as snakemake says), then
    #    a dry rerun plans only unfinished work
    snakemake("--unlock", cwd=repo)
    dry = snakemake("--cores", "2", "-n", cwd=repo)
    jobs = _jobs(dry.stdout + dry.stderr)
    n_trained = sum(p.name == "summary.json" for p in finished)
    assert "warm_start" not in jobs and jobs.get("train", 0) == 6 - n_trained
    quantized = any(p.name == "quantization_report.json" for p in finished)
    assert ("quantize" in jobs) != quantized
    # 3. `make run` completes it
    return repo, finished, make_run(repo)


@pytest.mark.numerics
@pytest.mark.xdist_group("default_run")  # one worker makes the default run once for all three (make test)
def test_default_workflow_fresh_copy_killed_rerun_and_checked(default_run):
    """A killed default workflow resumes with only its unfinished work; the report, its figures, the committed
    example (checked to what a run can promise on another CPU)."""
    from qerl.stages import report_check

    repo, finished, out = default_run
    # 3. completed outputs are untouched; it says where everything is
    for p, mtime in finished.items():
        assert p.stat().st_mtime == mtime, f"{p} was redone"
    said = out.stdout
    assert "qerl workflow 'default' is complete" in said and "results/reports/default/index.md" in said
    assert f"sqlite:///{repo / 'results/mlflow.db'}" in said and "mlflow ui" in said
    # 4. the report, under results/: tables with the paper's row labels, figures, index
    rep = repo / "results/reports/default"
    table1 = (rep / "table1.md").read_text()
    for label in ("bf16, untrained", "NVFP4, untrained", "bf16 full fine-tuning", "bf16 LoRA", "NF4 LoRA (QLoRA)",
                  "NVFP4 LoRA", "NVFP4 LoRA + AQN (QeRL)"):
        assert label in table1
    assert "—" not in table1.split("\n", 4)[-1].split("|")[2]  # every row has our number
    assert (rep / "table1.csv").exists() and (rep / "runs.csv").exists()
    for fig in ("curves_tiny-qwen2_synthetic_grpo.png", "curves_tiny-qwen2_synthetic_dapo.png", "aqn_sigma.png",
                "accuracy.png"):
        assert (rep / fig).stat().st_size > 10_000 and f"]({fig})" in (rep / "index.md").read_text()
    assert not (repo / "reports").exists()  # the committed example is never a workflow target
    # ... and it is what this run reports: the same files, tables, rows, labels and columns, every number within
    # the tolerance reports/default/tolerance.json states (on another CPU a tiny model's RL run moves as seeds do)
    problems = report_check.compare(rep, ROOT / "reports/default")
    assert not problems, "reports/default differs from a fresh run's (`make example-report` and commit it):\n" + \
        "\n".join(problems)


@pytest.mark.xdist_group("default_run")  # one worker makes the default run once for all three (make test)
def test_default_workflow_tracking_reruns_and_an_ablation(default_run):
    """On the finished default run (not repeated on other CPU kernels: nothing here is numerics): MLflow as a study,
    `snakemake --report`, a no-op rerun, a bad config, an edit, an ablation overlay that reuses finished work, and
    every rule rerunning over its own output."""
    repo, _, _ = default_run
    # 5. MLflow: one run per job (sft, quantize, 6 train, 8 eval, report), all finished, named by path
    import mlflow

    client = mlflow.tracking.MlflowClient(f"sqlite:///{repo / 'results/mlflow.db'}")
    exp = client.get_experiment_by_name("default")
    runs = client.search_runs([exp.experiment_id], max_results=200)
    names = {r.info.run_name for r in runs if r.info.status == "FINISHED"}
    # run names lead with the arm and seed (the UI cuts them): the stage and the cell follow
    assert "qerl seed0 · tiny-qwen2/grpo/synthetic" in names and "quantize · tiny-qwen2" in names
    assert "nvfp4 untrained · synthetic_test · tiny-qwen2" in names and "report · default" in names
    finished = [r for r in runs if r.info.status == "FINISHED"]
    assert len({r.info.run_name for r in finished if r.data.tags.get("stage") == "train"}) == 6
    assert len({r.info.run_name for r in finished if r.data.tags.get("stage") == "eval"}) == 8
    train_run = next(r for r in runs if r.info.run_name == "qerl seed0 · tiny-qwen2/grpo/synthetic"
                     and r.info.status == "FINISHED")
    assert {"model", "method", "algo", "dataset", "seed", "git_commit", "config_hash", "device"} <= set(train_run.data.tags)
    quant_run = next(r for r in runs if r.info.run_name == "quantize · tiny-qwen2")
    assert len(quant_run.data.tags["config_hash"]) == 12 and quant_run.data.tags["stage"] == "quantize"
    assert len(client.get_metric_history(train_run.info.run_id, "reward_mean")) == 40
    summary = json.loads((repo / "results/eval/tiny-qwen2/qerl/grpo/synthetic/seed0/synthetic_test.json").read_text())
    assert summary["problems"] == 200 and summary["samples_per_problem"] == 4
    # ... as a study: each invocation a run with the jobs' runs nested under it, each evaluation nested under the
    # training run it evaluated and its pass@1 on that run too, artifacts under results/, no stray 'Default'
    assert [e.name for e in client.search_experiments()] == ["default"]
    assert exp.artifact_location == (repo / "results/mlartifacts/default").resolve().as_uri()
    invocations = [r for r in runs if r.info.run_name == "workflow · default"]
    assert invocations and all(r.data.params["configuration"] == "default" for r in invocations)
    assert {r.info.status for r in invocations} <= {"FINISHED", "KILLED"}  # (the killed one: closed by the next)
    by_id = {r.info.run_id: r for r in runs}
    assert by_id[train_run.data.tags["mlflow.parentRunId"]].info.run_name == "workflow · default"
    ev = next(r for r in runs if r.info.run_name == "qerl seed0 · synthetic_test · tiny-qwen2/grpo/synthetic")
    assert ev.data.tags["mlflow.parentRunId"] == train_run.info.run_id
    assert train_run.data.metrics["pass_at_1/synthetic_test"] == summary["pass@1"]
    assert {a.path for a in client.list_artifacts(train_run.info.run_id)} >= {"config.json", "train.yaml",
                                                                             "summary.json", "metrics.jsonl", "curves.png"}
    assert train_run.data.params["method"] == "qerl" and train_run.data.params["base_method"] == "qerl"
    last = max((r for r in invocations if r.info.status == "FINISHED"), key=lambda r: r.info.start_time)
    assert "accuracy.png" in {a.path.split("/")[-1] for a in client.list_artifacts(last.info.run_id, "report")}
    # ... params are what ran, never `auto`; the invocation says what the configuration compares
    autos = [(r.info.run_name, k) for r in finished for k, v in r.data.params.items() if str(v).lower() == "auto"]
    assert not autos, autos
    assert train_run.data.params["aqn.enabled"] == "True" and train_run.data.params["device"] == "cpu"
    assert "`qerl`" in last.data.tags["mlflow.note.content"] and "tiny-qwen2" in last.data.tags["mlflow.note.content"]
    assert client.search_runs([exp.experiment_id], "params.`aqn.enabled` = 'True' and tags.stage = 'train'")
    # ... and no job log carries transformers' / bitsandbytes' probe for the hub's `kernels` package
    probed = [str(p) for p in (repo / "logs").rglob("*.log") if "kernels-community" in p.read_text(errors="replace")
              or "get_kernel" in p.read_text(errors="replace")]
    assert not probed, probed
    # ... and `snakemake --report` carries the report's tables and figures, captioned
    snakemake("--report", "report.html", cwd=repo)
    html = (repo / "report.html").read_text(errors="replace")
    assert "arms_tiny-qwen2_synthetic_grpo.png" in html and "runs.csv" in html and "side by side" in html
    assert "table1.html" in html and "runs.html" in html  # (shown as tables; a CSV is only offered for download)
    # 6. a second `make run` does nothing; a broken config stops before any job and loses nothing
    before = _outputs(repo)
    again = make_run(repo)
    assert "Nothing to be done" in again.stdout + again.stderr and "is complete" in again.stdout
    (repo / "bad.yaml").write_text("evaluation: {samples: many}\n")
    bad = make_run(repo, "CONFIGFILES=config/config.yaml bad.yaml", check=False)
    assert bad.returncode != 0 and "samples" in bad.stdout + bad.stderr and "many" in bad.stdout + bad.stderr
    assert _outputs(repo) == before
    # 7. editing the config reruns what depends on it: evaluation settings -> the 8 evaluations and the report
    (repo / "edit.yaml").write_text("evaluation: {samples: 2}\n")
    dry = snakemake("--configfile", "config/config.yaml", "edit.yaml", "--cores", "2", "-n", cwd=repo)
    jobs = _jobs(dry.stdout + dry.stderr)
    assert jobs.get("evaluate_trained", 0) + jobs.get("evaluate_untrained", 0) == 8 and jobs.get("report") == 1
    assert "train" not in jobs and "quantize" not in jobs and "warm_start" not in jobs
    # 8. an ablation the README's way: an overlay with two new arms (another configuration, so another MLflow
    # experiment) plans only their jobs (the qerl baseline, the warm start, the quantization and the untrained
    # evaluations are reused: where a job is tracked is not part of what it is), then runs to its report
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"```yaml\n\s*# my_ablation.yaml\n(.*?)```", readme, re.S).group(1)
    (repo / "my_ablation.yaml").write_text(textwrap.dedent(block))
    dry_cmd, run_cmd = re.findall(r"^\s*\.venv/bin/snakemake (.*?my_ablation\.yaml)", readme, re.M)[:2]
    dry = snakemake(*shlex.split(dry_cmd), cwd=repo)  # the README's commands, as printed ("--cores all": 2 here)
    jobs = _jobs(dry.stdout + dry.stderr)
    jobs.pop("total", None)
    assert jobs == {"resolve_train_config": 2, "train": 2, "evaluate_trained": 2, "effective_config": 1, "report": 1,
                    "all": 1}, jobs
    assert len((dry.stdout + dry.stderr).splitlines()) < 200  # its reasons stay short
    import yaml

    tracking = yaml.safe_load((repo / "results/train/tiny-qwen2/qerl/grpo/synthetic/seed0/train.yaml").read_text())
    assert not {"tracking_uri", "experiment"} & set(tracking["tracking"])
    snakemake(*shlex.split(run_cmd), cwd=repo)
    arms = (repo / "results/reports/my-ablation/arms_tiny-qwen2_synthetic_grpo.csv").read_text()
    assert "qerl_s2e-2,qerl,aqn.sigma_start 0.02," in arms and "qerl_r8,qerl,lora.r 8; lora.alpha 16," in arms
    assert (repo / "results/reports/my-ablation/arms_tiny-qwen2_synthetic_grpo.png").stat().st_size > 10_000
    # ... the README's MLflow recipe: the experiment `my-ablation`, filtered to its training runs, holds every arm of
    # its report, the reused `qerl` baseline as a link to the run `default` trained
    ablation = client.get_experiment_by_name("my-ablation").experiment_id
    arm_runs = client.search_runs([ablation], "tags.stage = 'train'")
    assert sorted(r.data.params["method"] for r in arm_runs) == ["qerl", "qerl_r8", "qerl_s2e-2"]
    assert all(r.data.params["base_method"] == "qerl" and "pass_at_1/synthetic_test" in r.data.metrics
               for r in arm_runs)
    link = next(r for r in arm_runs if r.data.params["method"] == "qerl")
    assert link.data.tags["qerl.linked_from"] == train_run.info.run_id
    assert link.data.tags["qerl.linked_from_experiment"] == "default"
    assert link.info.run_name == train_run.info.run_name and link.data.params == train_run.data.params
    assert [m.value for m in client.get_metric_history(link.info.run_id, "reward_mean")] == \
        [m.value for m in client.get_metric_history(train_run.info.run_id, "reward_mean")]
    assert len(client.search_runs([ablation], "params.base_method = 'qerl'")) == 3
    bases = {r.info.run_name for r in client.search_runs([ablation], "tags.stage = 'eval'")}
    assert {"bf16 untrained · synthetic_test · tiny-qwen2", "nvfp4 untrained · synthetic_test · tiny-qwen2"} <= bases
    # ... and the default's experiment still holds exactly its own report's arms
    assert len({r.info.run_name for r in client.search_runs([exp.experiment_id], "tags.stage = 'train'")}) == 6
    # 9. a job Snakemake reruns replaces its own earlier output, no manual delete: the untrained evaluations and the
    # report, then the warm start and the quantization (model directories Snakemake has partly deleted first; a
    # training job rerun after its config or base changed starts over: tests/train/test_ownership.py)
    rerun = snakemake("--forcerun", "evaluate_untrained", "report", "--cores", "2", cwd=repo)
    assert _finished(rerun.stdout + rerun.stderr) == {"evaluate_untrained": 2, "report": 1, "all": 1}
    rerun = snakemake("--forcerun", "warm_start", "quantize", "--until", "quantize", "--cores", "2", cwd=repo)
    assert _finished(rerun.stdout + rerun.stderr) == {"warm_start": 1, "quantize": 1}
    assert json.loads((repo / "results/quantize/tiny-qwen2/qerl_files.json").read_text())["files"]


_TIMING = ("seconds", "per_second", "peak_memory", "device")  # keys that measure the machine, not the result


def _result_view(results: Path, run: str, untrained: str) -> dict[str, object]:
    """What a run's chain writes that must not depend on when or how often it ran: the warm-started and quantized
    weights, the adapter, the metrics rows (timings dropped), an evaluation's scores and samples."""
    view = {}
    for rel in ("models/tiny-qwen2/model.safetensors", "quantize/tiny-qwen2/model.safetensors",
                f"train/{run}/final/adapter_model.safetensors", f"eval/{run}/synthetic_test.samples.jsonl",
                f"eval/{untrained}/synthetic_test.samples.jsonl"):
        view[rel] = (results / rel).read_bytes()
    rows = [json.loads(x) for x in (results / f"train/{run}/metrics.jsonl").read_text().splitlines() if x.strip()]
    view["metrics"] = [{k: v for k, v in r.items() if not any(t in k for t in _TIMING)} for r in rows]
    for rel in (f"eval/{run}/synthetic_test.json", f"eval/{untrained}/synthetic_test.json"):
        summary = json.loads((results / rel).read_text())
        view[rel] = {k: v for k, v in summary.items() if not any(t in k for t in _TIMING)}
    return view


@pytest.mark.xdist_group("default_run")  # one worker makes the default run once for all three (make test)
def test_two_fresh_runs_on_one_machine_are_byte_equal(default_run, tmp_path):
    """Determinism: a second fresh copy runs one chain of the default workflow (warm start, quantize, QeRL seed 0
    trained and evaluated, the NVFP4 base evaluated) and writes the same bytes as the first run, which was killed
    and resumed on the way (README "Determinism": the same machine and seed give the same bytes)."""
    repo, _, _ = default_run
    run, untrained = "tiny-qwen2/qerl/grpo/synthetic/seed0", "tiny-qwen2/nvfp4/untrained/none/seed0"
    other = fresh_copy(tmp_path / "qerl")
    snakemake("--cores", "2", f"results/eval/{run}/synthetic_test.json",
              f"results/eval/{untrained}/synthetic_test.json", cwd=other)
    a, b = _result_view(repo / "results", run, untrained), _result_view(other / "results", run, untrained)
    assert a.keys() == b.keys()
    differ = [k for k in a if a[k] != b[k]]
    assert not differ, f"two fresh runs of the default workflow on this machine differ in {differ}"


def test_missing_dependency_stops_before_any_job(tmp_path):
    """A job dependency the interpreter cannot import (mlflow hidden by a sitecustomize) is named before the DAG
    runs; nothing is created."""
    (tmp_path / "hide").mkdir()
    (tmp_path / "hide/sitecustomize.py").write_text("import sys\nsys.modules['mlflow'] = None\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "hide")}
    out = subprocess.run([str(BIN / "snakemake"), "--snakefile", str(ROOT / "Snakefile"), "--cores", "1",
                          "--directory", str(tmp_path / "w"), "-n"], env=env, capture_output=True, text=True)
    assert out.returncode != 0
    assert "missing dependencies" in out.stdout + out.stderr and "mlflow" in out.stdout + out.stderr
    assert not (tmp_path / "w/results").exists()


def test_the_schema_names_the_registry_methods():
    """The workflow schema (data, not code) lists the method names of qerl.methods, the one registry."""
    import yaml

    from qerl.methods import NAMES, UNTRAINED

    schema = yaml.safe_load((ROOT / "workflow/schemas/config.schema.yaml").read_text())
    text = json.dumps(schema)
    for enum in (list(NAMES), list(NAMES) + list(UNTRAINED)):
        assert json.dumps(enum) in text


def test_every_algorithm_enum_of_the_schema_is_the_presets_table():
    """Each place the workflow schema lists algorithms (a run's, the matrix's, the overrides' keys) lists exactly the
    presets of qerl.rl.algorithms, in its order: a new preset is one table row (and this schema line)."""
    import yaml

    from qerl.rl.algorithms import NAMES

    found = []

    def walk(node):
        if isinstance(node, dict):
            if isinstance(node.get("enum"), list) and "grpo" in node["enum"]:
                found.append(node["enum"])
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)
    walk(yaml.safe_load((ROOT / "workflow/schemas/config.schema.yaml").read_text()))
    assert len(found) == 3 and all(e == list(NAMES) for e in found), found


def test_a_local_benchmark_file_is_evaluated_offline_through_the_workflow(tmp_path):
    """`evaluation.local_benchmarks`: a benchmark from a local JSONL (GSM8K-style fields, `####` answers) is an
    input of its evaluation jobs and is evaluated for real (one untrained target, built offline); an undefined
    name or a missing file stops the workflow before any job, naming it."""
    (tmp_path / "bench").mkdir()
    rows = [{"question": f"{a}+{b}=", "answer": f"so #### {a + b}"} for a, b in ((1, 2), (3, 4), (5, 0))]
    (tmp_path / "bench" / "arith.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    over = tmp_path / "local.yaml"
    over.write_text("models: {tiny-qwen2: {sft_steps: 5}}\n"
                    "evaluation:\n  benchmarks: [arith]\n  untrained: [bf16]\n  limit: 3\n  samples: 1\n"
                    "  template: raw\n  local_benchmarks:\n    arith: {path: bench/arith.jsonl, prompt_field: question, "
                    "answer_field: answer, answer_format: gsm8k}\n")
    target = "results/eval/tiny-qwen2/bf16/untrained/none/seed0/arith.json"
    cfg = ("--configfile", str(ROOT / "config/config.yaml"), str(over))
    dry = snakemake(*cfg, "--cores", "1", "--directory", str(tmp_path), "-n", "-p", target).stdout
    assert "--benchmark bench/arith.jsonl --name arith --prompt-field question --answer-field answer " \
           "--answer-format gsm8k" in dry
    snakemake(*cfg, "--cores", "1", "--directory", str(tmp_path), target)
    summary = json.loads((tmp_path / target).read_text())
    assert summary["benchmark"] == "arith" and summary["problems"] == 3 and summary["benchmark_file"] == \
        "bench/arith.jsonl" and len(summary["benchmark_sha256"]) == 64
    for edit, culprit in (("evaluation: {benchmarks: [arith2]}\n", "benchmark 'arith2' is neither registered"),
                          ("evaluation: {local_benchmarks: {arith: {path: bench/none.jsonl}}}\n",
                           "local_benchmarks.arith.path: bench/none.jsonl not found")):
        bad = tmp_path / "bad.yaml"
        bad.write_text(edit)
        out = snakemake(*cfg, str(bad), "--cores", "1", "--directory", str(tmp_path), "-n", check=False)
        assert out.returncode != 0 and culprit in out.stdout + out.stderr


def _real_config_copy(tmp_path, gguf_path):
    """config/real's data in a scratch workflow directory, its model pointed at ``gguf_path``."""
    shutil.copytree(ROOT / "config/real/data", tmp_path / "config/real/data")
    over = tmp_path / "model.yaml"
    over.write_text(f"models:\n  qwen2.5-coder-0.5b: {{source: gguf, path: {gguf_path}}}\n")
    return ("--configfile", str(ROOT / "config/real/real.yaml"), str(over))


def test_real_config_dag_resolves_offline(tmp_path, tiny_gguf):
    """config/real: the GGUF is converted once and quantized twice (round-to-nearest, and the best base of
    reports/real/bases with AWQ on the training prompts); 6 arms x 4 seeds plus QeRL on the best base x 4 seeds are
    trained and evaluated with the untrained bases (bf16, both NVFP4 bases, and QLoRA's NF4 base, quantized on load)
    on the 500 held-out test problems, each
    arm at the rate the sweep chose (QeRL / NVFP4 LoRA / QLoRA 3e-5, bf16 LoRA and its AQN variant 1e-4, the
    paper's recipe 2e-4); the sweep overlay trains 8 rates of two methods and evaluates them on the validation split
    only."""
    import yaml

    cfg = _real_config_copy(tmp_path, tiny_gguf["Q8_0"])
    out = snakemake(*cfg, "--cores", "2", "--directory", str(tmp_path), "-n", "-p")
    jobs = _jobs(out.stdout + out.stderr)
    assert jobs["convert_gguf"] == 1 and jobs["quantize"] == 2 and jobs["train"] == 28
    assert jobs["evaluate_trained"] == 28 and jobs["evaluate_untrained"] == 4
    assert "qerl evaluate --model results/models/qwen2.5-coder-0.5b --base nf4 " in out.stdout
    assert "--output results/quantize/q05b-awq-fos-tail --force --max-shard-size 2GB --scale-rule four-over-six " \
           "--keep-bf16-last 0.15 --calibration awq --calibration-data config/real/data/gsm8k_train.jsonl" in out.stdout
    assert "results/eval/q05b-awq-fos-tail/bf16/" not in out.stdout
    assert f"qerl from-gguf --gguf {tiny_gguf['Q8_0']} --output results/models/qwen2.5-coder-0.5b" in out.stdout
    assert "--benchmark config/real/data/gsm8k_test500.jsonl --name gsm8k_test500" in out.stdout
    assert "gsm8k_val" not in out.stdout
    assert out.stdout.count("--nf4-weights dense") == 32  # QLoRA's NF4 base dequantized once in every evaluation
    from qerl.workflow_config import Run, train_config

    config = yaml.safe_load((ROOT / "config/real/real.yaml").read_text())
    lrs = {m: train_config(config, Run("qwen2.5-coder-0.5b", m, "grpo", "gsm8k_real", 0), "sqlite://")["optim"]["lr"]
           for m in ("lora", "lora_aqn", "nvfp4_lora", "qerl", "qlora", "qerl_2x_lora_lr")}
    assert lrs == {"lora": 1e-4, "lora_aqn": 1e-4, "nvfp4_lora": 3e-5, "qerl": 3e-5, "qlora": 3e-5,
                   "qerl_2x_lora_lr": 2e-4}
    qlora = train_config(config, Run("qwen2.5-coder-0.5b", "qlora", "grpo", "gsm8k_real", 0), "sqlite://")
    assert qlora["rollout"]["nf4_weights"] == "dense"
    sweep = snakemake(*cfg, str(ROOT / "config/real/lr_sweep.yaml"), "--cores", "2", "--directory", str(tmp_path),
                      "-n", "-p")
    jobs = _jobs(sweep.stdout + sweep.stderr)
    assert jobs["train"] == 8 and jobs["evaluate_trained"] == 8
    assert "--name gsm8k_val" in sweep.stdout and "gsm8k_test500" not in sweep.stdout


def test_bases_overlay_quantizes_six_ways_and_evaluates_bases_only(tmp_path, tiny_gguf):
    """config/real/bases.yaml: six NVFP4 bases of the one converted model (RTN, four-over-six, + bf16 tail, AWQ on
    the training prompts, AWQ + four-over-six (+ tail)) and the bf16 reference, evaluated untrained on the validation
    and test sets; no training run. AWQ without calibration data stops before any job, naming the key."""
    cfg = _real_config_copy(tmp_path, tiny_gguf["Q8_0"])
    bases = ("--configfile", *cfg[1:], str(ROOT / "config/real/bases.yaml"))
    out = snakemake(*bases, "--cores", "2", "--directory", str(tmp_path), "-n", "-p")
    jobs = _jobs(out.stdout + out.stderr)
    assert jobs["convert_gguf"] == 1 and jobs["quantize"] == 6 and jobs["evaluate_untrained"] == 14
    assert "train" not in jobs and "evaluate_trained" not in jobs
    text = out.stdout
    assert text.count("--calibration awq --calibration-data config/real/data/gsm8k_train.jsonl "
                      "--calibration-field question --calibration-solution-field answer --calibration-template paper "
                      "--calibration-samples 256 --calibration-seq-len 2048") == 3
    assert "--output results/quantize/q05b-awq-fos-tail --force --max-shard-size 2GB --scale-rule four-over-six " \
           "--keep-bf16-last 0.15 --calibration awq" in text
    assert "--model results/models/qwen2.5-coder-0.5b --output results/quantize/q05b-rtn" in text
    (tmp_path / "nodata.yaml").write_text("quantize: {calibration_data: null}\n")
    bad = snakemake(*bases, str(tmp_path / "nodata.yaml"), "--cores", "1", "--directory", str(tmp_path), "-n",
                    check=False)
    assert bad.returncode != 0 and "calibration" in bad.stdout + bad.stderr


def test_a_gguf_model_goes_through_the_workflow(tmp_path, tiny_dirs, gguf_writer):
    """`models.<name>.source: gguf` for real: a tiny Qwen2 written as a Q8_0 GGUF file is converted by the workflow
    and evaluated on config/real's held-out problems; the summary names the GGUF source and its dequantized types."""
    from qerl.models.tiny import TinySpec, save_tiny_model

    src = save_tiny_model(tmp_path / "src", TinySpec(seed=3, max_position_embeddings=2048))
    gguf_file = gguf_writer(src, tmp_path / "tiny.gguf", "Q8_0")
    cfg = _real_config_copy(tmp_path, gguf_file)
    small = tmp_path / "small.yaml"
    small.write_text("evaluation: {limit: 2, samples: 1, max_new_tokens: 4, dtype: float32, batch_size: 4}\n"
                     "resources: {train: {gpu: 0}, evaluate: {gpu: 0}, quantize: {gpu: 0}}\n")
    target = "results/eval/qwen2.5-coder-0.5b/bf16/untrained/none/seed0/gsm8k_test500.json"
    snakemake(*cfg, str(small), "--cores", "1", "--directory", str(tmp_path), target)
    summary = json.loads((tmp_path / target).read_text())
    assert summary["problems"] == 2 and summary["model_source"] == "gguf"
    assert summary["model_dequantized_from"] == "Q8_0" and len(summary["per_problem"]) == 2
    assert summary["adapter_sha256"] == "" and summary["device"] == "cpu"
    marker = json.loads((tmp_path / "results/models/qwen2.5-coder-0.5b/qerl_source.json").read_text())
    assert marker["file"] == "tiny.gguf" and marker["dequantized"]


# --- SLURM: the workflow through snakemake-executor-plugin-slurm on a real single-node SLURM -----------------------

def _slurm_missing() -> str | None:
    """Why this machine cannot run the SLURM test, or None (sbatch and friends on PATH, a node up, the plugin)."""
    import importlib.util

    for exe in ("sbatch", "squeue", "sinfo", "scancel"):
        if shutil.which(exe) is None:
            return f"{exe} is not on PATH (`bash .ci/slurm-localhost.sh` installs and starts a one-node SLURM)"
    up = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True)
    if up.returncode != 0 or not any(s.startswith(("idle", "mix", "alloc")) for s in up.stdout.split()):
        return f"no SLURM node is up (sinfo: {(up.stdout + up.stderr).strip()[:200] or 'nothing'})"
    if importlib.util.find_spec("snakemake_executor_plugin_slurm") is None:
        return "snakemake-executor-plugin-slurm is not installed (pip install -e '.[slurm]')"
    return None


def _need_slurm() -> None:
    """Skip, saying why, where SLURM is not running; under QERL_REQUIRE_SLURM=1 (CI) that is a failure instead."""
    why = _slurm_missing()
    if why and os.environ.get("QERL_REQUIRE_SLURM") == "1":
        pytest.fail(f"QERL_REQUIRE_SLURM=1 but {why}")
    if why:
        pytest.skip(why)


def _slurm_jobs() -> dict[str, tuple[str, str]]:
    """Every job SLURM still lists (MinJobAge keeps finished ones): ``{id: (state, comment)}``; the executor plugin
    comments each job with its rule (``rule_train_<wildcards>``)."""
    out = subprocess.run(["squeue", "--states=all", "-h", "-o", "%i|%T|%k"], capture_output=True, text=True,
                         check=True).stdout
    return {i: (state, comment) for i, state, comment in (line.split("|", 2) for line in out.splitlines() if line)}


# the project's own profile; squeue for job states (this SLURM has no accounting database: sacct says so), status
# polled every 2 s instead of the plugin's 40 s start; no retry, so a cancelled job fails this invocation
SLURM = ("--workflow-profile", "workflow/profiles/slurm", "--slurm-status-command", "squeue",
         "--slurm-init-seconds-before-status-checks", "1", "--seconds-between-status-checks", "2", "--retries", "0")


@pytest.mark.xdist_group("default_run")  # (the default run it is compared with is made once per worker)
def test_the_default_workflow_on_a_real_slurm_cluster(default_run, tmp_path):
    """One chain of the default workflow (warm start, quantize, QeRL seed 0 trained and evaluated, the NVFP4 base
    evaluated) through ``--executor slurm`` with workflow/profiles/slurm on a real SLURM: every job goes through
    sbatch; the training job, cancelled with scancel after its first checkpoint, resumes from it on the next
    invocation; the results are the bytes of the local run's; a rerun submits nothing."""
    _need_slurm()
    repo, _, _ = default_run
    run, untrained = "tiny-qwen2/qerl/grpo/synthetic/seed0", "tiny-qwen2/nvfp4/untrained/none/seed0"
    targets = (f"results/eval/{run}/synthetic_test.json", f"results/eval/{untrained}/synthetic_test.json")
    other = fresh_copy(tmp_path / "qerl")
    known = set(_slurm_jobs())
    # 1. the training job is cancelled (scancel) once its first checkpoint is written
    proc = snakemake(*SLURM, *targets, cwd=other, popen=True)
    state = other / "results/train" / run / "checkpoint/trainer_state.json"
    cancelled = None
    deadline = time.time() + 420
    while time.time() < deadline and proc.poll() is None and cancelled is None:
        if state.is_file():
            train = [i for i, (st, c) in _slurm_jobs().items() if i not in known and c.startswith("rule_train_")
                     and st == "RUNNING"]
            if train:
                seen = subprocess.run([str(BIN / "qerl"), "status", "results"], cwd=other, capture_output=True,
                                      text=True)  # (while Snakemake runs: the job is running on SLURM)
                subprocess.run(["scancel", train[0]], check=True)
                cancelled = train[0]
                assert seen.returncode == 0 and re.search(rf"{run}\s+running\s+\d+/40 .*SLURM", seen.stdout), \
                    seen.stdout + seen.stderr
        time.sleep(0.05)
    log, _ = proc.communicate(timeout=300)
    assert cancelled, f"the training job was not seen running with a checkpoint:\n{log[-3000:]}"
    assert proc.returncode != 0 and not (other / "results/train" / run / "summary.json").exists(), log[-3000:]
    assert _slurm_jobs()[cancelled][0] == "CANCELLED"
    # 2. the next invocation submits the unfinished jobs again; the training job resumes from its checkpoint
    snakemake(*SLURM, *targets, cwd=other)
    train_log = (other / "logs/train" / f"{run}.log").read_text()
    assert re.search(r"resuming from .*checkpoint \(step (10|20|30)\)", train_log), train_log[-2000:]
    ours = {i: v for i, v in _slurm_jobs().items() if i not in known}
    rules = [c.split("_wildcards_")[0].removeprefix("rule_") for _, c in ours.values()]
    assert sorted(rules) == ["build_tiny_model", "evaluate_trained", "evaluate_untrained", "quantize", "train",
                             "train", "warm_start"], ours  # (the cancelled training job, then its resumption)
    assert all(st == "COMPLETED" for i, (st, _) in ours.items() if i != cancelled), ours
    # 3. what SLURM computed is what the local run computed, byte for byte (timings aside)
    a, b = _result_view(repo / "results", run, untrained), _result_view(other / "results", run, untrained)
    assert a.keys() == b.keys() and not [k for k in a if a[k] != b[k]], \
        f"the SLURM run differs from the local run in {[k for k in a if a[k] != b[k]]}"
    # 4. a rerun submits nothing
    again = snakemake(*SLURM, *targets, cwd=other)
    assert "Nothing to be done" in again.stdout + again.stderr
    assert not set(_slurm_jobs()) - set(ours) - known  # no new job (old ones may age out: MinJobAge)


def test_a_slurm_profile_with_a_missing_partition_stops_before_any_job(tmp_path):
    """A partition this cluster lacks (set on the command line, as a profile would) is one line naming it and the
    partitions sinfo lists, before anything is submitted or written."""
    _need_slurm()
    other = fresh_copy(tmp_path / "qerl")
    known = set(_slurm_jobs())
    out = snakemake(*SLURM, "--default-resources", "slurm_partition=no-such-partition", cwd=other, check=False)
    said = out.stdout + out.stderr
    assert out.returncode != 0
    assert "SLURM partition 'no-such-partition' (default-resources slurm_partition) is not a partition of this " \
           "cluster; sinfo lists:" in said, said[-2000:]
    assert not set(_slurm_jobs()) - known and not (other / "results/models").exists()


def test_the_readmes_paper_commands_plan_the_matrix(tmp_path):
    """The README's commands for the paper, as printed (each as a dry run, in an empty directory): the matrix plans
    on one 8-GPU box and through the SLURM profile (where SLURM runs here; CI always)."""
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"```bash\npip install -e \"\.\[gpu,slurm\]\".*?```", readme, re.S).group(0)
    commands = [shlex.split(line, comments=True) for line in block.splitlines() if line.startswith("snakemake ")]
    assert len(commands) == 3 and any("workflow/profiles/slurm" in c for c in commands)
    for cmd in commands:
        if "workflow/profiles/slurm" in cmd:
            _need_slurm()
            cmd = [*cmd, "--slurm-status-command", "squeue"]
        args = [a if not a.startswith("config/") else str(ROOT / a) for a in cmd[1:]]
        if "workflow/profiles/slurm" in cmd:
            args[args.index("workflow/profiles/slurm")] = str(ROOT / "workflow/profiles/slurm")
        out = snakemake(*args, *([] if "-n" in args else ["-n"]), "--directory", str(tmp_path))
        assert _jobs(out.stdout + out.stderr)["train"] == 20, cmd


def test_the_readmes_own_model_config_plans_its_matrix(tmp_path, tiny_dirs):
    """The README's "With the workflow" config, its model path pointed at a model directory here: the dry run plans
    2 methods x 2 seeds of training on it, and quantizes it once for QeRL."""
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"```yaml\n# mine\.yaml\n(.*?)```", readme, re.S).group(1)
    assert "/data/models/my-model" in block
    (tmp_path / "mine.yaml").write_text(block.replace("/data/models/my-model", str(tiny_dirs["qwen2"])))
    cmd = re.search(r"^\.venv/bin/snakemake (--cores all --configfile config/config\.yaml mine\.yaml)$", readme, re.M)
    args = [str(ROOT / a) if a.startswith("config/") else str(tmp_path / a) if a == "mine.yaml" else a
            for a in shlex.split(cmd.group(1))]
    out = snakemake(*args, "-n", "--directory", str(tmp_path))
    jobs = _jobs(out.stdout + out.stderr)
    assert jobs["train"] == 4 and jobs["quantize"] == 1, jobs
