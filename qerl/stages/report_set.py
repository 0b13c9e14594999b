"""A ``qerl claims`` report is written as one set: every file into a staging folder inside ``--output`` first, then
renamed into place, so a failed or interrupted rerun (a full disk, a bad input found late) leaves the previous
report as it was; and only over files qerl claims wrote.

Ownership is read from the files themselves: a text file qerl claims would replace must begin as the one it writes
begins (its title or its CSV header), a figure must be a PNG beside such a report. Anything else in the way — a
user's ``claims.md``, a CSV of another program — is refused before anything is renamed, with one line naming it.
"""
from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from qerl.files import commit
from qerl.outputs import OutputNotWritable

SIGNATURE = 16  # characters of the first line that identify what wrote a text file
PNG = b"\x89PNG\r\n\x1a\n"


class NotOurs(OutputNotWritable):
    """``--output`` holds a file of a report's name that qerl claims did not write."""


def _first_line(path: Path) -> str:
    with open(path, "rb") as f:
        return f.readline(4096).decode("utf-8", errors="replace").rstrip("\r\n")


def check_owned(out: Path, staged: Path) -> None:
    """Every file of ``staged`` that exists in ``out`` was written there by qerl claims (same kind of first line;
    a PNG beside them); otherwise :class:`NotOurs` naming the first one in the way."""
    for new in sorted(staged.iterdir()):
        old = out / new.name
        if not old.exists() and not old.is_symlink():
            continue
        if old.is_symlink() or not old.is_file():
            raise NotOurs(f"--output {out}: {new.name} is {'a link' if old.is_symlink() else 'a directory'}, not a "
                          "file qerl claims wrote; choose another directory or move it")
        if new.suffix == ".png":
            with open(old, "rb") as f:
                if f.read(len(PNG)) != PNG:
                    raise NotOurs(f"--output {out}: {new.name} is not a figure qerl claims wrote (not a PNG); choose "
                                  "another directory or move it")
            continue
        have, want = _first_line(old), _first_line(new)
        if have[:SIGNATURE] != want[:SIGNATURE]:
            raise NotOurs(f"--output {out}: {new.name} was not written by qerl claims (it begins {have[:40]!r}, a "
                          f"report's begins {want[:SIGNATURE]!r}…); choose another directory or move it")


def check_output(out: Path, results: Path | None = None, evidence: Path | None = None) -> None:
    """``--output`` is a directory (or will be), outside the results tree the report reads and outside the evidence
    it is rebuilt from."""
    out_abs = Path(out).absolute().resolve()
    if Path(out).exists() and not Path(out).is_dir():
        raise OutputNotWritable(f"--output {out}: is a file, not a directory")
    for flag, root in (("--results", results), ("--evidence", evidence)):
        if root is None:
            continue
        r = Path(root).absolute().resolve()
        if out_abs == r or r in out_abs.parents:
            raise OutputNotWritable(f"--output {out}: is inside {flag} {root}; a report is written beside what it "
                                    "reads, never into it (choose e.g. reports/<name>)")


@contextlib.contextmanager
def staged(out: Path) -> Iterator[Path]:
    """A staging folder inside ``out`` for the block to write the report into; on a clean exit its files are checked
    (:func:`check_owned`) and renamed over ``out``'s, on any error it is removed and ``out`` is untouched."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=".qerl-claims-", dir=out))
    try:
        yield stage
        check_owned(out, stage)
        for f in sorted(stage.iterdir()):
            commit(f, out / f.name)
    except OSError as e:  # name the report's file, not the staging folder's; say that the earlier set stands
        if e.filename and str(stage) in str(e.filename):
            name = Path(str(e.filename)).name.split(".tmp")[0]
            raise OSError(e.errno, f"{e.strerror} (nothing of {out} was replaced)", str(out / name)) from None
        raise
    finally:
        shutil.rmtree(stage, ignore_errors=True)
