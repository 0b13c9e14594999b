"""Result files are written in one place each, atomically (a temporary file beside the result, then a rename):
qerl.files.atomic_open / write_text_atomic for text, qerl.figures.save_figure for figures. A write that
fails leaves the previous file as it was and no temporary."""
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from qerl.figures import save_figure  # noqa: E402
from qerl.files import atomic_open, write_text_atomic  # noqa: E402


def test_text_is_written_whole_or_not_at_all(tmp_path):
    path = tmp_path / "sub" / "table.csv"
    write_text_atomic(path, "a,b\n1,2\n")
    assert path.read_text() == "a,b\n1,2\n"
    with pytest.raises(RuntimeError, match="killed"):
        with atomic_open(path, newline="") as f:
            f.write("half a ta")
            raise RuntimeError("killed while writing")
    assert path.read_text() == "a,b\n1,2\n"  # the previous file, whole
    assert sorted(p.name for p in path.parent.iterdir()) == ["table.csv"]  # no temporary left
    with atomic_open(path, newline="") as f:
        f.write("x\r\n")  # newline="" as open() takes it: the bytes as written
    assert path.read_bytes() == b"x\r\n"


def test_a_figure_is_saved_whole_or_not_at_all(tmp_path):
    fig, ax = plt.subplots()
    ax.plot([1, 2, 3])
    out = save_figure(fig, tmp_path / "sub" / "f.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and not plt.fignum_exists(fig.number)
    assert sorted(p.name for p in out.parent.iterdir()) == ["f.png"]  # no temporary left

    before = out.read_bytes()
    bad, ax = plt.subplots()
    ax.plot([3, 2, 1])
    broken = tmp_path / "sub" / "f.notaformat"
    broken.write_bytes(b"previous")
    with pytest.raises(ValueError, match="notaformat"):  # matplotlib: unsupported format
        save_figure(bad, broken)
    assert broken.read_bytes() == b"previous" and out.read_bytes() == before and not plt.fignum_exists(bad.number)
    assert sorted(p.name for p in out.parent.iterdir()) == ["f.notaformat", "f.png"]


def test_files_are_replaced_in_one_place():
    """Every rename that makes a written file (or a staged directory) the real one is qerl.files' (``commit``) or,
    for checkpoint directories swapped whole, qerl.checkpoint's: no other module of the product renames a temporary
    into place on its own."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    owners = {"qerl/files.py", "qerl/checkpoint.py"}
    found = []
    for f in sorted([*(root / "qerl").rglob("*.py"), *(root / "qerl_kernels").rglob("*.py")]):
        rel = f.relative_to(root).as_posix()
        for i, line in enumerate(f.read_text().splitlines(), 1):
            if re.search(r"\bos\.(replace|rename)\(|\btmp\w*\.(replace|rename)\(|\.rename\(", line) and rel not in owners:
                found.append(f"{rel}:{i}: {line.strip()}")
    assert found == []


def test_concurrent_writers_of_one_file_never_share_a_temporary(tmp_path):
    """Two writers of the same file (two processes, or two threads of one) each write their own temporary: the
    result is one writer's whole text, never a mix."""
    import threading

    from qerl.files import temporary

    assert temporary(tmp_path / "a.json") != temporary(tmp_path / "a.json")
    path = tmp_path / "a.txt"
    texts = [str(i) * 100_000 for i in range(8)]
    threads = [threading.Thread(target=write_text_atomic, args=(path, t)) for t in texts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert path.read_text() in texts and sorted(p.name for p in tmp_path.iterdir()) == ["a.txt"]
