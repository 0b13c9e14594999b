"""Tasks: synthetic arithmetic, local files with field mapping and row errors, prompt templates."""
import json

import pandas as pd
import pytest
from transformers import AutoTokenizer

from qerl.data.loading import load_train_records
from qerl.data.tasks import (HUB_TASKS, PAPER_SUFFIX, DataError, format_prompt, load_hub, load_local,
                             synthetic_arithmetic)
from qerl.train.config import DataConfig


def test_synthetic_is_seeded_and_correct():
    a, b = synthetic_arithmetic(50, seed=1), synthetic_arithmetic(50, seed=1)
    assert a == b and a != synthetic_arithmetic(50, seed=2)
    for r in synthetic_arithmetic(200, seed=0, ops="+-*"):
        assert eval(r["prompt"].rstrip("=")) == int(r["answer"])


def test_local_jsonl_and_parquet_with_field_mapping(tmp_path):
    rows = [{"q": "1+1?", "sol": "so\n#### 2"}, {"q": "2+2?", "sol": "#### 4"}]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    pd.DataFrame(rows).to_parquet(tmp_path / "d.parquet")
    for name in ("d.jsonl", "d.parquet"):
        recs = load_local(tmp_path / name, "q", "sol", "gsm8k")
        assert recs == [{"prompt": "1+1?", "answer": "2"}, {"prompt": "2+2?", "answer": "4"}]


def test_local_errors_name_the_row(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"prompt": "a", "answer": "1"}\n{"prompt": "b"}\n')
    with pytest.raises(DataError, match=r"row 1 has no field\(s\) \['answer'\]"):
        load_local(tmp_path / "bad.jsonl")
    (tmp_path / "broken.jsonl").write_text('{"prompt": "a", "answer": "1"}\n{nope\n')
    with pytest.raises(DataError, match="line 2 is not JSON"):
        load_local(tmp_path / "broken.jsonl")
    (tmp_path / "g.jsonl").write_text('{"prompt": "a", "answer": "no marker"}\n')
    with pytest.raises(DataError, match="row 0.*####"):
        load_local(tmp_path / "g.jsonl", answer_format="gsm8k")
    with pytest.raises(DataError, match="unsupported file type"):
        load_local(tmp_path / "g.csv") if (tmp_path / "g.csv").write_text("x") else None
    with pytest.raises(DataError, match="not found"):
        load_local(tmp_path / "missing.jsonl")


def test_templates(tiny_dirs):
    tok = AutoTokenizer.from_pretrained(tiny_dirs["qwen2"])
    assert format_prompt("3+4=") == "3+4="
    chat = format_prompt("What is 3+4?", tok, "paper")
    assert chat.startswith("<|im_start|>user\nWhat is 3+4? " + PAPER_SUFFIX[:20])
    assert chat.endswith("<|im_start|>assistant\n")
    with pytest.raises(DataError, match="template"):
        format_prompt("x", tok, "alpaca")


def test_hub_specs_and_offline_error(monkeypatch):
    assert HUB_TASKS["gsm8k"].repo == "openai/gsm8k" and HUB_TASKS["gsm8k"].answer_format == "gsm8k"
    assert HUB_TASKS["bigmath_l45"].config == "level_4_5" and HUB_TASKS["bigmath_l45"].max_prompt_chars == 1024
    assert {"math500", "aime24", "aime25", "amc23", "gsm8k_test", "dapo_math", "bigmath_l345"} <= set(HUB_TASKS)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(DataError, match="local JSONL/Parquet"):
        load_hub("gsm8k")
    with pytest.raises(DataError, match="unknown task"):
        load_hub("mmlu")


def test_load_train_records_dispatch(tmp_path):
    assert len(load_train_records(DataConfig(task="synthetic", synthetic_size=10), 0)) == 10
    with pytest.raises(DataError, match="data.path"):
        load_train_records(DataConfig(task="local"), 0)
    with pytest.raises(DataError, match="data.task"):
        load_train_records(DataConfig(task="nope"), 0)


def test_an_empty_prompt_is_refused_like_an_empty_answer(tmp_path):
    """A row without a question would be trained on and scored by its answer alone: refused, naming the row."""
    import json

    f = tmp_path / "d.jsonl"
    f.write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n" + json.dumps({"prompt": "  ", "answer": "3"}))
    with pytest.raises(DataError, match=r"d.jsonl: row 1, field 'prompt' is empty"):
        load_local(f)
