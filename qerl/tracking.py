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
    note = None

    def log_params(self, params: dict) -> None: ...

    def log_metrics(self, metrics: dict, step: int) -> None: ...

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None: ...

    def log_figure(self, figure, name: str) -> None: ...

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


def run_name(stage: str, *, model: str = "", method: str = "", algo: str = "", dataset: str = "", seed=None,
             benchmark: str = "", configuration: str = "") -> str:
    """An MLflow run's name as the workflow gives it, leading with what a reader compares (the UI cuts names to ~25
    characters): ``qerl_r8 seed0 · tiny-qwen2/grpo/synthetic`` (a training run: the arm and its seed first),
    ``qerl_r8 seed0 · synthetic_test · tiny-qwen2/grpo/synthetic`` (its evaluation), ``nvfp4 untrained ·
    synthetic_test · tiny-qwen2``, ``quantize · tiny-qwen2``, ``sft · tiny-qwen2``, ``report · default``,
    ``workflow · default``. The run's tags hold each part on its own (``method``, ``seed``, ``stage``, ...)."""
    cell = "/".join(x for x in (model, algo, dataset) if x)
    if stage == "train":
        return f"{method} seed{seed} · {cell}"
    if stage == "eval":
        who = f"{method} untrained" if algo in ("", "untrained") else f"{method} seed{seed}"
        return f"{who} · {benchmark} · {cell if algo not in ('', 'untrained') else model}"
    return f"{stage} · {configuration or model}"


#: The environment variable through which the workflow names the run of its invocation (workflow/rules/tracking.smk):
#: every job's new run is nested under it.
PARENT_ENV = "QERL_MLFLOW_PARENT_RUN_ID"


def artifact_location(tracking_uri: str, experiment: str) -> str | None:
    """Where a new experiment of a local store keeps its artifacts: beside the sqlite file
    (``<dir>/mlartifacts/<experiment>``, under ``results/`` in the workflow), not in the working directory. ``None``
    (MLflow's default) for a server."""
    if not tracking_uri.startswith("sqlite:///"):
        return None
    db = Path(tracking_uri[len("sqlite:///"):])
    return (db.parent / "mlartifacts" / experiment).resolve().as_uri()


def ensure_experiment(tracking_uri: str, experiment: str):
    """The experiment named ``experiment`` in the store, created (artifacts: :func:`artifact_location`) if missing;
    safe when parallel jobs race to create it."""
    import mlflow

    mlflow.set_tracking_uri(tracking_uri)
    client = mlflow.tracking.MlflowClient(tracking_uri)
    exp = _retry(client.get_experiment_by_name, experiment)
    if exp is None:
        try:
            _retry(client.create_experiment, experiment, artifact_location=artifact_location(tracking_uri, experiment))
        except Exception as e:  # another job created it first
            if "already exists" not in str(e).lower() and "unique" not in str(e).lower():
                raise
        exp = _retry(client.get_experiment_by_name, experiment)
        _drop_empty_default(client, tracking_uri, experiment)
    return _retry(mlflow.set_experiment, experiment_id=exp.experiment_id)


def _drop_empty_default(client, tracking_uri: str, experiment: str) -> None:
    """A local store made for qerl's experiments has no use for MLflow's own ``Default`` (id 0, its artifacts in the
    working directory), which sits beside ``default`` in the UI: it is deleted while it holds no run."""
    if not tracking_uri.startswith("sqlite:///") or experiment == "Default":
        return
    try:
        if not client.search_runs(["0"], max_results=1, run_view_type=3):  # (3: active and deleted runs)
            client.delete_experiment("0")
    except Exception as e:  # already deleted, or another job got there first
        if "locked" in str(e).lower():
            raise


def _existing_run(client, run_id: str | None):
    """The stored run ``run_id``, or ``None`` when this store does not hold it."""
    if not run_id:
        return None
    try:
        return client.get_run(run_id)
    except Exception as e:
        if "locked" in str(e).lower():
            raise
        return None


class MLflowTracker:
    """One MLflow run. Given a ``run_id`` (a resumed training run), it continues that run when this store holds it in
    this experiment (``resumed``); otherwise (a checkpoint made under another experiment or store, e.g. a run reused
    by an ablation overlay that names its configuration differently) it starts a new run tagged
    ``qerl.continues_run`` = the old id, and says so (``note``). A new run is nested under ``parent_run_id`` (the
    workflow invocation's run, default ``$QERL_MLFLOW_PARENT_RUN_ID``) when this store holds that run. Safe with
    parallel jobs on one sqlite store (writes retry while the database is locked)."""

    def __init__(self, experiment: str, run_name: str, tracking_uri: str, run_id: str | None = None,
                 tags: dict | None = None, parent_run_id: str | None = None):
        import mlflow

        self._mlflow = mlflow
        exp = ensure_experiment(tracking_uri, experiment)
        client = mlflow.tracking.MlflowClient(tracking_uri)
        self._client = client
        tags = dict(tags or {})
        self.note = None
        if run_id is not None:
            old = _existing_run(client, run_id)
            if old is None or old.info.experiment_id != exp.experiment_id:
                where = "not in this store" if old is None else f"in experiment {old.info.experiment_id}"
                self.note = (f"MLflow: the checkpoint's run {run_id} is {where}; logging to a new run in experiment "
                             f"{experiment!r}, tagged qerl.continues_run={run_id}")
                tags["qerl.continues_run"] = run_id
                run_id = None
            else:
                self.note = f"MLflow: continuing run {run_id} in experiment {experiment!r}"
        self.resumed = run_id is not None
        parent = parent_run_id if parent_run_id is not None else os.environ.get(PARENT_ENV)
        if not self.resumed and parent and _existing_run(client, parent) is not None:
            tags["mlflow.parentRunId"] = parent
        run = _retry(mlflow.start_run, run_id=run_id, run_name=None if run_id else run_name, tags=tags)
        self.run_id = run.info.run_id

    def log_params(self, params: dict) -> None:
        _retry(self._mlflow.log_params, {k: str(v)[:500] for k, v in params.items()})

    def log_metrics(self, metrics: dict, step: int) -> None:
        clean = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool) and v == v}
        _retry(self._mlflow.log_metrics, clean, step=step)

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        _retry(self._mlflow.log_artifact, str(path), artifact_path)

    def log_figure(self, figure, name: str) -> None:
        """A matplotlib figure as an artifact (``mlflow.log_figure``)."""
        _retry(self._mlflow.log_figure, figure, name)

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
    return ensure_experiment(tracking_uri, experiment).experiment_id


def start_parent(tracking_uri: str, experiment: str, name: str, params: dict, tags: dict,
                 artifacts: list[Path] = ()) -> str:
    """The run of one workflow invocation (status RUNNING until :func:`end_parent`; an earlier one still RUNNING was
    killed, and is marked so): the configuration's name and hash as params, its effective config as an artifact.
    Returns its run id."""
    import mlflow

    exp = ensure_experiment(tracking_uri, experiment)
    client = mlflow.tracking.MlflowClient(tracking_uri)
    # an invocation still RUNNING was killed (snakemake locks its directory: two never run at once)
    for old in _retry(client.search_runs, [exp.experiment_id], "tags.stage = 'workflow' and attributes.status = 'RUNNING'"):
        _retry(client.set_terminated, old.info.run_id, "KILLED")
    run = _retry(client.create_run, exp.experiment_id, run_name=name, tags={"stage": "workflow", **tags})
    for k, v in params.items():
        _retry(client.log_param, run.info.run_id, k, str(v)[:500])
    for a in artifacts:
        _retry(client.log_artifact, run.info.run_id, str(a))
    return run.info.run_id


def end_parent(tracking_uri: str, run_id: str, status: str, artifacts: list[Path] = ()) -> None:
    """Close the invocation's run with ``status`` (FINISHED / FAILED), after logging ``artifacts`` (the report's
    figures and tables) under ``report/``."""
    import mlflow

    client = mlflow.tracking.MlflowClient(tracking_uri)
    for a in artifacts:
        _retry(client.log_artifact, run_id, str(a), "report")
    _retry(client.set_terminated, run_id, status)


def log_to_run(tracking_uri: str, run_id: str, metrics: dict) -> bool:
    """Log ``metrics`` (step 0) on another stored run, e.g. an evaluation's pass@1 on the training run it evaluated;
    ``False`` when this store does not hold that run."""
    import mlflow

    client = mlflow.tracking.MlflowClient(tracking_uri)
    if _existing_run(client, run_id) is None:
        return False
    for k, v in metrics.items():
        _retry(client.log_metric, run_id, k, float(v), step=0)
    return True
