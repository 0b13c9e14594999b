"""Every arm of a report in its configuration's MLflow experiment, reused runs included.

A run is trained once and reused by every configuration that names it (an ablation overlay reruns none of the jobs it
shares with a finished run), so it lives in the experiment of the invocation that trained it: after the README's
ablation, ``my-ablation`` would hold its new arms without their ``qerl`` baseline. When a configuration's report is
built, each of its arms (every training run, every untrained base it evaluates) stored in *another* experiment gets a
linked run in this one: the same name, params, tags and metric histories (``reward_mean`` per step, ``pass_at_1/*``),
tagged ``qerl.linked_from`` (the original's id) and ``qerl.linked_from_experiment``, nested under the invocation's run.
The original keeps its artifacts; the link says where they are. Linking is idempotent: an arm linked before is left.
"""
from __future__ import annotations

import os
from pathlib import Path

LINK_TAG = "qerl.linked_from"


def _arm_runs(client, config: dict, results: Path) -> list:
    """The stored runs of the report's arms: each training run (its ``summary.json`` names the run) and each
    untrained base's evaluation (found by its name: the newest finished one in the store)."""
    from qerl.readers import read_json
    from qerl.tracking import _existing_run, _retry, run_name
    from qerl.workflow_config import eval_targets, runs

    found = []
    for r in runs(config):
        summary = results / "train" / r.path / "summary.json"
        run = _existing_run(client, read_json(summary, "run summary").get("mlflow_run_id")
                            if summary.is_file() else None)
        if run is not None:
            found.append(run)
    experiments = [e.experiment_id for e in _retry(client.search_experiments)]
    for target in eval_targets(config):
        parts = Path(target).parts  # results/eval/<model>/<base>/untrained/none/seed0/<benchmark>.json
        if len(parts) != 8 or parts[4] != "untrained":
            continue
        name = run_name("eval", model=parts[2], method=parts[3], algo="untrained", benchmark=Path(parts[7]).stem)
        found += _retry(client.search_runs, experiments, f"attributes.run_name = '{name}' and "
                                                         "attributes.status = 'FINISHED'",
                        order_by=["attributes.start_time DESC"], max_results=1)
    return found


def link_report_runs(tracking_uri: str, experiment: str, config: dict, results: Path) -> int:
    """Link into ``experiment`` every arm of ``config``'s report stored elsewhere in ``tracking_uri``'s store;
    returns how many links were made."""
    import mlflow
    from mlflow.entities import Metric, Param

    from qerl.tracking import PARENT_ENV, _retry, ensure_experiment

    exp = ensure_experiment(tracking_uri, experiment)
    client = mlflow.tracking.MlflowClient(tracking_uri)
    linked = {r.data.tags.get(LINK_TAG) for r in _retry(client.search_runs, [exp.experiment_id], max_results=50000)}
    parent = os.environ.get(PARENT_ENV)
    names = {e.experiment_id: e.name for e in client.search_experiments()}
    made = 0
    for src in _arm_runs(client, config, Path(results)):
        if src.info.experiment_id == exp.experiment_id or src.info.run_id in linked:
            continue
        tags = {k: v for k, v in src.data.tags.items() if not k.startswith("mlflow.")}
        tags.update({LINK_TAG: src.info.run_id, "qerl.linked_from_experiment": names.get(src.info.experiment_id, ""),
                     "mlflow.note.content": f"Reused by configuration {experiment!r}: trained (and its artifacts "
                                            f"kept) in experiment {names.get(src.info.experiment_id)!r}, run "
                                            f"{src.info.run_id}."})
        if parent:
            tags["mlflow.parentRunId"] = parent
        run = _retry(client.create_run, exp.experiment_id, start_time=src.info.start_time,
                     run_name=src.info.run_name, tags=tags)
        metrics = [Metric(m.key, m.value, m.timestamp, m.step) for key in src.data.metrics
                   for m in client.get_metric_history(src.info.run_id, key)]
        params = [Param(k, v) for k, v in src.data.params.items()]
        for i in range(0, len(metrics), 900):  # (MLflow takes at most 1,000 metrics and 100 params a batch)
            _retry(client.log_batch, run.info.run_id, metrics=metrics[i:i + 900])
        for i in range(0, len(params), 100):
            _retry(client.log_batch, run.info.run_id, params=params[i:i + 100])
        _retry(client.set_terminated, run.info.run_id, "FINISHED", end_time=src.info.end_time)
        made += 1
    return made


def describe(config: dict) -> str:
    """What a configuration compares, in a few Markdown lines (its invocation run's description in MLflow): per
    experiment block the models, datasets, algorithms and seeds, and each arm with what it changes."""
    from qerl.variants import arm_changes
    from qerl.workflow_config import base_method, untrained_bases

    lines = [f"Configuration `{config.get('configuration', 'default')}`: what its report compares."]
    for block in config.get("experiments", []):
        arms = []
        for m in block.get("methods", []):
            base = base_method(config, m)
            change = arm_changes(config, m)
            arms.append(f"`{m}`" + (f" ({base}: {change})" if base != m and change else f" (= {base})"
                                    if base != m else ""))
        seeds = block.get("seeds", [0])
        lines.append(f"- {', '.join(block['models'])} · {', '.join(block['datasets'])} · "
                     f"{', '.join(block['algorithms'])} · {len(seeds)} seed(s) {seeds}: {', '.join(arms)}; "
                     f"benchmarks {', '.join(block.get('benchmarks') or config.get('evaluation', {}).get('benchmarks', []))}")
    bases = {b for bs in untrained_bases(config).values() for b in bs}
    if bases:
        lines.append(f"- untrained bases: {', '.join(sorted(bases))}")
    lines.append("Filter `tags.stage = 'train'` for its arms; an arm trained under another configuration is a linked "
                 "run (tag qerl.linked_from).")
    return "\n".join(lines)
