"""``qerl status`` on a results tree as jobs leave it: finished, running, failed, stopped, not started; bad input is
one line and nothing is written."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import yaml

from qerl.status import status, table


def _tree(root: Path) -> Path:
    results = root / "results"
    config = yaml.safe_load((Path(__file__).resolve().parents[1] / "config/config.yaml").read_text())
    (results / "config").mkdir(parents=True)
    (results / "config/default.yaml").write_text(yaml.safe_dump(config))
    def run(method, algo, rows, summary=False, log="", age=0.0):
        d = results / "train/tiny-qwen2" / method / algo / "synthetic/seed0"
        d.mkdir(parents=True)
        (d / "train.yaml").write_text("steps: 40\n")
        (d / "metrics.jsonl").write_text("".join(json.dumps({"step": i + 1, "reward_mean": 0.1 * i,
                                                              "rollout_seconds": 1.5, "train_seconds": 0.5}) + "\n"
                                                  for i in range(rows)))
        if summary:
            (d / "summary.json").write_text("{}")
        lg = root / "logs/train/tiny-qwen2" / method / algo / "synthetic/seed0.log"
        lg.parent.mkdir(parents=True, exist_ok=True)
        lg.write_text(log)
        for p in (d / "metrics.jsonl", lg):
            os.utime(p, (time.time() - age, time.time() - age))
    run("full", "grpo", 40, summary=True)
    run("lora", "grpo", 12)  # running: written just now
    run("qlora", "grpo", 5, log="step 5/40\nqerl train: error: CUDA out of memory: the update needs 90 GB\n",
        age=3600)
    run("nvfp4_lora", "grpo", 20, age=3600)  # killed: a rerun resumes it
    return results  # (qerl / grpo and qerl / dapo: not started)


def test_status_reads_each_state_from_the_files(tmp_path):
    results = _tree(tmp_path)
    before = sorted(p.stat().st_mtime for p in results.rglob("*") if p.is_file())
    name, runs = status(results)
    by = {r.run.split("/")[1] + "/" + r.run.split("/")[2]: r for r in runs}
    assert name == "default" and len(runs) == 6
    assert by["full/grpo"].state == "finished" and by["full/grpo"].eta_s is None
    lora = by["lora/grpo"]
    assert lora.state == "running" and (lora.step, lora.total) == (12, 40) and abs(lora.reward - 1.1) < 1e-9
    assert lora.seconds_per_step == 2.0 and lora.eta_s == 28 * 2.0
    assert by["qlora/grpo"].state == "failed" and "out of memory" in by["qlora/grpo"].note
    assert by["nvfp4_lora/grpo"].state == "stopped" and "resumes" in by["nvfp4_lora/grpo"].note
    assert by["qerl/grpo"].state == by["qerl/dapo"].state == "not started"
    shown = table(runs, name)
    assert "6 training run(s): 1 finished, 1 running, 1 failed, 1 stopped, 2 not started" in shown
    assert "tiny-qwen2/lora/grpo/synthetic/seed0" in shown and "12/40" in shown and "0:00:56" in shown
    assert sorted(p.stat().st_mtime for p in results.rglob("*") if p.is_file()) == before  # nothing written


def test_status_on_a_directory_that_is_not_a_results_tree_is_one_line(tmp_path):
    (tmp_path / "notes.txt").write_text("x")
    for target in (tmp_path, tmp_path / "notes.txt", tmp_path / "missing"):
        out = subprocess.run([sys.executable, "-m", "qerl", "status", str(target)], capture_output=True, text=True)
        assert out.returncode == 2 and out.stderr.count("\n") == 1 and "qerl status: error:" in out.stderr, out.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]
