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


def test_local_benchmark_files_evaluate_offline(tiny_dirs, tmp_path, capsys):
    """A benchmark from a local file (no hub): the same loader as training data, its fields and answer format
    named on the command line; the summary names the file and its sha256; the golds are parsed per format."""
    import hashlib

    import pandas as pd
    import pytest

    from qerl.data.tasks import DataError, gold_answer, load_local
    from qerl.stages.evaluate import benchmark_records, EvalSettings, resolve_benchmark

    gsm = tmp_path / "my_gsm8k.jsonl"
    gsm.write_text("".join(json.dumps({"question": f"{a}+{a}=", "answer": f"{a} plus {a} #### {2 * a:,}"}) + "\n"
                           for a in (3, 600, 7)))
    out = tmp_path / "eval" / "gsm.json"
    argv = ["evaluate", "--model", str(tiny_dirs["qwen2"]), "--base", "bf16", "--benchmark", str(gsm),
            "--prompt-field", "question", "--answer-field", "answer", "--answer-format", "gsm8k", "--template", "raw",
            "--output", str(out), "--samples", "1", "--max-new-tokens", "3", "--device", "cpu", "--no-progress"]
    assert main(argv) == 0
    summary = json.loads(out.read_text())
    assert summary["benchmark"] == "my_gsm8k" and summary["problems"] == 3
    assert summary["benchmark_file"] == str(gsm)
    assert summary["benchmark_sha256"] == hashlib.sha256(gsm.read_bytes()).hexdigest()
    golds = [json.loads(x)["gold"] for x in out.with_suffix(".samples.jsonl").read_text().splitlines()]
    assert golds == ["6", "1200", "14"]
    # boxed solutions in a Parquet file, AIME integers; both through the training loader too
    pq = tmp_path / "olymp.parquet"
    pd.DataFrame({"problem": ["p1", "p2"], "solution": ["so \\boxed{\\frac{1}{2}}.", "thus \\boxed{7}"]}).to_parquet(pq)
    b = resolve_benchmark(str(pq), prompt_field="problem", answer_field="solution", answer_format="boxed")
    recs, kind, _ = benchmark_records(b, EvalSettings())
    assert [r["answer"] for r in recs] == ["\\frac{1}{2}", "7"] and kind == "math" and b.name == "olymp"
    assert load_local(pq, "problem", "solution", "boxed") == recs
    assert gold_answer("033", "aime") == "33"
    aime = tmp_path / "aime.jsonl"
    aime.write_text(json.dumps({"prompt": "x", "answer": "033"}) + "\n" + json.dumps({"prompt": "y", "answer": "1e3"}))
    with pytest.raises(DataError, match=r"aime.jsonl: row 1, field 'answer' \(aime format\): an AIME answer is an "
                                        r"integer 0 \.\.\. 999, got '1e3'"):
        load_local(aime, answer_format="aime")
    # a local benchmark declares its verifier (math by default): exact match, as the synthetic task is judged
    exact = resolve_benchmark(str(pq), prompt_field="problem", answer_field="solution", answer_format="boxed",
                              verifier="exact")
    assert benchmark_records(exact, EvalSettings())[1] == "exact"
    # bad invocations are named before any model loads
    for extra, msg in ((["--benchmark", str(tmp_path / "nope.jsonl")], "nope.jsonl: file not found"),
                       (["--benchmark", "gsm8k_test", "--answer-format", "gsm8k"], "apply to local files only"),
                       (["--benchmark", "math500", "--verifier", "exact"], "(verifier math)"),
                       (["--benchmark", str(tmp_path / "x.csv")], "neither a known benchmark")):
        args = [a for a in argv if a not in ("--prompt-field", "question", "--answer-field", "answer",
                                            "--answer-format", "gsm8k", "--benchmark", str(gsm))]
        assert main(args + extra) == 2
        assert msg in capsys.readouterr().err


def test_a_registered_benchmark_is_one_row_of_one_table(tmp_path, monkeypatch):
    """The table (qerl.data.tasks.REGISTERED_BENCHMARKS) is what the CLI's help, the resolver, the records and the
    projections read: a row added there (a throw-away one: the synthetic task under another name, judged exactly)
    resolves, loads and is judged by its declared verifier without touching another file; the workflow schema's
    lists of registered names are the table's (a test ties the data file to it)."""
    from pathlib import Path

    import yaml

    from qerl.data import tasks
    from qerl.stages.evaluate import EvalSettings, benchmark_records, resolve_benchmark

    row = tasks.RegisteredBenchmark("synthetic", "exact", template="raw", doc="a throw-away row")
    monkeypatch.setitem(tasks.REGISTERED_BENCHMARKS, "arith_small", row)
    monkeypatch.setattr(tasks, "BENCHMARKS", tuple(tasks.REGISTERED_BENCHMARKS))
    import qerl.stages.evaluate as ev

    monkeypatch.setattr(ev, "BENCHMARKS", tasks.BENCHMARKS)
    b = resolve_benchmark("arith_small")
    recs, verifier, template = benchmark_records(b, EvalSettings(synthetic_size=5))
    assert (b.source, verifier, template, len(recs)) == ("synthetic", "exact", "raw", 5)
    assert "arith_small (a throw-away row, verifier exact)" in " ".join(_evaluate_help().split())
    monkeypatch.undo()
    schema = yaml.safe_load((Path(__file__).resolve().parents[2] / "workflow/schemas/config.schema.yaml").read_text())
    text = json.dumps(schema)
    assert f'"propertyNames": {{"$ref": "#/$defs/name", "not": {{"enum": {json.dumps(list(tasks.BENCHMARKS))}}}}}' \
        in text
    assert ", ".join(tasks.BENCHMARKS) in text  # (the description of evaluation.benchmarks)
    assert json.dumps(list(tasks.VERIFIERS)) in text


def _evaluate_help() -> str:
    import contextlib
    import io

    from qerl.cli import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.suppress(SystemExit):
        main(["evaluate", "--help"])
    return buf.getvalue()
