"""Reading in one place (qerl.readers): the JSON files qerl reads back refuse a key given twice, NaN / Infinity
where a score is read, and values of the wrong type, each in one line naming the file (and line) and the key."""
import pytest

from qerl.readers import InputFileError, read_eval_summary, read_json, read_jsonl


def test_duplicates_constants_and_types_are_named(tmp_path):
    f = tmp_path / "s.json"
    f.write_text('{"pass@1": 0.5,\n "pass@1": 0.9}')
    with pytest.raises(InputFileError, match=r"s.json: key 'pass@1' is given twice"):
        read_json(f)
    f.write_text('{"pass@1": NaN, "per_problem": []}')
    with pytest.raises(InputFileError, match=r"s.json: holds NaN"):
        read_eval_summary(f)
    for body, message in (('{"pass@1": "high"}', r"pass@1: expected a finite number, got 'high'"),
                          ('{"pass@1": 1.5}', r"pass@1: expected a number in \[0, 1\], got 1.5"),
                          ('{"pass@1": 0.5, "per_problem": [1, "x"]}', r"per_problem\[1\]: expected a finite"),
                          ('{"pass@1": 0.5, "per_problem": 3}', "per_problem: expected a list"),
                          ('[1, 2]', "not an evaluation summary"),
                          ('{"pass@1": 0.5', r"not valid JSON \(.* at line 1")):
        f.write_text(body)
        with pytest.raises(InputFileError, match=message):
            read_eval_summary(f)
    f.write_text('{"pass@1": 0.5, "per_problem": [1, 0]}')
    assert read_eval_summary(f)["per_problem"] == [1, 0]
    f.write_bytes(b"\xff\xfe")
    with pytest.raises(InputFileError, match="not a text file"):
        read_json(f)
    with pytest.raises(InputFileError, match="no such JSON file"):
        read_json(tmp_path / "none.json")


def test_jsonl_rows_name_their_line_and_may_carry_nan_where_asked(tmp_path):
    f = tmp_path / "metrics.jsonl"
    f.write_text('{"step": 1, "kl": NaN}\n\n[3]\n')
    with pytest.raises(InputFileError, match=r"metrics.jsonl:1: holds NaN"):
        read_jsonl(f)
    with pytest.raises(InputFileError, match=r"metrics.jsonl:3: a list, not a JSON object"):
        read_jsonl(f, allow_nan=True)
    f.write_text('{"step": 1, "kl": NaN}\n{"step": 2, "step": 3}\n')
    with pytest.raises(InputFileError, match=r"metrics.jsonl:2: key 'step' is given twice"):
        read_jsonl(f, allow_nan=True)


def test_one_reader_of_workflow_configs(tmp_path):
    """read_workflow_config (report, claims, bench cost, fetch and the Snakefile): a section given twice, an unknown
    key (with the nearest valid one), a key its model source would ignore, and what the schema requires are one line
    each, naming the file and the key's path; overlays merge as snakemake merges them."""
    from pathlib import Path

    import yaml

    from qerl.workflow_config import ConfigFileError, read_workflow_config

    root = Path(__file__).resolve().parents[1]
    base = root / "config/config.yaml"
    assert read_workflow_config([root / "config/real/real.yaml", root / "config/real/bases.yaml"])["experiments"] == []
    cases = {
        "twice.yaml": ("evaluation: {benchmarks: [a]}\nevaluation: {benchmarks: [b]}\n",
                       "key 'evaluation' is given twice (lines 1 and 2)"),
        "typo.yaml": ("models: {tiny-qwen2: {source: tiny, revison: main}}\n",
                      "unknown key 'models.tiny-qwen2.revison' (did you mean 'revision'?)"),
        "gguf.yaml": ("models: {tiny-qwen2: {source: gguf, path: m.gguf, sft_steps: 5, seed: 1}}\n",
                      "models.tiny-qwen2: seed, sft_steps are not read for source 'gguf'"),
        "hub.yaml": ("models: {tiny-qwen2: {source: hub, hub_id: a/b}}\n", "'revision' is a required property"),
    }
    for name, (text, message) in cases.items():
        f = tmp_path / name
        f.write_text(text)
        with pytest.raises(ConfigFileError) as e:
            read_workflow_config([base, f])
        assert message in str(e.value) and str(tmp_path) in str(e.value), str(e.value)
        assert "\n" not in str(e.value)
    merged = read_workflow_config([base, tmp_path / "ok.yaml"]) if (tmp_path / "ok.yaml").write_text(
        yaml.safe_dump({"train": {"steps": 3}})) else None
    assert merged["train"]["steps"] == 3 and merged["models"] == yaml.safe_load(base.read_text())["models"]


def test_read_csv_names_a_missing_column_a_ragged_row_and_a_bad_cell(tmp_path):
    from qerl.readers import InputFileError, cell, read_csv

    f = tmp_path / "t.csv"
    f.write_text("method,total_s\nqerl,1.5\n")
    assert read_csv(f, "step table", ("method", "total_s")) == [{"method": "qerl", "total_s": "1.5"}]
    with pytest.raises(InputFileError, match=r"t.csv: no column 'batch' \(a step table has method, batch"):
        read_csv(f, "step table", ("method", "batch"))
    f.write_text("method,total_s\nqerl,1.5,9\n")
    with pytest.raises(InputFileError, match=r"t.csv:2: 3 fields, the header has 2"):
        read_csv(f)
    f.write_text("")
    with pytest.raises(InputFileError, match="empty, no header"):
        read_csv(f)
    f.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(InputFileError, match="not a text file"):
        read_csv(f)
    assert cell("2.5", "x") == 2.5
    for bad in ("fast", "nan", "inf", ""):
        with pytest.raises(InputFileError, match="x: expected"):
            cell(bad, "x")


def test_gzipped_files_read_like_plain_ones_and_a_broken_one_is_named(tmp_path):
    """Committed evidence is gzipped (``*.jsonl.gz``): read as its text, with the same line-numbered errors; a file
    named .gz that is not gzip is refused naming it."""
    import gzip

    f = tmp_path / "m.metrics.jsonl.gz"
    f.write_bytes(gzip.compress(b'{"step": 1}\n\n{"step": 2}\n'))
    assert read_jsonl(f) == [{"step": 1}, {"step": 2}]
    f.write_bytes(gzip.compress(b'{"step": 1}\n{"step": 1, "step": 2}\n'))
    with pytest.raises(InputFileError, match=r"m.metrics.jsonl.gz:2: key 'step' is given twice"):
        read_jsonl(f)
    f.write_bytes(b'{"step": 1}\n')
    with pytest.raises(InputFileError, match="m.metrics.jsonl.gz: not a text file"):
        read_jsonl(f, "metrics file")
