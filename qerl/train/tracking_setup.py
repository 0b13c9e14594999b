"""Create the tracker for a training run (MLflow run named after the output path, tagged)."""
from __future__ import annotations

import hashlib
import json
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
    uri = cfg.tracking.tracking_uri or default_tracking_uri(Path(out).parent)
    tracker = MLflowTracker(cfg.tracking.experiment, cfg.tracking.run_name or str(out), uri, run_id, tags)
    if run_id is None:
        tracker.log_params(flatten(conf))
    return tracker
