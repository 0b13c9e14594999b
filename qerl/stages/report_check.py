"""Is a fresh run's report the committed example's? Checked for what a run can promise across machines.

What is deterministic and what is not (README, "Determinism"):

* **the same machine, the same config and seed**: a rerun writes the same bytes (tables, per-problem scores,
  adapters) -- the workflow tests check that on every CI run;
* **another CPU family** (another instruction set: AMX, AVX512-BF16, AVX2 kernels round their sums their own way):
  a tiny model's RL run that samples one near-tie differently goes down another path, so its numbers move as seeds
  do. The example is then checked for its shape, exactly, and its numbers within the tolerance it states.

:func:`compare` returns the differences, one line each (empty: the fresh report is the example's):

* the same files (tables, figures, index);
* each CSV table: the same columns and the same rows in the same order, every non-numeric cell equal, every number
  within its tolerance (``tolerance.json`` beside the example: per file, per column, with per-row overrides);
* each Markdown file: equal once its decimal numbers are masked (same labels, columns, rows, links).
"""
from __future__ import annotations

import csv
import io
import json
import math
import re
from pathlib import Path

TOLERANCE_FILE = "tolerance.json"
_DECIMAL = re.compile(r"(?<![\w.])[-+]?\d+\.\d+(?![\w.])")


def _number(cell: str) -> float | None:
    try:
        x = float(cell)
    except ValueError:
        return None
    return x if math.isfinite(x) else None


def load_tolerance(example: Path) -> dict:
    """``example/tolerance.json``: ``{"files": {name: {"columns": {col: tol}, "rows": {first_cell: tol}}}}`` (a row
    override wins over its column's). A missing file or entry is an error naming it: every number needs a stated
    tolerance."""
    path = Path(example) / TOLERANCE_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no tolerance file beside the committed example (what a fresh run's "
                                "numbers may differ by on another machine)")
    data = json.loads(path.read_text())
    if not isinstance(data.get("files"), dict):
        raise ValueError(f"{path}: expected an object with a 'files' object, got keys {sorted(data)}")
    return data["files"]


def _rows(text: str) -> list[list[str]]:
    return list(csv.reader(io.StringIO(text)))


def compare_csv(name: str, fresh: str, example: str, tol: dict) -> list[str]:
    """The differences between two CSV tables ``fresh`` and ``example`` (texts) under ``tol`` (one file's
    entry of :func:`load_tolerance`)."""
    a, b = _rows(fresh), _rows(example)
    if not a or not b:
        return [f"{name}: {'the fresh' if not a else 'the committed'} table is empty"]
    if a[0] != b[0]:
        return [f"{name}: columns {a[0]} (fresh) != {b[0]} (committed)"]
    if [r[:1] for r in a[1:]] != [r[:1] for r in b[1:]]:
        return [f"{name}: rows {[r[0] for r in a[1:]]} (fresh) != {[r[0] for r in b[1:]]} (committed)"]
    cols, by_col, by_row, out = a[0], tol.get("columns", {}), tol.get("rows", {}), []
    for ra, rb in zip(a[1:], b[1:]):
        label = " / ".join(c for c in rb if _number(c) is None) or rb[0]  # the committed row's labels
        if len(ra) != len(rb):
            out.append(f"{name}: row {label!r} has {len(ra)} cells (fresh), {len(rb)} (committed)")
            continue
        for col, x, y in zip(cols, ra, rb):
            nx, ny = _number(x), _number(y)
            if nx is None or ny is None:
                if x != y:
                    out.append(f"{name}: row {label!r}, {col}: {x!r} (fresh) != {y!r} (committed)")
                continue
            t = by_row.get(ra[0], by_col.get(col))
            if t is None:
                out.append(f"{name}: column {col!r} has numbers but no tolerance in {TOLERANCE_FILE}")
            elif abs(nx - ny) > t + 1e-9:
                out.append(f"{name}: row {label!r}, {col}: {x} (fresh) vs {y} (committed): |diff| "
                           f"{abs(nx - ny):.3g} > tolerance {t}")
    return out


def mask_decimals(text: str) -> str:
    """``text`` with each decimal number (``36.1``, ``-0.281``) replaced by ``#``: labels such as ``bf16`` or
    ``seed 0`` stay."""
    return _DECIMAL.sub("#", text)


def compare(fresh: Path, example: Path, tolerance: dict | None = None) -> list[str]:
    """The differences between the report in ``fresh`` and the committed example in ``example`` (see the module
    docstring); ``tolerance`` defaults to the example's ``tolerance.json``."""
    fresh, example = Path(fresh), Path(example)
    tol = load_tolerance(example) if tolerance is None else tolerance
    names = lambda d: {p.name for p in d.iterdir() if p.is_file() and p.name != TOLERANCE_FILE}  # noqa: E731
    out = []
    if names(fresh) != names(example):
        out.append(f"files: only in the fresh report {sorted(names(fresh) - names(example))}, only in the "
                   f"committed example {sorted(names(example) - names(fresh))}")
    for name in sorted(names(fresh) & names(example)):
        a, b = fresh / name, example / name
        if name.endswith(".csv"):
            out += compare_csv(name, a.read_text(), b.read_text(), tol.get(name, {}))
        elif name.endswith(".md"):
            if mask_decimals(a.read_text()) != mask_decimals(b.read_text()):
                out.append(f"{name}: differs beyond its numbers (labels, rows, columns or links)")
    return out
