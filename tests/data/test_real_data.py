"""config/real's GSM8K problems: real GSM8K rows, the held-out set disjoint from the training set."""
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "config/real/data"


def _rows(name):
    return [json.loads(line) for line in (DATA / name).read_text().splitlines() if line.strip()]


def _norm(text):
    return re.sub(r"[^a-z0-9]+", " ", text.lower()).strip()


def _grams(text, n=8):
    words = _norm(text).split()
    return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}


def test_train_and_test_problems_are_real_gsm8k_and_disjoint():
    from qerl.data.tasks import load_local

    train, test = _rows("gsm8k_train.jsonl"), _rows("gsm8k_test.jsonl")
    assert len(train) == 1000 and len(test) >= 100
    for rows, split in ((train, "train"), (test, "test")):
        assert all(r["id"].startswith(f"{split}-") for r in rows) and len({r["id"] for r in rows}) == len(rows)
        records = load_local(DATA / f"gsm8k_{split}.jsonl", "question", "answer", "gsm8k")
        assert len(records) == len(rows) and all(re.fullmatch(r"-?[\d.]+", r["answer"]) for r in records)
    assert not {_norm(r["question"]) for r in train} & {_norm(r["question"]) for r in test}
    train_grams = [_grams(r["question"]) for r in train]
    worst = max(len(g & h) / min(len(g), len(h)) for r in test if (g := _grams(r["question"]))
                for h in train_grams if h)
    assert worst <= 0.5, f"a test problem shares {worst:.0%} of its 8-grams with a training problem"


def test_validation_split_and_500_test_problems_are_disjoint_from_training_and_each_other():
    """Round 2 (config/real/real.yaml): the validation split (500 GSM8K *train* problems that chooses learning rates)
    shares no problem with the 1,000 trained on nor with the test set; the 500-problem test set holds round 1's 200."""
    train, val = _rows("gsm8k_train.jsonl"), _rows("gsm8k_val.jsonl")
    test200, test500 = _rows("gsm8k_test.jsonl"), _rows("gsm8k_test500.jsonl")
    assert len(val) == 500 and len(test500) == 500
    assert all(r["id"].startswith("train-") for r in val) and all(r["id"].startswith("test-") for r in test500)
    assert not {r["id"] for r in val} & {r["id"] for r in train}
    assert {r["id"] for r in test200} <= {r["id"] for r in test500}
    norm = lambda rows: {_norm(r["question"]) for r in rows}  # noqa: E731
    assert not norm(val) & norm(train) and not norm(val) & norm(test500) and not norm(train) & norm(test500)
    for name, rows in (("validation", val), ("training", train)):
        grams = [_grams(r["question"]) for r in rows]
        worst = max(len(g & h) / min(len(g), len(h)) for r in test500 if (g := _grams(r["question"]))
                    for h in grams if h)
        assert worst <= 0.5, f"a test problem shares {worst:.0%} of its 8-grams with a {name} problem"
