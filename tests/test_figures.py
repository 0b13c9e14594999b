"""qerl.figures.save_figure, the one place figures are saved: atomically (a temporary file beside it, then a
rename), the figure closed either way, and a failed save leaves the previous file as it was and no temporary."""
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from qerl.figures import save_figure  # noqa: E402


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
