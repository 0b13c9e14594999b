"""``qerl status``: where every training job of a workflow's results tree stands, while it runs (locally or on SLURM).

Read only from the files the jobs write as they go (``metrics.jsonl`` row by row, ``summary.json`` at the end, the
job's log under ``logs/train/``) and, where SLURM is there, ``squeue`` (a job waiting for its allocation). Writes
nothing. Per run: the state (finished / running / failed / stopped / queued / not started), step / total, the last
step's reward, seconds a step (the mean of the last few), and the time left at that pace.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

RECENT_S = 300.0  # a run whose metrics or log changed this recently is running
PACE_ROWS = 5  # seconds a step: the mean of the last this many steps


class StatusError(ValueError):
    """The directory is not a results tree (one line)."""


@dataclass(frozen=True)
class RunStatus:
    run: str  # model/method/algo/dataset/seedN
    state: str  # finished | running | failed | stopped | queued | not started
    step: int
    total: int | None
    reward: float | None
    seconds_per_step: float | None
    note: str = ""

    @property
    def eta_s(self) -> float | None:
        if self.state in ("finished", "failed") or self.total is None or self.seconds_per_step is None:
            return None
        return max(0, self.total - self.step) * self.seconds_per_step


def check_results_tree(results: Path) -> None:
    if not results.is_dir():
        raise StatusError(f"{results}: {'is a file, not' if results.exists() else 'no such directory: expected'} a "
                          "workflow's results directory (results/, with train/ and eval/)")
    if not any((results / d).is_dir() for d in ("train", "eval", "config")):
        raise StatusError(f"{results}: not a results tree (no train/, eval/ or config/ in it): point qerl status at "
                          "the workflow's results directory")


def planned_runs(results: Path, configuration: str | None) -> tuple[str | None, list[str]]:
    """The configuration's training runs (``model/method/algo/dataset/seedN``) from its effective config
    (``results/config/<configuration>.yaml``, written when an invocation starts), with the configuration's name;
    without one, the runs found under ``results/train``."""
    import yaml

    from qerl.workflow_config import runs

    configs = sorted((results / "config").glob("*.yaml")) if (results / "config").is_dir() else []
    if configuration is not None:
        path = results / "config" / f"{configuration}.yaml"
        if not path.is_file():
            raise StatusError(f"--configuration {configuration}: no {path} (known: "
                              f"{', '.join(p.stem for p in configs) or 'none'})")
        configs = [path]
    elif len(configs) > 1:
        configs = [max(configs, key=lambda p: p.stat().st_mtime)]  # the latest invocation's
    if configs:
        config = yaml.safe_load(configs[0].read_text()) or {}
        return configs[0].stem, [r.path for r in runs(config)]
    found = sorted(str(p.parent.relative_to(results / "train")) for p in (results / "train").glob("*/*/*/*/seed*/train.yaml"))
    return None, found


def _rows(path: Path) -> list[dict]:
    out = []
    if not path.is_file():
        return out
    for line in path.read_text(errors="replace").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # (a row being written)
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            out.append(row)
    return out


def _total(run_dir: Path) -> int | None:
    import yaml

    for name in ("config.json", "train.yaml"):
        p = run_dir / name
        if p.is_file():
            try:
                data = json.loads(p.read_text()) if name.endswith(".json") else yaml.safe_load(p.read_text())
                return int(data["steps"])
            except (ValueError, KeyError, TypeError, yaml.YAMLError):
                continue
    return None


def _failure(log: Path) -> str | None:
    """The log's last line when the job ended on an error (qerl's one-line errors, or a traceback's last line)."""
    if not log.is_file():
        return None
    lines = [x for x in log.read_text(errors="replace").splitlines() if x.strip()]
    if not lines:
        return None
    last = lines[-1].strip()
    if last.startswith("qerl ") and ":" in last or "Error" in last.split(":")[0] or "Traceback" in "\n".join(lines[-30:]):
        return last[:160]
    return None


def slurm_queue() -> dict[str, str]:
    """``{rule_train_wildcards_... comment: state}`` of this user's SLURM jobs (empty without SLURM)."""
    if shutil.which("squeue") is None:
        return {}
    try:
        done = subprocess.run(["squeue", "--me", "-h", "-o", "%k|%T"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return {}
    return dict(line.split("|", 1) for line in done.stdout.splitlines() if "|" in line)


def run_status(results: Path, run: str, queue: dict[str, str], now: float) -> RunStatus:
    run_dir = results / "train" / run
    rows = _rows(run_dir / "metrics.jsonl")
    step = rows[-1]["step"] if rows else 0
    reward = rows[-1].get("reward_mean") if rows else None
    recent = rows[-PACE_ROWS:]
    pace = [r.get("rollout_seconds", 0) + r.get("train_seconds", 0) for r in recent if "rollout_seconds" in r]
    spp = sum(pace) / len(pace) if pace else None
    total = _total(run_dir)
    log = results.parent / "logs" / "train" / f"{run}.log"
    model, method, algo, dataset, seed = run.split("/")
    slurm = queue.get(f"rule_train_wildcards_{model}_{method}_{algo}_{dataset}_{seed.removeprefix('seed')}")
    if (run_dir / "summary.json").is_file():
        return RunStatus(run, "finished", step, total, reward, spp)
    touched = max([p.stat().st_mtime for p in (run_dir / "metrics.jsonl", log) if p.is_file()], default=None)
    if slurm in ("RUNNING", "COMPLETING") or (touched is not None and now - touched < RECENT_S and not _failure(log)):
        return RunStatus(run, "running", step, total, reward, spp, "SLURM" if slurm else "")
    if slurm in ("PENDING", "CONFIGURING"):
        return RunStatus(run, "queued", step, total, reward, spp, "SLURM: waiting for its allocation")
    if (why := _failure(log)) is not None:
        return RunStatus(run, "failed", step, total, reward, spp, why)
    if rows:
        return RunStatus(run, "stopped", step, total, reward, spp, "not running; a rerun resumes it from its checkpoint")
    return RunStatus(run, "not started", 0, total, None, None)


def _clock(s: float | None) -> str:
    if s is None:
        return "—"
    s = int(round(s))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def table(statuses: list[RunStatus], configuration: str | None) -> str:
    head = ["run", "state", "step", "reward", "s/step", "ETA", "note"]
    body = [[s.run, s.state, f"{s.step}/{s.total if s.total is not None else '?'}",
             "—" if s.reward is None else f"{s.reward:.3f}",
             "—" if s.seconds_per_step is None else f"{s.seconds_per_step:.{2 if s.seconds_per_step < 10 else 0}f}",
             _clock(s.eta_s), s.note]
            for s in statuses]
    widths = [max(len(r[i]) for r in [head, *body]) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [head, *body]]
    counts = {}
    for s in statuses:
        counts[s.state] = counts.get(s.state, 0) + 1
    title = f"configuration {configuration!r}: " if configuration else ""
    return "\n".join([f"{title}{len(statuses)} training run(s): " +
                      ", ".join(f"{n} {k}" for k, n in counts.items()), *lines])


def status(results: Path, configuration: str | None = None) -> tuple[str | None, list[RunStatus]]:
    check_results_tree(results)
    name, planned = planned_runs(results, configuration)
    queue, now = slurm_queue(), time.time()
    return name, [run_status(results, r, queue, now) for r in planned]
