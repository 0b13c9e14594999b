"""Reading the JSON files qerl writes and reads back (evaluation summaries, run summaries, metrics rows), strictly
and in one place: a key given twice, a NaN / Infinity literal, a value of the wrong type are refused with one line
naming the file, the line and the key, never carried into a table or a verdict. (YAML: :mod:`qerl.yamlio`, the
workflow configs :func:`qerl.workflow_config.read_workflow_config`.) Light: no torch.
"""
from __future__ import annotations

import gzip
import json
import math
from pathlib import Path


class InputFileError(ValueError):
    """A file qerl reads back is not what it should be; the message names the file, the line and the key."""


def _pairs(source: str):
    def hook(pairs):
        out = {}
        for k, v in pairs:
            if k in out:
                raise InputFileError(f"{source}: key {k!r} is given twice (the last would silently win)")
            out[k] = v
        return out
    return hook


def _no_constant(source: str):
    def refuse(name):
        raise InputFileError(f"{source}: holds {name}, not a number JSON allows (a diverged run?)")
    return refuse


def loads(text: str, source: str, allow_nan: bool = False):
    """``json.loads`` refusing duplicate keys and (unless ``allow_nan``) NaN / Infinity; errors name ``source``
    (file[:line])."""
    try:
        return json.loads(text, object_pairs_hook=_pairs(source),
                          **({} if allow_nan else {"parse_constant": _no_constant(source)}))
    except json.JSONDecodeError as e:
        raise InputFileError(f"{source}: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})") from None


def read_text(path: Path, what: str) -> str:
    """The UTF-8 text of ``path`` (gzip-compressed when its name ends in ``.gz``: the committed evidence); a missing
    or non-text file is an :class:`InputFileError` naming it and ``what``."""
    path = Path(path)
    try:
        if path.suffix == ".gz":
            with gzip.open(path, "rt", encoding="utf-8") as f:
                return f.read()
        return path.read_text()
    except FileNotFoundError:
        raise InputFileError(f"{path}: no such {what}") from None
    except (UnicodeDecodeError, gzip.BadGzipFile, EOFError):
        raise InputFileError(f"{path}: not a text file (a {what} expected)") from None


def read_json(path: Path, what: str = "JSON file"):
    return loads(read_text(path, what), str(path))


def read_jsonl(path: Path, what: str = "JSONL file", allow_nan: bool = False) -> list[dict]:
    """Every non-empty line of ``path`` as a JSON object (a line that is not one names its number). ``allow_nan``:
    NaN / Infinity are read as floats (a training metric may be one; the reader that judges a field names the run
    and the step)."""
    path = Path(path)
    lines = read_text(path, what).splitlines()
    rows = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        row = loads(line, f"{path}:{i}", allow_nan)
        if not isinstance(row, dict):
            raise InputFileError(f"{path}:{i}: a {type(row).__name__}, not a JSON object (a row of a {what})")
        rows.append(row)
    return rows


def read_csv(path: Path, what: str = "CSV file", columns: tuple[str, ...] = ()) -> list[dict]:
    """The rows of a CSV table with a header, as dicts: a file that is not UTF-8 text, has no header, lacks one of
    ``columns`` or has a row of another width than its header is an :class:`InputFileError` naming the file (and
    the line)."""
    import csv
    import io

    path = Path(path)
    table = list(csv.reader(io.StringIO(read_text(path, what))))
    if not table or not any(table[0]):
        raise InputFileError(f"{path}: empty, no header row (a {what} expected)")
    header, rows = table[0], []
    if missing := [c for c in columns if c not in header]:
        raise InputFileError(f"{path}: no column {', '.join(map(repr, missing))} (a {what} has {', '.join(columns)};"
                             f" this one: {', '.join(header[:8])}{', …' if len(header) > 8 else ''})")
    for i, row in enumerate(table[1:], 2):
        if not row:
            continue
        if len(row) != len(header):
            raise InputFileError(f"{path}:{i}: {len(row)} fields, the header has {len(header)} (a cut or edited "
                                 f"{what}?)")
        rows.append(dict(zip(header, row)))
    return rows


def is_number(value, finite: bool = True) -> bool:
    """A JSON number (not a bool), and finite unless ``finite`` is False (NaN allowed: a gap in a curve)."""
    return not isinstance(value, bool) and isinstance(value, (int, float)) and (not finite or math.isfinite(value))


def number(value, where: str, lo: float = -math.inf, hi: float = math.inf) -> float:
    """``value`` as a finite number in ``[lo, hi]``, else :class:`InputFileError` naming ``where``."""
    if not is_number(value):
        raise InputFileError(f"{where}: expected a finite number, got {value!r}")
    if not lo <= value <= hi:
        raise InputFileError(f"{where}: expected a number in [{lo:g}, {hi:g}], got {value!r}")
    return float(value)


def cell(text: str, where: str) -> float:
    """A CSV cell as a finite number, else :class:`InputFileError` naming ``where``."""
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise InputFileError(f"{where}: expected a number, got {text!r}") from None
    return number(value, where)


def read_eval_summary(path: Path) -> dict:
    """An evaluation summary (``qerl evaluate --output``): a JSON object whose ``pass@1`` and ``per_problem`` scores
    are numbers in [0, 1]."""
    data = read_json(path, "evaluation summary")
    if not isinstance(data, dict) or "pass@1" not in data:
        raise InputFileError(f"{path}: not an evaluation summary (no 'pass@1')")
    number(data["pass@1"], f"{path}: pass@1", 0, 1)
    per = data.get("per_problem")
    if per is not None:
        if not isinstance(per, list):
            raise InputFileError(f"{path}: per_problem: expected a list of scores, got {type(per).__name__}")
        for i, x in enumerate(per):
            number(x, f"{path}: per_problem[{i}]", 0, 1)
    return data
