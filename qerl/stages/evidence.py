"""The evidence a real-model report is regenerated from: small, compressed, committed under
``reports/<name>/evidence/<configuration>/`` (the ``results/`` tree it comes from is not committed).

* ``config.yaml`` -- the workflow config the runs were made with (``results/config/<configuration>.yaml``);
* ``metrics.jsonl.gz`` -- every training step of every run, one JSON object a line, with ``"run"``:
  ``<model>/<method>/<algo>/<dataset>/seed<k>`` (the run's path under ``results/train``);
* ``evaluations.jsonl.gz`` -- every evaluation summary, per-problem scores included, with ``"path"``: its path under
  ``results/eval`` (``<model>/<method>/<algo>/<dataset>/seed<k>/<benchmark>.json``, untrained bases as
  ``<model>/<base>/untrained/none/seed0/...``);
* ``completions.jsonl.gz`` -- every graded sample of those evaluations (``*.samples.jsonl``), so that the grader
  can be audited: ``"path"`` (its evaluation's), ``problem``, ``sample``, ``completion``, ``extracted``, ``gold``,
  ``correct`` (the prompt is left out: the benchmark file and the template rebuild it).

:func:`pack` writes them from a workflow's ``results/`` and merges into evidence already there (a batch of runs at a
time: an entry of the same run or path is replaced, the others stay); :func:`unpack` rebuilds the ``results/``
files ``qerl claims`` reads. The gzip streams carry no timestamp and the lines are sorted, so packing the same
results twice writes the same bytes.
"""
from __future__ import annotations

import gzip
import json
from pathlib import Path

CONFIG, METRICS, EVALS = "config.yaml", "metrics.jsonl.gz", "evaluations.jsonl.gz"
COMPLETIONS = "completions.jsonl.gz"
SAMPLE_KEYS = ("problem", "sample", "completion", "extracted", "gold", "correct")


class EvidenceError(ValueError):
    """Evidence that cannot be read or written (a missing file, a line that is not JSON, a mismatched config)."""


def _read_gz(path: Path) -> list[dict]:
    """The JSON lines of a gzip file (none for a missing file); a cut or non-gzip file, or a line that is not a
    JSON object, is an :class:`EvidenceError` naming the file (and the line)."""
    import zlib

    if not path.is_file():
        return []
    out = []
    try:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            for i, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise EvidenceError(f"{path}: line {i} is not JSON ({e.msg})") from None
                if not isinstance(row, dict):
                    raise EvidenceError(f"{path}: line {i} is not a JSON object")
                out.append(row)
    except (EOFError, gzip.BadGzipFile, zlib.error, UnicodeDecodeError) as e:
        raise EvidenceError(f"{path}: not a whole gzip file of JSON lines ({type(e).__name__}: {e}); the evidence is "
                            "cut or damaged: restore it (git checkout) or pack it again") from None
    return out


def _write_gz(path: Path, rows: list[dict]) -> Path:
    """``rows`` as gzipped JSON lines in a temporary file beside ``path`` (no timestamp in the stream); returns it,
    for the caller to rename once every file of the set is written (:func:`_swap_in`)."""
    from qerl.files import temporary

    data = "".join(json.dumps(r, sort_keys=True, allow_nan=False) + "\n" for r in rows).encode()
    tmp = temporary(path)
    try:
        with open(tmp, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0, filename="") as f:
            f.write(data)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp


def _swap_in(staged: dict[Path, Path]) -> None:
    """Rename each staged temporary file over its target: the set is written whole before any of it replaces the
    evidence (a full disk or an interruption while writing leaves the earlier evidence as it was)."""
    from qerl.files import commit

    for target, tmp in staged.items():
        commit(tmp, target)


def _finite(path: Path, run: str, row: dict) -> None:
    """A metrics row a verdict reads holds finite numbers (the keys :data:`qerl.stages.claims.CHECKED_METRICS`)."""
    import math

    from qerl.stages.claims import CHECKED_METRICS

    for k in CHECKED_METRICS:
        v = row.get(k)
        if isinstance(v, float) and not math.isfinite(v):
            raise EvidenceError(f"{path}: step {row.get('step', '?')} has {k} = {v}; a non-finite value is not "
                                f"evidence (run {run}: rerun it, or leave it out)")


def pack(results: Path, config_file: Path, out: Path) -> dict:
    """Add the runs and evaluations found under ``results`` (``train/**/metrics.jsonl``, ``eval/**/*.json``) to the
    evidence in ``out``; ``config_file``: the workflow config they were made with (an existing ``out/config.yaml``
    must be the same configuration). Only finished runs are evidence: a run without its ``summary.json`` (training
    cut short; it restarts or resumes in a later batch) is left out and named in ``"unfinished"``. Returns
    ``{"runs", "evaluations", "completions"}`` counts of what ``out`` now holds (and ``"unfinished"`` when some were left out)."""
    from qerl.train.config import read_workflow_config_checked
    from qerl.workflow_config import read_workflow_config
    from qerl.files import write_text_atomic

    results, out = Path(results), Path(out)
    config = read_workflow_config_checked([config_file], "--workflow-config")
    old = out / CONFIG
    if old.is_file():
        had = read_workflow_config([old], "evidence")
        have = had.get("configuration")
        if have != config.get("configuration"):
            raise EvidenceError(f"{out}: holds the evidence of configuration {have!r}, not "
                                f"{config.get('configuration')!r} ({config_file}); pack it into its own directory")
        if had != config:
            from qerl.tracking import flatten

            a, b = flatten(had), flatten(config)
            keys = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
            raise EvidenceError(f"{out}: its runs were made with another config of {have!r} ({config_file} differs "
                                f"in {', '.join(keys[:4])}{' …' if len(keys) > 4 else ''}); runs of two configs are "
                                "not one evidence set: pack these into their own directory")
    out.mkdir(parents=True, exist_ok=True)
    metrics = {(r["run"], r["step"]): r for r in _read_gz(out / METRICS)}
    found = sorted((results / "train").glob("**/metrics.jsonl"))
    unfinished = [f.parent.relative_to(results / "train").as_posix() for f in found
                  if not (f.parent / "summary.json").is_file()]
    found = [f for f in found if (f.parent / "summary.json").is_file()]
    for f in found:
        run = f.parent.relative_to(results / "train").as_posix()
        metrics = {k: v for k, v in metrics.items() if k[0] != run}  # a run's rows are replaced as a whole
        from qerl.readers import read_jsonl

        for row in read_jsonl(f, "metrics file", allow_nan=True):
            if "step" not in row:
                raise EvidenceError(f"{f}: a row without its step ({sorted(row)[:5]})")
            if (run, row["step"]) in metrics:
                raise EvidenceError(f"{f}: step {row['step']} appears twice; a run's metrics hold each step once")
            _finite(f, run, row)
            metrics[(run, row["step"])] = {"run": run, **row}
    evals = {r["path"]: r for r in _read_gz(out / EVALS)}
    for f in sorted((results / "eval").glob("**/*.json")):
        from qerl.readers import read_eval_summary

        summary = read_eval_summary(f)
        if "per_problem" not in summary:
            raise EvidenceError(f"{f}: an evaluation without per-problem scores (an older qerl evaluate); rerun it")
        if len(summary["per_problem"]) != summary.get("problems", len(summary["per_problem"])):
            raise EvidenceError(f"{f}: per_problem holds {len(summary['per_problem'])} scores for "
                                f"{summary['problems']} problems; a cut or edited evaluation is not evidence")
        path = f.relative_to(results / "eval").as_posix()
        evals[path] = {"path": path, **summary}
    if not found and not evals:
        raise EvidenceError(f"{results}: no train/**/metrics.jsonl and no eval/**/*.json to pack")
    samples = {(r["path"], r["problem"], r["sample"]): r for r in _read_gz(out / COMPLETIONS)}
    for f in sorted((results / "eval").glob("**/*.samples.jsonl")):
        path = f.relative_to(results / "eval").as_posix().removesuffix(".samples.jsonl") + ".json"
        samples = {k: v for k, v in samples.items() if k[0] != path}  # an evaluation's samples replaced as a whole
        for i, line in enumerate(f.read_text().splitlines(), 1):
            if line.strip():
                row = json.loads(line)
                if missing := [k for k in SAMPLE_KEYS if k not in row]:
                    raise EvidenceError(f"{f}: line {i} has no {', '.join(missing)} (a sample of qerl evaluate)")
                samples[(path, row["problem"], row["sample"])] = {"path": path, **{k: row[k] for k in SAMPLE_KEYS}}
    staged: dict[Path, Path] = {}
    try:
        staged[out / METRICS] = _write_gz(out / METRICS, [metrics[k] for k in sorted(metrics)])
        staged[out / EVALS] = _write_gz(out / EVALS, [evals[k] for k in sorted(evals)])
        if samples:
            staged[out / COMPLETIONS] = _write_gz(out / COMPLETIONS, [samples[k] for k in sorted(samples)])
    except BaseException:
        for tmp in staged.values():
            tmp.unlink(missing_ok=True)
        raise
    _swap_in(staged)
    write_text_atomic(str(out / CONFIG), Path(config_file).read_text())
    counts = {"runs": len({k[0] for k in metrics}), "evaluations": len(evals), "completions": len(samples)}
    return {**counts, "unfinished": unfinished} if unfinished else counts


def unpack(evidence: Path, dest: Path) -> dict:
    """Write the ``results/`` tree of ``evidence`` under ``dest`` (``train/<run>/metrics.jsonl``,
    ``eval/<path>``) and return the workflow config it holds (a dict)."""
    from qerl.train.config import read_workflow_config_checked

    evidence, dest = Path(evidence), Path(dest)
    cfg = evidence / CONFIG
    if not cfg.is_file():
        raise EvidenceError(f"{evidence}: no {CONFIG} (the workflow config of these runs); is this an evidence "
                            f"directory written by qerl claims --pack?")
    rows = _read_gz(evidence / METRICS)
    evals = _read_gz(evidence / EVALS)
    if not rows and not evals:
        raise EvidenceError(f"{evidence}: neither {METRICS} nor {EVALS} holds anything")
    by_run: dict[str, list[dict]] = {}
    for r in rows:
        if "run" not in r or "step" not in r:
            raise EvidenceError(f"{evidence / METRICS}: a row without its run or step ({sorted(r)[:5]})")
        by_run.setdefault(r["run"], []).append({k: v for k, v in r.items() if k != "run"})
    config = read_workflow_config_checked([cfg], "--evidence")
    from qerl.workflow_config import runs

    named = {r.path for r in runs(config)}
    if stray := sorted(set(by_run) - named):
        raise EvidenceError(f"{evidence}: holds run(s) its {CONFIG} does not name ({', '.join(stray[:3])}); evidence "
                            "of another configuration was merged in: pack each configuration into its own directory")
    for run, steps in by_run.items():
        f = dest / "train" / run / "metrics.jsonl"
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text("".join(json.dumps(s) + "\n" for s in sorted(steps, key=lambda s: s["step"])))
        (f.parent / "summary.json").write_text(json.dumps({"steps": len(steps), "from": "evidence"}))  # finished
    for e in evals:
        f = dest / "eval" / e["path"]
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(json.dumps({k: v for k, v in e.items() if k != "path"}))
    return config


def read_completions(evidence: Path) -> list[dict]:
    """The graded samples an evidence directory holds (``completions.jsonl.gz``; empty when it holds none)."""
    return _read_gz(Path(evidence) / COMPLETIONS)
