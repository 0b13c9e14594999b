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
    if not tracker.resumed:
        tracker.log_params(run_params(conf, tags))
    return tracker


def run_params(conf: dict, tags: dict) -> dict:
    """The MLflow params of a training run: its resolved config flattened (``optim.lr``, ...), without the tracking
    settings (where a run is logged is not what it is), without ``aqn.*`` settings when AQN is off (only
    ``aqn.enabled``), and with ``arm`` (a variant's or an ablation arm's name, its ``method`` tag) beside ``method``
    (the method it runs)."""
    params = {k: v for k, v in flatten(conf).items() if not k.startswith("tracking.")}
    if not (conf.get("aqn") or {}).get("enabled"):
        params = {k: v for k, v in params.items() if not k.startswith("aqn.") or k == "aqn.enabled"}
    params["arm"] = tags.get("method", conf.get("method"))
    return params
