"""Experiment tracking: MLflow (sqlite store by default) or a no-op tracker for tests.

Files are the truth (``metrics.jsonl``); MLflow is the index. The tracking URI comes from the
config, else ``MLFLOW_TRACKING_URI``, else ``sqlite:///<root>/mlflow.db``.
"""
from __future__ import annotations

import os
from pathlib import Path


def check_reachable(uri: str | None, timeout_s: float = 5.0, what: str = "tracking URI") -> None:
    """An ``http(s)://`` tracking URI whose server does not answer a TCP connection within ``timeout_s`` is a
    ``ValueError`` (one line) before any model loads: MLflow itself retries for minutes, then prints a traceback.
    File stores (``sqlite:///``, paths) need no check."""
    if not uri or not uri.startswith(("http://", "https://")):
        return
    import socket
    from urllib.parse import urlparse

    u = urlparse(uri)
    port = u.port or (443 if u.scheme == "https" else 80)
    try:
        socket.create_connection((u.hostname, port), timeout=timeout_s).close()
    except OSError as e:
        raise ValueError(f"{what} {uri}: cannot connect ({e.strerror or e}); start the MLflow server there, or "
                         "track into a local store (sqlite:///path/mlflow.db)") from None


class NullTracker:
    """Does nothing (tests, or ``tracking.backend: none``)."""

    run_id = None
    resumed = False

    def log_params(self, params: dict) -> None: ...

    def log_metrics(self, metrics: dict, step: int) -> None: ...

    def log_artifact(self, path: str | Path) -> None: ...

    def set_tags(self, tags: dict) -> None: ...

    def close(self, status: str = "FINISHED") -> None: ...


def _retry(fn, *args, attempts: int = 30, **kwargs):
    """Call ``fn``, retrying while the sqlite store is locked by a concurrent job."""
    import random
    import time

    for i in range(attempts):
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # sqlite "database is locked" surfaces through several exception types
            if "locked" not in str(e).lower() or i == attempts - 1:
                raise
            time.sleep(0.2 + random.random() * 0.5)


class MLflowTracker:
    """One MLflow run; resumes the same run id when given one that this store holds in this experiment (``resumed``),
    else starts a new run (a checkpoint made under another experiment or store, e.g. a run reused by an ablation
    overlay that names its configuration differently). Safe with parallel jobs on one sqlite store (writes retry
    while the database is locked)."""

    def __init__(self, experiment: str, run_name: str, tracking_uri: str, run_id: str | None = None,
                 tags: dict | None = None):
        import mlflow

        self._mlflow = mlflow
        mlflow.set_tracking_uri(tracking_uri)
        exp = _retry(mlflow.set_experiment, experiment)
        if run_id is not None:
            try:
                if mlflow.tracking.MlflowClient().get_run(run_id).info.experiment_id != exp.experiment_id:
                    run_id = None
            except Exception as e:  # not in this store
                if "locked" in str(e).lower():
                    raise
                run_id = None
        self.resumed = run_id is not None
        run = _retry(mlflow.start_run, run_id=run_id, run_name=None if run_id else run_name, tags=tags or {})
        self.run_id = run.info.run_id

    def log_params(self, params: dict) -> None:
        _retry(self._mlflow.log_params, {k: str(v)[:500] for k, v in params.items()})

    def log_metrics(self, metrics: dict, step: int) -> None:
        clean = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool) and v == v}
        _retry(self._mlflow.log_metrics, clean, step=step)

    def log_artifact(self, path: str | Path) -> None:
        _retry(self._mlflow.log_artifact, str(path))

    def set_tags(self, tags: dict) -> None:
        _retry(self._mlflow.set_tags, tags)

    def close(self, status: str = "FINISHED") -> None:
        _retry(self._mlflow.end_run, status=status)


def default_tracking_uri(root: Path) -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{Path(root).resolve() / 'mlflow.db'}"


def flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def init_store(tracking_uri: str, experiment: str) -> str:
    """Create the store (schema migrations) and the experiment once, before parallel jobs start."""
    import mlflow

    mlflow.set_tracking_uri(tracking_uri)
    exp = mlflow.set_experiment(experiment)
    return exp.experiment_id
