"""Fetch once, run offline: every hub model and dataset a workflow config names, downloaded into the Hugging Face
cache by ``qerl fetch`` and pinned in a lock file (the commit each name resolved to); later runs read the lock
(``inputs_lock`` in the workflow config) and use those commits with the hub switched off.

Inputs of a config (:func:`hub_inputs`): ``models.<name>`` with ``source: hub`` (``hub_id`` at ``revision``);
``datasets.<name>`` whose ``task`` is a registered hub task (:data:`qerl.data.tasks.HUB_TASKS`, at the dataset's
``revision`` or the task's); the hub benchmarks of ``evaluation.benchmarks`` and the experiment blocks.

Lock file (YAML, written atomically; commit it beside the config)::

    models:   {qwen2.5-7b: {repo: Qwen/Qwen2.5-7B-Instruct, revision: main, commit: <40 hex>}}
    datasets: {gsm8k: {repo: openai/gsm8k, revision: main, commit: <40 hex>}, gsm8k_test: {...}}

``datasets`` is keyed by task name (training tasks and benchmarks share one namespace). A config may also pin a
commit itself (``revision: <40 hex>``): the lock then records the same commit.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

_COMMIT = re.compile(r"^[0-9a-f]{40}$")


class InputsError(ValueError):
    """A lock file that does not match its config, or an input missing from the local cache."""


@dataclass(frozen=True)
class HubInput:
    """One hub repository a config needs: ``kind`` model | dataset, ``name`` (a model's config key, a dataset's
    task name), ``repo``, the ``revision`` asked for, and for datasets the ``config`` / ``split`` to prepare."""

    kind: str
    name: str
    repo: str
    revision: str
    config: str | None = None
    split: str | None = None


def hub_inputs(config: dict) -> list[HubInput]:
    """The hub models and datasets of a workflow config (each dataset task once)."""
    from qerl.data.tasks import HUB_TASKS
    from qerl.data.tasks import BENCHMARKS

    out: list[HubInput] = []
    for name, m in config.get("models", {}).items():
        if m.get("source") == "hub":
            out.append(HubInput("model", name, m["hub_id"], str(m.get("revision") or "main")))
    tasks: dict[str, str | None] = {}
    for d in config.get("datasets", {}).values():
        if d.get("task") in HUB_TASKS:
            tasks.setdefault(d["task"], d.get("revision"))
    for b in benchmark_names(config):
        if b in BENCHMARKS and b in HUB_TASKS:
            tasks.setdefault(b, None)
    for task, rev in tasks.items():
        spec = HUB_TASKS[task]
        out.append(HubInput("dataset", task, spec.repo, str(rev or spec.revision), spec.config, spec.split))
    return out


def benchmark_names(config: dict) -> list[str]:
    """Every benchmark a workflow config evaluates on (``evaluation.benchmarks`` and the experiment blocks' own)."""
    out = dict.fromkeys(config.get("evaluation", {}).get("benchmarks", []))
    for block in config.get("experiments", []):
        out.update(dict.fromkeys(block.get("benchmarks", [])))
    return list(out)


def default_lock_path(config_file: str | Path) -> Path:
    """``config/paper.yaml`` -> ``config/paper.lock.yaml``."""
    p = Path(config_file)
    return p.with_name(p.stem + ".lock.yaml")


def fetch(inputs: list[HubInput], progress=print) -> dict:
    """Download every input into the Hugging Face cache (models: the files a causal LM needs; datasets: the
    repository snapshot, then ``datasets.load_dataset`` at that commit so the prepared split is cached too) and
    return the lock: the commit each resolved to."""
    from huggingface_hub import snapshot_download

    from qerl.models.source import HUB_PATTERNS

    lock: dict = {"models": {}, "datasets": {}}
    for i, x in enumerate(inputs):
        progress(f"[{i + 1}/{len(inputs)}] {x.kind} {x.name}: {x.repo}@{x.revision}")
        try:
            path = snapshot_download(x.repo, revision=x.revision, repo_type=x.kind,
                                     allow_patterns=HUB_PATTERNS if x.kind == "model" else None)
        except Exception as e:
            raise InputsError(f"qerl fetch: could not download {x.kind} {x.name} ({x.repo}@{x.revision}): "
                              f"{type(e).__name__}: {e}") from None
        commit = Path(path).name  # the cache layout: <repo dir>/snapshots/<commit>
        if not _COMMIT.match(commit):
            raise InputsError(f"qerl fetch: {x.repo}@{x.revision} resolved to {path}, not a cache snapshot "
                              "directory named by its commit (is HF_HUB_CACHE a plain directory?)")
        if x.kind == "dataset":
            import datasets

            datasets.load_dataset(x.repo, x.config, split=x.split, revision=commit)
        lock["models" if x.kind == "model" else "datasets"][x.name] = {"repo": x.repo, "revision": x.revision,
                                                                       "commit": commit}
    return lock


def write_lock(lock: dict, path: str | Path) -> Path:
    """The lock as YAML, atomically."""
    import yaml

    path = Path(path)
    head = ("# qerl fetch: the commit each hub input of the config resolved to (use it: `inputs_lock: "
            f"{path.as_posix()}` in the workflow config)\n")
    from qerl.files import write_text_atomic

    write_text_atomic(path, head + yaml.safe_dump(lock, sort_keys=True))
    return path


def read_lock(path: str | Path) -> dict:
    """A lock file, checked: ``models`` / ``datasets`` maps of ``{repo, revision, commit}`` entries."""
    import yaml

    path = Path(path)
    if not path.is_file():
        raise InputsError(f"inputs_lock {path}: not found (write it with `qerl fetch --configfile ...`)")
    from qerl.yamlio import DuplicateKeyError, load

    try:
        lock = load(path.read_text(), f"inputs_lock {path}") or {}
    except DuplicateKeyError as e:  # (yaml.safe_load would keep the last copy without a word)
        raise InputsError(str(e)) from None
    except UnicodeDecodeError:
        raise InputsError(f"inputs_lock {path}: not a text file (a lock is the YAML `qerl fetch` writes)") from None
    except yaml.YAMLError as e:
        raise InputsError(f"inputs_lock {path}: not valid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(lock, dict):
        raise InputsError(f"inputs_lock {path}: the top level must be a mapping (models:, datasets:), got a "
                          f"{type(lock).__name__}")
    for kind in ("models", "datasets"):
        if not isinstance(lock.get(kind) or {}, dict):
            raise InputsError(f"inputs_lock {path}: {kind} must be a mapping of name -> entry, got "
                              f"{type(lock[kind]).__name__}")
        for name, e in (lock.get(kind) or {}).items():
            if not isinstance(e, dict) or not _COMMIT.match(str(e.get("commit", ""))) or not e.get("repo"):
                raise InputsError(f"inputs_lock {path}: {kind}.{name} needs repo and a 40-hex commit, got {e!r}")
    return {"models": lock.get("models") or {}, "datasets": lock.get("datasets") or {}}


def locked_commits(config: dict, lock: dict, source: str = "inputs_lock") -> dict[tuple[str, str], str]:
    """``{(kind, name): commit}`` for every hub input of ``config``, from ``lock``; an input the lock lacks, or one
    locked from another repository or revision, is an :class:`InputsError` naming it and the fetch command."""
    out = {}
    for x in hub_inputs(config):
        e = lock["models" if x.kind == "model" else "datasets"].get(x.name)
        if e is None:
            raise InputsError(f"{source}: {x.kind} {x.name} ({x.repo}@{x.revision}) is not in the lock; run "
                              "`qerl fetch --configfile <the config files>` again")
        if e["repo"] != x.repo or (str(e.get("revision")) != x.revision and e["commit"] != x.revision):
            raise InputsError(f"{source}: {x.kind} {x.name} is locked as {e['repo']}@{e.get('revision')} but the "
                              f"config asks for {x.repo}@{x.revision}; run `qerl fetch` again")
        out[(x.kind, x.name)] = e["commit"]
    return out


def check_cached(inputs: list[HubInput], lock: dict) -> list[str]:
    """Inputs whose locked commit is not in the local cache (checked with the hub off); empty when all are."""
    from huggingface_hub import snapshot_download

    from qerl.models.source import HUB_PATTERNS

    missing = []
    for x in inputs:
        e = lock["models" if x.kind == "model" else "datasets"].get(x.name)
        if e is None:
            missing.append(f"{x.kind} {x.name} ({x.repo}): not in the lock")
            continue
        try:
            snapshot_download(x.repo, revision=e["commit"], repo_type=x.kind, local_files_only=True,
                              allow_patterns=HUB_PATTERNS if x.kind == "model" else None)
        except Exception:
            missing.append(f"{x.kind} {x.name} ({x.repo}@{e['commit'][:12]}): not in the cache "
                           f"{os.environ.get('HF_HUB_CACHE') or os.environ.get('HF_HOME') or '~/.cache/huggingface'}")
    return missing
