"""What several verbs share: ``--set KEY=VALUE`` overrides and the optional MLflow run around a verb."""
from __future__ import annotations

import argparse
from pathlib import Path


def overrides(items) -> dict:
    """``--set KEY=VALUE`` items as a dict, each value parsed as YAML."""
    import yaml

    from qerl.train.config import ConfigError

    overrides = {}
    for item in items or []:
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE (e.g. --set steps=10)")
        try:
            overrides[key.strip()] = yaml.safe_load(value)
        except yaml.YAMLError as e:
            raise ConfigError(f"--set {item!r}: the value is not valid YAML ({str(e).splitlines()[0]})") from None
    return overrides


def add_tracking(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("MLflow (optional: log this job as a run)")
    g.add_argument("--mlflow-run-name", help="run name (the workflow uses the output path under results/)")
    g.add_argument("--mlflow-experiment", default=None,
                   help="experiment name (default: $MLFLOW_EXPERIMENT_NAME, else qerl)")
    g.add_argument("--mlflow-uri", default=None, help="tracking URI (default: $MLFLOW_TRACKING_URI)")
    g.add_argument("--mlflow-tag", action="append", default=[], metavar="KEY=VALUE", help="a run tag (repeatable)")


def key_value_options(items: list[str], flag: str) -> dict[str, str]:
    """Repeated ``FLAG KEY=VALUE`` options -> dict; a malformed or repeated key is a ``ValueError`` naming it."""
    out: dict[str, str] = {}
    for item in items:
        k, eq, v = item.partition("=")
        if not eq or not k:
            raise ValueError(f"{flag} {item!r}: expected KEY=VALUE")
        if k in out:
            raise ValueError(f"{flag} {k} is given twice")
        out[k] = v
    return out


def trained_run_id(args) -> str | None:
    """The MLflow run that trained what a command reads: ``--adapter`` (LoRA methods) or ``--model`` (a full
    fine-tune's ``final/``), when its run directory's ``summary.json`` names one. An evaluation of it is nested under
    that run and logs its pass@1 there."""
    from qerl.readers import read_json

    for path in (getattr(args, "adapter", None), getattr(args, "model", None)):
        summary = Path(path).parent / "summary.json" if path else None
        if summary is not None and summary.is_file():
            return read_json(summary, "run summary").get("mlflow_run_id")
    return None


#: What each tracked command logs as artifacts, from its arguments: its small result files (never weights).
ARTIFACTS = {
    "evaluate": lambda a: [Path(a.output)],
    "quantize": lambda a: [Path(a.output) / "quantization_report.json"],
    "report": lambda a: sorted(p for p in Path(a.output).glob("*") if p.suffix in (".md", ".csv", ".png")),
}


def artifacts_of(args) -> list[Path]:
    pick = ARTIFACTS.get(getattr(args, "command", None))
    return [p for p in pick(args) if p.is_file()] if pick else []


def tracked(args, func):
    """Run a verb inside an MLflow run when --mlflow-run-name is given; log its returned metrics."""
    if not getattr(args, "mlflow_run_name", None):
        given = [f for f, v in (("--mlflow-uri", getattr(args, "mlflow_uri", None)),
                                ("--mlflow-tag", getattr(args, "mlflow_tag", None)),
                                ("--mlflow-experiment", getattr(args, "mlflow_experiment", None)))
                 if v]
        if given:
            raise ValueError(f"{given[0]} is given without --mlflow-run-name: nothing would be logged (name the run, "
                             "or leave the MLflow options out)")
        return func(args)
    import os

    from qerl.tracking import MLflowTracker
    from qerl.train.tracking_setup import git_commit

    uri = args.mlflow_uri or os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        raise ValueError("--mlflow-run-name needs --mlflow-uri or MLFLOW_TRACKING_URI")
    from qerl.tracking import check_reachable

    check_reachable(uri, what="--mlflow-uri")
    tags = key_value_options(args.mlflow_tag, "--mlflow-tag")
    if os.environ.get("QERL_CONFIG_HASH"):  # the workflow's config hash (workflow/rules/common.smk)
        tags.setdefault("config_hash", os.environ["QERL_CONFIG_HASH"])
    tags.update(command=args.command, git_commit=git_commit())
    experiment = args.mlflow_experiment or os.environ.get("MLFLOW_EXPERIMENT_NAME") or "qerl"
    trained = trained_run_id(args)
    if trained:
        tags["qerl.train_run_id"] = trained
    tracker = MLflowTracker(experiment, args.mlflow_run_name, uri, tags=tags, parent_run_id=trained)
    try:
        params = {k: v for k, v in vars(args).items() if k not in ("func",) and not k.startswith("mlflow")}
        if params.get("device") == "auto":  # what ran, never `auto` (as a training run's params)
            import torch

            params["device"] = "cuda" if torch.cuda.is_available() else "cpu"
        tracker.log_params(params)
        result = func(args) or {}
        tracker.log_metrics(result, step=0)
        for path in artifacts_of(args):
            tracker.log_artifact(path)
        if trained and "pass_at_1" in result:
            from qerl.tracking import log_to_run

            bench = getattr(args, "name", None) or Path(args.benchmark).stem
            log_to_run(uri, trained, {f"pass_at_1/{bench}": result["pass_at_1"]})
        tracker.close("FINISHED")
    except BaseException:
        tracker.close("FAILED")
        raise
    return 0
