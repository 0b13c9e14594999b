"""Writing qerl's files, atomically and in one place: every result, record, manifest and report goes through here
(a temporary file beside the target, then one rename), so a kill, a full disk or an error while writing leaves the
previous file whole and no temporary behind. Reading them back strictly: :mod:`qerl.readers`. (Checkpoint
*directories* are swapped whole by :func:`qerl.checkpoint.atomic_directory`; figures are saved through
:func:`qerl.figures.save_figure`, which writes here.) Light: no torch.
"""
from __future__ import annotations

import contextlib
import json
import os
import uuid
from pathlib import Path


def temporary(path: str | Path) -> Path:
    """A fresh temporary name beside ``path`` (hidden, unique to this process and call)."""
    path = Path(path)
    return path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:6]}")


def commit(tmp: str | Path, path: str | Path) -> None:
    """Rename the written temporary ``tmp`` over ``path`` (one atomic step on a POSIX file system)."""
    os.replace(tmp, path)


@contextlib.contextmanager
def atomic_open(path: str | Path, mode: str = "w", **kwargs):
    """``open(path, mode, **kwargs)`` for a file qerl writes: what the block writes goes to a temporary file beside
    ``path`` (its directory made if missing) and replaces it in one rename when the block ends; an error inside
    leaves ``path`` as it was and no temporary."""
    os.makedirs(os.path.dirname(str(path)) or ".", exist_ok=True)
    tmp = temporary(path)
    try:
        with open(tmp, mode, **kwargs) as f:
            yield f
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    commit(tmp, path)


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically (:func:`atomic_open`)."""
    with atomic_open(path) as f:
        f.write(text)


def write_json(path: str | Path, obj, indent: int | None = 2) -> None:
    """``obj`` as JSON (one trailing newline), atomically."""
    with atomic_open(path) as f:
        json.dump(obj, f, indent=indent, sort_keys=False)
        f.write("\n")


def write_jsonl(path: str | Path, rows) -> None:
    """``rows`` (dicts, or JSON lines already encoded) one a line, atomically."""
    with atomic_open(path) as f:
        for r in rows:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
