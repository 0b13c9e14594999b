"""Before anything runs (``snakemake -n`` included): every training job of a workflow config fits the GPUs it is
given, by the memory planner ``qerl train`` itself applies on a GPU (:func:`qerl.train.plan.plan_config`).

A job is planned where its model's size is known without downloading it: a ``paper_column`` (the Qwen2.5 sizes of the
paper's tables) or a local model directory's ``config.json``. It runs on ``resources.train.gpu`` GPUs (one process
each) of ``resources.gpu_gb`` GB (default 80). One that does not fit is named with what it needs,
and with the shipped overlay that fixes it (``config/resources/gpus8.yaml``: 8 GPUs, FSDP for the full method) when
that one does; otherwise with the planner's advice.
"""
from __future__ import annotations

import copy
from pathlib import Path

GPUS8 = Path(__file__).resolve().parents[1] / "config" / "resources" / "gpus8.yaml"
DEFAULT_GPU_GB = 80.0


def _plan(config: dict, run, gpu_gb: float) -> dict | None:
    """The plan of ``run`` under ``config`` (``None``: its model's size is not known before it is fetched)."""
    from qerl.models.shapes import QWEN25
    from qerl.train.config import TrainConfig, from_dict, validate
    from qerl.train.plan import plan_config
    from qerl.workflow_config import train_config

    model = config["models"][run.model]
    shape = str(model.get("paper_column") or "")
    local = Path(model["path"]) / "config.json" if model.get("source") == "local" and model.get("path") else None
    if shape not in QWEN25 and not (local is not None and local.is_file()):
        return None
    world = max(1, int(((config.get("resources") or {}).get("train") or {}).get("gpu", 1) or 1))
    cfg = validate(from_dict(TrainConfig, train_config(config, run, "sqlite:///unused.db"), "config"))
    if shape in QWEN25:
        return plan_config(cfg, shape=shape, available=gpu_gb * 1e9, world=world)
    return plan_config(cfg, available=gpu_gb * 1e9, world=world, config_path=local)


def _merged(config: dict, overlay: Path) -> dict:
    from qerl.workflow_config import _merge, read_config_file

    return _merge(copy.deepcopy(config), read_config_file(overlay))


def misfits(config: dict) -> list[str]:
    """One line per training job that cannot fit its GPUs (empty: all fit, or none is planned: CPU jobs,
    ``resources.train.gpu: 0``, or models whose size is not known yet)."""
    from qerl.workflow_config import runs

    res = config.get("resources") or {}
    if int((res.get("train") or {}).get("gpu", 1) or 0) < 1:
        return []
    gpu_gb = float(res.get("gpu_gb", DEFAULT_GPU_GB))
    gpus = int(res["train"].get("gpu", 1))
    wider = None
    out = []
    for run in runs(config):
        plan = _plan(config, run, gpu_gb)
        if plan is None or plan["fits"]:
            continue
        e = plan["estimate"]
        line = (f"train {run.path}: needs ~{e['peak_gb']:.1f} GB per GPU at its {e['peak_phase']} phase on {gpus} "
                f"GPU(s) of {gpu_gb:g} GB (resources.train.gpu {gpus}, resources.gpu_gb {gpu_gb:g})")
        if gpus < 8 and GPUS8.is_file():
            wider = wider if wider is not None else _merged(config, GPUS8)
            other = _plan(wider, run, gpu_gb)
            if other is not None and other["fits"]:
                out.append(f"{line}; it fits 8 GPUs (~{other['estimate']['peak_gb']:.1f} GB each): add the overlay "
                           f"config/resources/gpus8.yaml (--configfile ... config/resources/gpus8.yaml)")
                continue
        out.append(f"{line}; to fit: {'; '.join(plan['advice']) or 'more or larger GPUs'}")
    return out


def describe(lines: list[str]) -> str:
    """The error the Snakefile raises for :func:`misfits`' lines."""
    head = f"{len(lines)} training job(s) cannot fit the GPUs they are given (qerl's memory planner, as `qerl train` " \
           "applies it on the GPU):"
    return "\n".join([head, *(f"  {x}" for x in lines[:8]), *([f"  ... {len(lines) - 8} more"] if len(lines) > 8
                                                             else [])])

