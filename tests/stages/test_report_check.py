"""qerl.stages.report_check: the committed example against a fresh report -- shape exact, numbers within the
tolerance the example states; a stale copy (a changed row, label, column, file, or a number outside tolerance) is
caught, and a number moved within tolerance is not."""
import json
import shutil
from pathlib import Path

import pytest

from qerl.stages import report_check

EXAMPLE = Path(__file__).resolve().parents[2] / "reports/default"


@pytest.fixture
def fresh(tmp_path):
    out = tmp_path / "fresh"
    shutil.copytree(EXAMPLE, out, ignore=shutil.ignore_patterns("evidence", report_check.TOLERANCE_FILE))
    return out


def _edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, (path, old)
    path.write_text(text.replace(old, new, 1))


def test_the_example_equals_itself_and_states_a_tolerance_for_every_number(fresh):
    assert report_check.compare(fresh, EXAMPLE) == []
    tol = json.loads((EXAMPLE / report_check.TOLERANCE_FILE).read_text())
    assert tol["files"]["table1.csv"]["rows"]["bf16, untrained"] < tol["files"]["table1.csv"]["columns"][
        "tiny-qwen2 (ours)"]  # an untrained model moves by near-ties only; a trained one as seeds do


@pytest.mark.parametrize("file, old, new, says", [
    ("table1.csv", "bf16 LoRA,45.8", "bf16 LoRA,25.7", "|diff| 20.1 > tolerance 20.0"),  # a number outside tolerance
    ("table1.csv", '"bf16, untrained",36.1', '"bf16, untrained",41.0', "> tolerance 4.5"),  # an untrained row's own
    ("table1.csv", "NVFP4 LoRA,", "NVFP4 LoRA (v2),", "rows"),  # a changed label
    ("table1.csv", "method,tiny-qwen2 (ours),paper", "method,tiny-qwen2 (ours),ours2", "columns"),
    ("runs.csv", "qerl,—,dapo", "qerl,—,grpo", "row 'tiny-qwen2 / qerl / qerl / — / dapo / synthetic', algorithm: 'grpo' (fresh) != 'dapo'"),  # a changed cell
    ("runs.csv", "synthetic,0,0.281,0.383", "synthetic,1,0.281,0.383", "seed"),  # integers: exact
    ("index.md", "## Figures", "## Plots", "index.md: differs beyond its numbers"),
    ("table1.md", "| NF4 LoRA (QLoRA) |", "| QLoRA |", "table1.md"),
])
def test_a_stale_example_is_caught(fresh, file, old, new, says):
    _edit(fresh / file, old, new)
    problems = report_check.compare(fresh, EXAMPLE)
    assert problems and any(says in p for p in problems), problems


def test_numbers_within_tolerance_and_masked_markdown_numbers_pass(fresh):
    _edit(fresh / "table1.csv", "bf16 LoRA,45.8", "bf16 LoRA,38.0")  # 7.8 points: as another CPU / seed moved it
    _edit(fresh / "table1.md", "| bf16 LoRA | 45.8 |", "| bf16 LoRA | 38.0 |")
    _edit(fresh / "runs.csv", "0.281,0.383,49.2", "0.301,0.363,44.0")
    assert report_check.compare(fresh, EXAMPLE) == []


def test_a_missing_or_extra_file_and_a_missing_tolerance_are_named(fresh, tmp_path):
    (fresh / "accuracy.png").unlink()
    (fresh / "table2.csv").write_text("method,x\na,1.0\n")
    problems = report_check.compare(fresh, EXAMPLE)
    assert any("only in the fresh report ['table2.csv']" in p and "['accuracy.png']" in p for p in problems)
    bare = tmp_path / "bare"
    shutil.copytree(EXAMPLE, bare, ignore=shutil.ignore_patterns("evidence", report_check.TOLERANCE_FILE))
    with pytest.raises(FileNotFoundError, match="tolerance.json: no tolerance file"):
        report_check.compare(fresh, bare)
    untolerated = report_check.compare_csv("t.csv", "a,b\nx,1.5\n", "a,b\nx,1.5\n", {})
    assert untolerated == ["t.csv: column 'b' has numbers but no tolerance in tolerance.json"]
