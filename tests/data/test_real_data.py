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


MATH_FILES = {"math500.jsonl": (500, "plain", "35dc41080a3680858b27fa7e0533d2d547825316fc5dafe5d316f4ccc5a06132"),
              "aime24.jsonl": (30, "aime", "af2b8bd2aa911b6333ad0df32f3ca05c7ae8ed10f1731f4372c8ae26990bf7ac"),
              "amc23.jsonl": (40, "plain", "43707e1ca784602d8479de24ee8ce36609dbebc46dd152b0b12a46611aa898a4")}


def test_the_math_benchmarks_are_the_committed_public_files_and_grade_their_own_gold():
    """config/real/data/README.md: MATH500 (openai/prm800k's test split), AIME 2024 and AMC 2023, byte for byte the
    source files (sha256); every gold answer, boxed, is graded correct by the training reward (math-verify), so a
    wrong score would be the model's, not the reader's."""
    import hashlib

    from qerl.data.tasks import load_local
    from qerl.rewards.registry import RewardSettings, build_reward

    reward = build_reward(RewardSettings(correctness="math"))
    readme = (DATA / "README.md").read_text()
    for name, (rows, fmt, sha) in MATH_FILES.items():
        assert hashlib.sha256((DATA / name).read_bytes()).hexdigest() == sha and sha in readme, name
        records = load_local(DATA / name, "problem", "answer", fmt)
        assert len(records) == rows
        bad = [r["answer"] for r in records if reward(f"The answer is \\boxed{{{r['answer']}}}.", r["answer"]) != 1.0]
        assert not bad, f"{name}: gold answers that do not grade as correct: {bad[:5]}"


def test_the_math_benchmarks_share_no_problem_with_the_training_or_validation_data():
    train = [r["question"] for r in _rows("gsm8k_train.jsonl") + _rows("gsm8k_val.jsonl")]
    train_norm = {_norm(q) for q in train}
    train_grams = [g for q in train if (g := _grams(q))]
    for name in MATH_FILES:
        problems = [r["problem"] for r in _rows(name)]
        assert not {_norm(p) for p in problems} & train_norm, name
        worst = max(len(g & h) / min(len(g), len(h)) for p in problems if (g := _grams(p)) for h in train_grams)
        assert worst <= 0.5, f"{name}: a problem shares {worst:.0%} of its 8-grams with a training problem"


def test_a_jsonl_row_with_a_key_twice_is_refused(tmp_path):
    """issue 80: duplicate keys in benchmark / training rows were taken (the last silently won)."""
    import pytest

    from qerl.data.tasks import DataError, load_local

    f = tmp_path / "rows.jsonl"
    f.write_text('{"prompt": "1+1", "answer": "2"}\n{"prompt": "2+2", "answer": "4", "answer": "5"}\n')
    with pytest.raises(DataError, match=r"rows.jsonl:2: key 'answer' is given twice"):
        load_local(f)
