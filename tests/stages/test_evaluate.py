"""``qerl evaluate`` end to end on a tiny model: the summary and samples, a log line per chunk of problems without
a progress bar, the output's lock released afterwards and refused while held."""
import json
import subprocess
import sys

from qerl.cli import main


def test_evaluate_writes_summary_samples_and_progress_lines(tiny_dirs, tmp_path, capsys):
    out = tmp_path / "eval" / "synthetic_test.json"
    argv = ["evaluate", "--model", str(tiny_dirs["qwen2"]), "--base", "bf16", "--benchmark", "synthetic_test",
            "--output", str(out), "--samples", "2", "--limit", "20", "--batch-size", "8", "--max-new-tokens", "3",
            "--device", "cpu", "--no-progress"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    summary = json.loads(out.read_text())
    assert summary["problems"] == 20 and summary["samples_per_problem"] == 2
    samples = out.with_suffix(".samples.jsonl").read_text().splitlines()
    assert len(samples) == 40 and {"completion", "gold", "correct"} <= set(json.loads(samples[0]))
    lines = [x for x in printed.splitlines() if x.startswith("eval synthetic_test: ")]
    assert lines[-1].startswith("eval synthetic_test: 20/20 problems, pass@1 so far") and len(lines) >= 5
    assert not (out.parent / ".synthetic_test.json.lock").exists()
    # while another process holds the output, a second writer is refused at once
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from qerl.outputs import hold\n"
                               f"with hold({str(out)!r}, 'evaluate'):\n    print('held', flush=True); time.sleep(60)"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert main(argv) == 2
        assert f"{out} is in use by PID {holder.pid}" in capsys.readouterr().err
    finally:
        holder.kill()
        holder.wait()
    assert json.loads(out.read_text()) == summary  # untouched by the refused writer
