"""MLflow as a study (qerl.tracking, qerl.cli.common.tracked): a workflow invocation's run with its jobs' runs nested
under it, an evaluation nested under the training run of the adapter it evaluates and its pass@1 logged there too,
each run's small result files as artifacts under the store's directory, and a resume across experiments that starts
a linked new run and says so instead of crashing on MLflow's experiment check."""
import argparse
import json

import pytest

mlflow = pytest.importorskip("mlflow")

from qerl import tracking  # noqa: E402
from qerl.cli.common import tracked  # noqa: E402


def _client(uri):
    return mlflow.tracking.MlflowClient(uri)


def test_invocation_run_nests_jobs_and_evaluations_link_to_their_training_run(tmp_path, monkeypatch):
    uri = f"sqlite:///{tmp_path / 'results' / 'mlflow.db'}"
    (tmp_path / "results").mkdir()
    cfg = tmp_path / "effective.yaml"
    cfg.write_text("configuration: study\n")
    parent = tracking.start_parent(uri, "study", "workflow/study", {"config_hash": "abc"}, {}, [cfg])
    monkeypatch.setenv(tracking.PARENT_ENV, parent)
    # a training run: nested under the invocation's run (the environment), its id kept in summary.json
    train = tracking.MLflowTracker("study", "train/m/qerl/grpo/d/seed0", uri, tags={"method": "qerl"})
    train.close()
    run_dir = tmp_path / "results/train/m/qerl/grpo/d/seed0"
    (run_dir / "final").mkdir(parents=True)
    (run_dir / "summary.json").write_text(json.dumps({"mlflow_run_id": train.run_id}))
    # its evaluation, as the workflow runs it: nested under the training run, pass@1 logged on both
    out = tmp_path / "results/eval/b.json"
    out.parent.mkdir(parents=True)
    out.write_text(json.dumps({"pass@1": 0.375}))
    args = argparse.Namespace(command="evaluate", mlflow_run_name="eval/m/qerl/grpo/d/seed0/b", mlflow_uri=uri,
                              mlflow_experiment="study", mlflow_tag=["stage=eval"], adapter=str(run_dir / "final"),
                              name="bench_b", benchmark="x.jsonl", output=str(out), func=None)
    assert tracked(args, lambda a: {"pass_at_1": 0.375, "problems": 8}) == 0
    tracking.end_parent(uri, parent, "FINISHED", [cfg])
    c = _client(uri)
    exp = c.get_experiment_by_name("study")
    assert exp.artifact_location == (tmp_path / "results/mlartifacts/study").resolve().as_uri()  # under results/
    runs = {r.info.run_name: r for r in c.search_runs([exp.experiment_id])}
    assert runs["workflow/study"].info.status == "FINISHED" and runs["workflow/study"].data.params == {"config_hash": "abc"}
    assert runs["train/m/qerl/grpo/d/seed0"].data.tags["mlflow.parentRunId"] == parent
    ev = runs["eval/m/qerl/grpo/d/seed0/b"]
    assert ev.data.tags["mlflow.parentRunId"] == train.run_id == ev.data.tags["qerl.train_run_id"]
    assert c.get_run(train.run_id).data.metrics["pass_at_1/bench_b"] == 0.375
    assert [a.path for a in c.list_artifacts(ev.info.run_id)] == ["b.json"]
    assert {a.path for a in c.list_artifacts(parent)} == {"effective.yaml", "report"}


def test_resume_across_experiments_starts_a_linked_run_and_says_so(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    first = tracking.MLflowTracker("default", "train/x", uri)
    first.close()
    again = tracking.MLflowTracker("default", "train/x", uri, run_id=first.run_id)  # same experiment: continued
    again.close()
    assert again.resumed and again.run_id == first.run_id and "continuing" in again.note
    other = tracking.MLflowTracker("ablation", "train/x", uri, run_id=first.run_id)  # an overlay's experiment
    other.close()
    assert not other.resumed and other.run_id != first.run_id
    assert f"qerl.continues_run={first.run_id}" in other.note
    assert _client(uri).get_run(other.run_id).data.tags["qerl.continues_run"] == first.run_id
    gone = tracking.MLflowTracker("default", "train/x", uri, run_id="0" * 32)  # not in this store
    gone.close()
    assert not gone.resumed and "not in this store" in gone.note
