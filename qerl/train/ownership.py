"""What ``qerl train`` may do with its ``output_dir``: start, resume, refuse, or (asked explicitly) start over.

A directory that holds a started or finished run (metric rows, a checkpoint, ``final/``, ``summary.json``) is
never overwritten by a retyped command: a plain ``qerl train`` refuses and says what is there; ``--resume``
continues from the checkpoint; ``--auto-resume`` resumes when there is a checkpoint and refuses — never restarts from
step 0 — a run that has metrics but none; ``--rerun`` (what the workflow passes: Snakemake reruns a job whose inputs
changed, and its output is then to be replaced) continues a checkpoint of this very run (a killed job) and otherwise
starts over as ``--overwrite`` does, saying why; ``--overwrite`` removes the run's files and starts over. A checkpoint replacement a crash interrupted is finished first (:func:`qerl.checkpoint.recover_swap`),
so the newest complete checkpoint is the one resumed. Light: no torch.
"""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from qerl.checkpoint import CheckpointError, recover_swap

CHECKPOINT = "checkpoint"
RUN_FILES = ("metrics.jsonl", "summary.json", "config.json", "inputs.json", "final", CHECKPOINT)
#: ``inputs.json``: the identity of the base model directory the run started from (:func:`record_inputs`)
INPUTS = "inputs.json"
MODES = ("new", "resume", "auto", "rerun", "overwrite")
# settings a resumed run may change (how long, how often, where it runs and logs); any other difference between
# the checkpoint's run and this one would silently continue one experiment under another's settings
RESUMABLE_CHANGES = ("steps", "checkpoint_every", "micro_batch_size", "micro_batch_tokens", "device",
                     "gradient_checkpointing", "dense_update", "packed_sequences", "optim.offload", "tracking",
                     "sharding", "rollout.release_cache")  # (a checkpoint another sharding cannot read is refused by
# load_checkpoint; config.json holds the resolved plan, a rerun's config its `auto`s: these may differ)


class OwnershipError(ValueError):
    """The output directory holds a run this command must not touch as asked."""


@dataclass(frozen=True)
class RunStatus:
    metric_rows: int  # rows of metrics.jsonl
    last_step: int  # the highest step in metrics.jsonl (0 if none)
    checkpoint_step: int | None  # step of the complete checkpoint, None if there is none
    finished: bool  # summary.json present (written last)
    has_final: bool

    @property
    def empty(self) -> bool:
        return not (self.metric_rows or self.checkpoint_step is not None or self.finished or self.has_final)

    def describe(self) -> str:
        if self.finished:
            what = f"a finished run ({self.last_step} steps, summary.json"
        elif self.empty:
            return "no run"
        else:
            what = f"a started run ({self.last_step} step(s) logged"
        ckpt = "no checkpoint" if self.checkpoint_step is None else f"checkpoint of step {self.checkpoint_step}"
        return f"{what}, {ckpt}{', final/' if self.has_final else ''})"


def checkpoint_step(path: Path) -> int | None:
    """The step of a complete checkpoint directory (its ``trainer_state.json``, written last), else None."""
    f = Path(path) / "trainer_state.json"
    try:
        return int(json.loads(f.read_text())["step"])
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError, json.JSONDecodeError):
        raise CheckpointError(f"{f}: unreadable (not a trainer state written by qerl train)") from None


def status(out: Path) -> RunStatus:
    out = Path(out)
    rows, last = 0, 0
    metrics = out / "metrics.jsonl"
    if metrics.exists():
        lines = metrics.read_text().splitlines()
        for i, line in enumerate(lines):
            if not line.strip():
                continue
            try:
                step = int(json.loads(line)["step"])
            except (ValueError, KeyError, TypeError, json.JSONDecodeError):
                if i == len(lines) - 1 and cut_off_tail(metrics):
                    break  # a row cut off by a kill mid-write: the resumed run drops it (loop._truncate_metrics)
                raise CheckpointError(f"{metrics}: line {i + 1} is not a metrics row of qerl train") from None
            rows, last = rows + 1, max(last, step)
    ckpt = out / CHECKPOINT
    return RunStatus(rows, last, checkpoint_step(ckpt) if ckpt.is_dir() else None,
                     (out / "summary.json").exists(), (out / "final").exists())


def cut_off_tail(metrics: Path) -> bool:
    """Whether ``metrics.jsonl`` ends in a row without its newline (every row is written whole with one; a kill in
    the middle of that write leaves this)."""
    data = Path(metrics).read_bytes()
    return bool(data) and not data.endswith(b"\n")


#: files that mark ``final/`` and ``checkpoint/`` as qerl train's (one of them must be there)
MARKERS = {"final": ("adapter_config.json", "config.json"),
           CHECKPOINT: ("trainer_state.json", "trainer_state.pt", "trainable.safetensors")}


def foreign_run_files(out: Path) -> list[str]:
    """Names under ``out`` that look like a run's but are not qerl train's: a ``final/`` or ``checkpoint/`` without
    any file qerl writes there, a ``summary.json`` that is no run summary, a ``metrics.jsonl`` without the run's
    ``config.json``. ``--overwrite`` and ``--rerun`` would delete them."""
    out, bad = Path(out), []
    for sub, markers in MARKERS.items():
        d = out / sub
        if d.exists() and not d.is_dir():
            bad.append(sub)
        elif d.is_dir() and any(d.iterdir()) and not any((d / m).exists() for m in markers):
            bad.append(f"{sub}/{sorted(p.name for p in d.iterdir())[0]}")
    metrics = out / "metrics.jsonl"  # (qerl train writes its config.json before its first row)
    if metrics.is_file() and metrics.stat().st_size and not (out / "config.json").is_file():
        bad.append("metrics.jsonl (without the config.json qerl train writes before its first row)")
    summary = out / "summary.json"
    if summary.exists():
        try:
            ok = isinstance(data := json.loads(summary.read_text()), dict) and {"method", "steps"} <= set(data)
        except (ValueError, UnicodeDecodeError, OSError):
            ok = False
        if not ok:
            bad.append("summary.json")
    return bad


def not_removable(out: Path) -> list[str]:
    """What ``--overwrite`` must not delete under ``out``: a run file that is a symbolic link (its target is not the
    run's), and inside ``final/`` / ``checkpoint/`` anything their manifests do not list (:mod:`qerl.owned`)."""
    from qerl.owned import unlisted

    bad = []
    for name in RUN_FILES:
        p = Path(out) / name
        if p.is_symlink():
            bad.append(f"{name} (a symbolic link to {os.readlink(p)})")
        elif p.is_dir():
            bad += [f"{name}/{x}" for x in unlisted(p)]
    return bad


def recover(out: Path) -> str | None:
    """Finish an interrupted checkpoint replacement in ``out`` (the newest complete checkpoint wins)."""
    def version(p: Path) -> int:
        return checkpoint_step(p) or -1

    return recover_swap(Path(out) / CHECKPOINT, version, lambda p: checkpoint_step(p) is not None)


def prepare(out: Path, mode: str, config: dict | None = None) -> bool:
    """Decide what to do with ``out`` for ``mode`` (new | resume | auto | overwrite): returns whether to resume;
    raises :class:`OwnershipError` naming what is there and the ways on. ``config``: this run's resolved config,
    compared on resume with the one the checkpoint's run wrote (``config.json``)."""
    out = Path(out)
    if mode not in MODES:
        raise ValueError(f"mode {mode!r} is not one of {MODES}")
    if out.exists() and not out.is_dir():
        raise OwnershipError(f"output_dir {out} is a file, not a directory")
    if config is not None:
        from qerl.outputs import check_not_input

        check_not_input(out, {"model.path": config["model"]["path"], "data.path": config["data"]["path"]},
                        "output_dir")
    if out.is_dir():
        _check_not_foreign(out)
        if bad := foreign_run_files(out):
            raise OwnershipError(f"output_dir {out} holds files that are not a qerl run's ({', '.join(bad[:3])}): "
                                 "training would overwrite them and --overwrite would delete them; choose another "
                                 "output_dir")
    note = recover(out) if out.is_dir() else None
    if note:
        print(note, flush=True)
    st = status(out) if out.is_dir() else RunStatus(0, 0, None, False, False)
    ways = ("continue it with --resume (or --auto-resume), start over with --overwrite (its files are deleted), or "
            "set another output_dir")
    if mode == "rerun":
        why = _rerun_reason(out, st, config)
        if why is None:
            return st.checkpoint_step is not None
        print(f"qerl train --rerun: {out} {why}: starting over (the run's files are replaced; nothing else in the "
              "directory is touched)", flush=True)
        mode = "overwrite"
    if mode == "overwrite":
        if in_way := not_removable(out):
            raise OwnershipError(f"--overwrite: output_dir {out} holds {', '.join(in_way[:3])}, which qerl train did "
                                 "not write; nothing was deleted: move them out or set another output_dir")
        for name in RUN_FILES:
            p = out / name
            if p.is_dir():
                shutil.rmtree(p)
            elif p.exists():
                p.unlink()
        return False
    if mode == "new":
        if not st.empty:
            raise OwnershipError(f"output_dir {out} holds {st.describe()}: {ways}")
        return False
    if st.checkpoint_step is None:
        if mode == "resume":
            raise OwnershipError(f"--resume: {out / CHECKPOINT} does not exist (the directory holds {st.describe()}); "
                                 "start without --resume" + ("" if st.empty else ", with --overwrite"))
        if not st.empty:  # auto: never restart from step 0 over a run that logged steps
            raise OwnershipError(
                f"--auto-resume: output_dir {out} holds {st.describe()} but no checkpoint to resume from (it stopped "
                f"before its first checkpoint): rerun with --overwrite to start over, or remove {out}")
        return False
    if config is not None:
        _check_same_run(out, config)
        steps = int(config.get("steps") or 0)
        if st.finished and steps < st.last_step:
            raise OwnershipError(f"output_dir {out} holds {st.describe()}: resuming it with steps={steps} would run "
                                 "nothing and rewrite its final/ under a config that disagrees with its summary; use "
                                 f"steps >= {st.last_step} to train it further, or set another output_dir")
    return True


def base_written(config: dict) -> str | None:
    """The identity of the base model directory ``config`` trains on (its manifest's write id), None for a hub id
    or a directory without a manifest."""
    from qerl.owned import written_id

    path = Path(str((config.get("model") or {}).get("path", "")))
    return written_id(path) if path.is_dir() else None


def record_inputs(out: Path, config: dict) -> None:
    """Write ``inputs.json`` (the base model's write id) when a run starts from step 0."""
    from qerl.checkpoint import write_json

    write_json(Path(out) / INPUTS, {"model": base_written(config)})


def _rerun_reason(out: Path, st: "RunStatus", config: dict | None) -> str | None:
    """Why a workflow job's rerun (``--rerun``) cannot continue what ``out`` holds (``None``: it can: nothing there,
    or a checkpoint of this very run, e.g. a killed job)."""
    if st.empty:
        return None
    if st.checkpoint_step is None:
        return f"holds {st.describe()} but no checkpoint (stopped before its first)"
    if config is not None:
        if shown := _changed_settings(out, config):
            return f"holds a run with other settings ({shown})"
        steps = int(config.get("steps") or 0)
        if st.finished and steps < st.last_step:
            return f"holds {st.describe()}, more steps than steps={steps}"
        rec = out / INPUTS
        if rec.is_file():
            from qerl.readers import InputFileError, read_json

            try:
                was = read_json(rec, "run inputs record").get("model")
            except (InputFileError, AttributeError):  # (unreadable: the base cannot be compared, as without one)
                was = None
            now = base_written(config)
            if was and now and was != now:
                return f"holds a run of an earlier version of its base model {config['model']['path']} (rewritten since)"
    return None


def _check_not_foreign(out: Path) -> None:
    """A directory that holds another tool's files (a model: weights, a config.json that is not a training config)
    is never trained into: the run's files would overwrite them, and --overwrite would delete them."""
    weights = sorted(p.name for p in out.glob("*.safetensors")) + sorted(p.name for p in out.glob("*.bin"))
    cfg = out / "config.json"
    foreign = None
    if weights:
        foreign = f"model weights ({weights[0]})"
    elif cfg.is_file():
        try:
            data = json.loads(cfg.read_text())
            ours = isinstance(data, dict) and {"method", "algorithm", "output_dir"} <= set(data)
        except (ValueError, UnicodeDecodeError):
            ours = False
        if not ours:
            foreign = "a config.json that is not a qerl train config (a model directory?)"
    if foreign:
        raise OwnershipError(f"output_dir {out} holds {foreign}: training would overwrite them; choose another "
                             "output_dir")


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flat(v, f"{key}."))
        else:
            out[key] = v
    return out


def _changed_settings(out: Path, config: dict) -> str | None:
    """The settings (``key: saved -> now``, at most 4 shown) in which ``config`` differs from the run ``out``'s
    ``config.json`` beyond what a resume may change; ``None`` when none differ (or there is no readable one)."""
    saved_path = out / "config.json"
    if not saved_path.exists():
        return None
    try:
        saved = _flat(json.loads(saved_path.read_text()))
    except json.JSONDecodeError:
        return None
    mine, saved = _resolved_like(_flat(config), saved), _resolved_like(saved, {})  # (a run saved before resolving)
    diff = sorted(k for k in set(saved) | set(mine)
                  if saved.get(k) != mine.get(k) and not any(k == c or k.startswith(c + ".") for c in RESUMABLE_CHANGES)
                  and k != "output_dir")
    if not diff:
        return None
    return ", ".join(f"{k}: {saved.get(k)!r} -> {mine.get(k)!r}" for k in diff[:4]) + (", …" if len(diff) > 4 else "")


#: settings whose ``auto`` the run resolves on its machine (config.json holds the resolution, qerl.train.runplan)
MACHINE_RESOLVED = ("optim.eight_bit", "rollout.engine")


def _resolved_like(mine: dict, saved: dict) -> dict:
    """``mine`` (a rerun's config, flat, with its ``auto`` settings) resolved as the saved run resolved them:
    ``aqn.enabled: auto`` to the method's own choice (a change from auto to another value is a change), and the
    :data:`MACHINE_RESOLVED` settings' ``auto`` to whatever the saved run resolved it to."""
    from qerl.methods import METHODS, resolve_aqn

    out = dict(mine)
    if str(out.get("aqn.enabled", "auto")).lower() == "auto" and out.get("method") in METHODS:
        out["aqn.enabled"] = resolve_aqn("auto", METHODS[out["method"]].aqn)
    for key in MACHINE_RESOLVED:
        if str(out.get(key, "auto")).lower() == "auto" and key in saved:
            out[key] = saved[key]
    return out


def _check_same_run(out: Path, config: dict) -> None:
    if shown := _changed_settings(out, config):
        raise OwnershipError(
            f"{out / CHECKPOINT} belongs to a run with other settings ({shown}): "
            f"resuming would continue that run under these; use its settings, start over with --overwrite (in the "
            f"workflow: remove {out}), or set another output_dir")
