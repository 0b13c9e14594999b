"""Result files are written in one place each, atomically (a temporary file beside the result, then a rename):
qerl.workflow_config.atomic_open / write_text_atomic for text, qerl.figures.save_figure for figures. A write that
fails leaves the previous file as it was and no temporary."""
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from qerl.figures import save_figure  # noqa: E402
from qerl.workflow_config import atomic_open, write_text_atomic  # noqa: E402


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
