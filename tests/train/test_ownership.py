"""A run's output directory is owned: a kill at each instant of a checkpoint replacement leaves a complete checkpoint
(and the next start resumes the newest one), a second writer is refused at once, Ctrl-C says what is intact,
--overwrite / --resume / --auto-resume do what they say, and a library call cannot restart over a run."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from qerl.train.loop import DETERMINISTIC_METRICS

CFG = {
    "method": "qerl", "steps": 3, "prompts_per_step": 2, "micro_batch_size": 8, "checkpoint_every": 1, "device": "cpu",
    "model": {"dtype": "float32"}, "data": {"task": "synthetic", "synthetic_size": 64},
    "rollout": {"max_new_tokens": 4}, "algorithm": {"group_size": 2}, "lora": {"r": 4, "alpha": 8},
    "aqn": {"sigma_start": 0.05, "sigma_end": 0.01, "stages": 1},
    "reward": {"correctness": "exact"}, "optim": {"lr": 0.003}, "tracking": {"backend": "none"},
}


def config(tmp_path: Path, model: Path, name: str, **over) -> Path:
    cfg = json.loads(json.dumps(CFG))
    cfg.update(over, output_dir=str(tmp_path / name))
    cfg["model"]["path"] = str(model)
    p = tmp_path / f"{name}.yaml"
    p.write_text(yaml.safe_dump(cfg))
    return p


def qerl(*args, env=None, popen=False):
    cmd = [sys.executable, "-m", "qerl", *map(str, args)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    if popen:  # stdout (a line per step) dropped and stderr to a file: a pipe nobody reads would fill and block the run
        err = tempfile.TemporaryFile("w+")
        # (Ctrl-C's default action in the child even where this runs with SIGINT ignored, as a shell's background job
        # does and every child inherits: Python then installs no KeyboardInterrupt handler and a SIGINT does nothing)
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=err, text=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        proc._qerl_stderr = err
        return proc
    return subprocess.run(cmd, env=env, capture_output=True, text=True)


def stderr_of(proc) -> str:
    """What a :func:`qerl` ``popen=True`` process wrote to stderr so far."""
    f = proc._qerl_stderr
    f.seek(0)
    return f.read()


def rows(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]


def step_of(ckpt: Path) -> int | None:
    f = ckpt / "trainer_state.json"
    return json.loads(f.read_text())["step"] if f.exists() else None


@pytest.fixture(scope="module")
def reference(warm_model, tmp_path_factory):
    """The uninterrupted run every interrupted one must reproduce."""
    tmp = tmp_path_factory.mktemp("ref")
    r = qerl("train", "--config", config(tmp, warm_model, "ref"), "--no-progress")
    assert r.returncode == 0, r.stderr[-2000:]
    return rows(tmp / "ref")


@pytest.mark.parametrize("point", ["written:2", "aside:1", "swapped:2"])  # (the first write has nothing to put aside)
def test_a_kill_at_each_instant_of_the_checkpoint_swap_loses_nothing(point, warm_model, reference, tmp_path):
    """Killed while replacing the step-1 checkpoint by step 2's: a complete checkpoint is reachable (``aside`` is the
    two-rename path of file systems without an exchange: the complete directories beside it), and --auto-resume
    (what the workflow passes) continues from the newest complete one, reproducing the uninterrupted run."""
    cfg = config(tmp_path, warm_model, "run")
    out = tmp_path / "run"
    killed = qerl("train", "--config", cfg, "--no-progress", env={"QERL_FAULT_CHECKPOINT": point})
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    beside = {p.name.split("-")[0]: step_of(p) for p in out.glob(".checkpoint.*")}
    if point.startswith("aside"):
        assert not (out / "checkpoint").exists() and beside == {".checkpoint.old": 1, ".checkpoint.tmp": 2}
    else:
        assert step_of(out / "checkpoint") == (1 if point.startswith("written") else 2)
    resumed = qerl("train", "--config", cfg, "--no-progress", "--auto-resume")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resuming from" in resumed.stdout and "(step 2)" in resumed.stdout
    assert not list(out.glob(".checkpoint.*"))  # leftovers cleared
    got = rows(out)
    assert [r["step"] for r in got] == [1, 2, 3]
    for a, b in zip(reference, got):
        assert {k: a[k] for k in DETERMINISTIC_METRICS} == {k: b[k] for k in DETERMINISTIC_METRICS}, a["step"]


def test_second_writer_refused_at_once_and_ctrl_c_says_what_is_intact(warm_model, tmp_path):
    cfg = config(tmp_path, warm_model, "run", steps=100_000)  # interrupted long before (200 could finish)
    out = tmp_path / "run"
    first = qerl("train", "--config", cfg, "--no-progress", popen=True, env={"PYTHONFAULTHANDLER": "1"})
    lock = tmp_path / ".run.lock"
    for _ in range(6000):  # until the first one holds the lock and has written a checkpoint
        if step_of(out / "checkpoint") and lock.exists() or first.poll() is not None:
            break
        time.sleep(0.02)
    assert first.poll() is None, stderr_of(first)[-2000:]
    for extra in ([], ["--auto-resume"], ["--resume"], ["--overwrite"]):
        second = qerl("train", "--config", cfg, "--no-progress", *extra)
        assert second.returncode == 2 and f"{out} is in use by PID {first.pid}" in second.stderr, second.stderr
        assert "Traceback" not in second.stderr
    first.send_signal(signal.SIGINT)
    try:
        code = first.wait(timeout=120)
    except subprocess.TimeoutExpired:  # where it hangs: SIGABRT makes faulthandler print every thread's stack
        first.send_signal(signal.SIGABRT)
        first.wait(timeout=60)
        raise AssertionError("no exit 120 s after Ctrl-C:\n" + stderr_of(first)[-6000:]) from None
    assert code == 130
    err = stderr_of(first)
    assert "Traceback" not in err and "interrupted at step" in err, err
    saved = step_of(out / "checkpoint")
    assert f"the checkpoint of step {saved} ({out / 'checkpoint'}) is intact" in err
    assert not lock.exists()  # the lock is gone with its holder; the run goes on
    again = qerl("train", "--config", config(tmp_path, warm_model, "run", steps=saved + 1), "--no-progress",
                 "--auto-resume")
    assert again.returncode == 0, again.stderr[-2000:]
    assert [r["step"] for r in rows(out)] == list(range(1, saved + 2))


def test_refuse_overwrite_and_extend_a_finished_run(warm_model, tmp_path):
    cfg = config(tmp_path, warm_model, "run", steps=2)
    out = tmp_path / "run"
    first = qerl("train", "--config", cfg, "--no-progress")
    assert first.returncode == 0
    logged = [x for x in first.stdout.splitlines() if x.startswith("step ")]  # without a bar: a line per step
    assert [x.split()[1] for x in logged] == ["1/2", "2/2"]
    assert all("reward" in x and "accuracy" in x and "elapsed" in x for x in logged)
    before = (out / "metrics.jsonl").read_bytes()
    for extra in ([], ["--set", "steps=1"]):
        r = qerl("train", "--config", cfg, "--no-progress", *extra)
        assert r.returncode == 2 and "holds a finished run (2 steps" in r.stderr and "--overwrite" in r.stderr
    assert (out / "metrics.jsonl").read_bytes() == before
    r = qerl("train", "--config", cfg, "--no-progress", "--resume", "--set", "steps=3")  # a longer run continues
    assert r.returncode == 0, r.stderr[-2000:]
    assert [x["step"] for x in rows(out)] == [1, 2, 3] and (out / "metrics.jsonl").read_bytes().startswith(before)
    r = qerl("train", "--config", cfg, "--no-progress", "--overwrite", "--set", "steps=1")
    assert r.returncode == 0, r.stderr[-2000:]
    assert [x["step"] for x in rows(out)] == [1] and step_of(out / "checkpoint") == 1
    assert json.loads((out / "summary.json").read_text())["steps"] == 1


def test_rerun_continues_its_own_run_and_replaces_one_of_other_settings(warm_model, tmp_path):
    """``--rerun`` (the workflow's): a finished run of the same config is continued (nothing retrained, the metrics
    kept byte for byte); a changed config (Snakemake reruns the job because its train.yaml changed) starts over,
    says why, and touches nothing the run did not write; logged steps without a checkpoint start over too."""
    from qerl.train import ownership

    cfg = config(tmp_path, warm_model, "run", steps=2)
    out = tmp_path / "run"
    assert qerl("train", "--config", cfg, "--no-progress").returncode == 0
    before = (out / "metrics.jsonl").read_bytes()
    (out / "notes.txt").write_text("mine")
    same = qerl("train", "--config", cfg, "--no-progress", "--rerun")
    assert same.returncode == 0 and "starting over" not in same.stdout and (out / "metrics.jsonl").read_bytes() == before
    changed = qerl("train", "--config", cfg, "--no-progress", "--rerun", "--set", "optim.lr=0.001")
    assert changed.returncode == 0, changed.stderr[-2000:]
    assert "holds a run with other settings (optim.lr: 0.003 -> 0.001)" in changed.stdout
    assert "starting over" in changed.stdout and (out / "notes.txt").read_text() == "mine"
    assert [x["step"] for x in rows(out)] == [1, 2] and (out / "metrics.jsonl").read_bytes() != before
    assert json.loads((out / "config.json").read_text())["optim"]["lr"] == 0.001
    manifest = warm_model / "qerl_files.json"  # the base rewritten (a rerun warm start: the same file sizes)
    assert manifest.is_file()  # (sft writes one, as every qerl model writer does)
    saved = manifest.read_text()
    assert json.loads((out / "inputs.json").read_text())["model"] == json.loads(saved)["written"]
    manifest.write_text(json.dumps({**json.loads(saved), "written": "f" * 32}))
    try:
        again = qerl("train", "--config", cfg, "--no-progress", "--rerun", "--set", "optim.lr=0.001")
    finally:
        manifest.write_text(saved)
    assert again.returncode == 0 and "an earlier version of its base model" in again.stdout
    cut = tmp_path / "cut"  # killed before its first checkpoint: its config, metrics, no checkpoint
    cut.mkdir()
    (cut / "config.json").write_text((out / "config.json").read_text())
    (cut / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward_mean": 0.5}) + "\n")
    assert ownership.prepare(cut, "rerun") is False and not (cut / "metrics.jsonl").exists()


def test_rerun_and_overwrite_never_replace_a_metrics_file_qerl_did_not_write(warm_model, tmp_path):
    """A ``metrics.jsonl`` of someone else's (no ``config.json`` of qerl train beside it: qerl writes that before its
    first row) in the output directory: ``--rerun`` and ``--overwrite`` refuse and name it, and it is kept byte for
    byte."""
    from qerl.train import ownership

    mine = tmp_path / "mine"
    mine.mkdir()
    theirs = "".join(json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in (1, 2, 3))
    (mine / "metrics.jsonl").write_text(theirs)
    for mode in ("rerun", "overwrite", "new", "auto"):
        with pytest.raises(ownership.OwnershipError, match=r"holds files that are not a qerl run's \(metrics.jsonl "
                                                           r"\(without the config.json qerl train writes"):
            ownership.prepare(mine, mode)
    cli = qerl("train", "--config", config(tmp_path, warm_model, "mine", steps=1), "--no-progress", "--rerun")
    assert cli.returncode != 0 and "metrics.jsonl (without the config.json" in cli.stderr + cli.stdout
    assert "Traceback" not in cli.stderr and (mine / "metrics.jsonl").read_text() == theirs


def test_library_call_cannot_restart_over_a_run(warm_model, tmp_path):
    from qerl.tracking import NullTracker
    from qerl.train.config import load_config
    from qerl.train.loop import train
    from qerl.train.ownership import OwnershipError

    cfg = load_config(config(tmp_path, warm_model, "run", steps=1))
    train(cfg, tracker=NullTracker(), progress=False)
    with pytest.raises(OwnershipError, match="holds a finished run"):
        train(cfg, tracker=NullTracker(), progress=False)


def test_recover_swap_picks_the_newest_complete_version(tmp_path):
    from qerl.checkpoint import recover_swap
    from qerl.train.ownership import recover

    out = tmp_path / "run"
    for name, step, complete in (("checkpoint", 3, True), (".checkpoint.tmp-a", 5, True),
                                 (".checkpoint.tmp-b", 6, False), (".checkpoint.old-c", 2, True)):
        (out / name).mkdir(parents=True)
        (out / name / "trainable.safetensors").write_text(str(step))
        if complete:
            (out / name / "trainer_state.json").write_text(json.dumps({"step": step}))
    assert "recovered the complete version 5" in recover(out)
    assert step_of(out / "checkpoint") == 5 and sorted(p.name for p in out.iterdir()) == ["checkpoint"]
    assert recover(out) is None  # nothing left to do
    assert recover_swap(tmp_path / "absent", len, bool) is None
