"""`qerl bench rehearsal` on CPU with a tiny stand-in shape: the paper's stage commands (quantize, train with the
paper's resolved config, evaluate with its protocol) run end to end, each a timed row; the GSM8K-format problems
parse with the gsm8k answer format; the paper's train settings are the ones used, overrides stated."""
import json

from qerl.bench import rehearsal
from qerl.data.tasks import gold_answer
from qerl.models.shapes import QWEN25, Shape


def test_problems_are_gsm8k_format():
    rows = rehearsal.gsm8k_like(5, seed=0)
    assert rows == rehearsal.gsm8k_like(5, seed=0) and len({r["question"] for r in rows}) == 5
    for r in rows:
        assert gold_answer(r["answer"], "gsm8k").isdigit()


def test_paper_config_is_the_table1_qerl_run(tmp_path):
    cfg = rehearsal.paper_train_config(tmp_path / "q", tmp_path / "d.jsonl", tmp_path / "o", 2,
                                       ["rollout.max_new_tokens=8"])
    assert cfg["method"] == "qerl" and cfg["algorithm"]["name"] == "grpo" and cfg["algorithm"]["group_size"] == 8
    assert cfg["prompts_per_step"] == 16 and cfg["algorithm"]["updates_per_batch"] == 4 and cfg["steps"] == 2
    assert cfg["rollout"]["max_new_tokens"] == 8 and cfg["data"]["answer_format"] == "gsm8k"
    assert cfg["tracking"] == {"backend": "none"} and cfg["model"]["path"] == str(tmp_path / "q")


def test_rehearsal_runs_every_stage_on_cpu(tmp_path, monkeypatch):
    monkeypatch.setitem(QWEN25, "tiny", Shape(64, 128, 2, 4, 2, 16, 512))
    rows = []
    sets = ["rollout.max_new_tokens=4", "prompts_per_step=2", "algorithm.group_size=2", "micro_batch_size=4",
            "gradient_checkpointing=false", "device=cpu", "model.dtype=float32"]
    rehearsal.rehearse("tiny", tmp_path / "w", 2, 1, sets, "cpu", rows.append)
    assert [r["stage"] for r in rows] == ["stand-in", "quantize", "train", "evaluate"]
    train = rows[2]
    assert train["steps"] == 2 and train["sequences"] == 8 and train["generated_tokens"] > 0
    assert "overrides rollout.max_new_tokens=4" in train["note"]
    assert rows[3]["problems"] == 1 and rows[3]["sequences"] == 8
    assert json.loads((tmp_path / "w" / "eval.json").read_text())["benchmark"] == "gsm8k_like"
    path = rehearsal.write([{"device": "CPU", **r} for r in rows], tmp_path / "out", "CPU")
    assert path.name == "rehearsal_CPU.csv" and "| tiny | train | ok |" in path.with_suffix(".md").read_text()


def test_a_train_stage_past_its_budget_reports_the_steps_it_finished(tmp_path, monkeypatch):
    """`--stage-timeout`: the train stage is stopped, its finished steps reported (status timeout), evaluation
    skipped; with no finished step the row says so with the log's last lines."""
    import subprocess

    monkeypatch.setitem(QWEN25, "tiny", Shape(64, 128, 2, 4, 2, 16, 512))
    real = rehearsal._run

    def fake(args, log, env=None, timeout=None):
        if args[0] != "train":
            return real(args, log, env, timeout)
        out = tmp_path / "w" / "train"
        out.mkdir(parents=True, exist_ok=True)
        (out / "metrics.jsonl").write_text(json.dumps({"rollout_seconds": 3.0, "train_seconds": 4.0,
                                                       "generated_tokens": 64, "tokens_per_second": 21.3}) + "\n")
        log.write_text("step 1/2 ...\n")
        raise rehearsal.StageTimeout("qerl train stopped after 5 s (--stage-timeout)")

    monkeypatch.setattr(rehearsal, "_run", fake)
    rows = []
    rehearsal.rehearse("tiny", tmp_path / "w", 2, 1, ["device=cpu", "model.dtype=float32"], "cpu", rows.append, 5)
    assert [r["stage"] for r in rows] == ["stand-in", "quantize", "train"]
    assert rows[-1]["status"] == "timeout" and rows[-1]["steps"] == 1 and rows[-1]["seconds_per_step"] == 7.0
    # the real runner turns subprocess's timeout into StageTimeout
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: (_ for _ in ()).throw(subprocess.TimeoutExpired("x", 1)))
    import pytest

    with pytest.raises(rehearsal.StageTimeout, match="stopped after 1 s"):
        real(["train"], tmp_path / "t.log", timeout=1)
