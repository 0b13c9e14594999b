"""Create the tracker for a training run (MLflow run named after the output path, tagged)."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path

from qerl.tracking import MLflowTracker, NullTracker, default_tracking_uri, flatten


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                              cwd=Path(__file__).parent).stdout.strip() or "unknown"
    except Exception:
        return "unknown"


def make_tracker(cfg, out: Path, run_id: str | None = None):
    from qerl.models.gguf import source_tags
    from qerl.train.config import to_dict

    if cfg.tracking.backend == "none":
        return NullTracker()
    import torch

    conf = to_dict(cfg)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    tags = {"method": cfg.method, "algorithm": cfg.algorithm.name, "model": cfg.model.path, "seed": str(cfg.seed),
            "git_commit": git_commit(), "device": device,
            "config_hash": hashlib.sha256(json.dumps(conf, sort_keys=True).encode()).hexdigest()[:12],
            **source_tags(cfg.model.path), **cfg.tracking.tags}
    uri = cfg.tracking.tracking_uri or default_tracking_uri(Path(out).parent)  # (else $MLFLOW_TRACKING_URI)
    experiment = cfg.tracking.experiment or os.environ.get("MLFLOW_EXPERIMENT_NAME") or "qerl"
    tracker = MLflowTracker(experiment, cfg.tracking.run_name or str(out), uri, run_id, tags)
    if tracker.note:
        print(tracker.note, flush=True)
    if not tracker.resumed:
        tracker.log_params(run_params(conf, tags))
    return tracker


def run_params(conf: dict, tags: dict) -> dict:
    """The MLflow params of a training run: its resolved config flattened (``optim.lr``, ...), without the tracking
    settings (where a run is logged is not what it is), without ``aqn.*`` settings when AQN is off (only
    ``aqn.enabled: False``); ``method`` is the arm's name as in its ``method`` tag (a variant's name, e.g.
    ``qerl_r16``), ``base_method`` the method it runs and ``variant`` the arm's name or "" for a base method."""
    from qerl.methods import aqn_on

    params = {k: v for k, v in flatten(conf).items() if not k.startswith("tracking.")}
    aqn = aqn_on(conf["method"], (conf.get("aqn") or {}).get("enabled", "auto"))
    if not aqn:  # AQN off (``false``, or ``auto`` on a method without it): its settings describe nothing that ran
        params = {k: v for k, v in params.items() if not k.startswith("aqn.")} | {"aqn.enabled": False}
    arm = tags.get("method", conf.get("method"))  # the matrix's name of the arm, as the run's ``method`` tag
    params.update(method=arm, base_method=conf.get("method"), variant=arm if arm != conf.get("method") else "")
    return params


def log_run_files(tracker, out: Path) -> None:
    """A finished run's files as its artifacts (the files stay the truth): the resolved ``config.json``, the
    workflow's ``train.yaml`` when there is one, ``summary.json``, ``metrics.jsonl``, and its curves as a figure."""
    from qerl.readers import read_jsonl

    for name in ("config.json", "train.yaml", "summary.json", "metrics.jsonl"):
        if (out / name).is_file():
            tracker.log_artifact(out / name)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("MLflow: matplotlib is not installed; the run's curves are logged as metrics only", flush=True)
        return
    rows = read_jsonl(out / "metrics.jsonl", "metrics file", allow_nan=True)
    keys = [k for k in ("reward_mean", "accuracy", "entropy", "response_len_mean", "sigma") if any(k in r for r in rows)]
    fig, axes = plt.subplots(1, len(keys), figsize=(3.6 * len(keys), 3.0), squeeze=False)
    for ax, key in zip(axes[0], keys):
        ax.plot([r["step"] for r in rows], [r.get(key, float("nan")) for r in rows], lw=1.2)
        ax.set_title(key), ax.set_xlabel("step"), ax.grid(alpha=0.3)
    fig.tight_layout()
    tracker.log_figure(fig, "curves.png")
    plt.close(fig)
