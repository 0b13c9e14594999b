"""Saving a figure as every qerl result file is written (:func:`qerl.files.atomic_open`: a temporary file
beside it, then one rename), so a killed run leaves the previous figure (or none), never half a PNG. The one place
the commands' figures are saved."""
from __future__ import annotations

from pathlib import Path


def save_figure(fig, path: str | Path, dpi: int = 110) -> Path:
    """Write matplotlib ``fig`` to ``path`` (its format from the suffix) atomically and close it; returns ``path``."""
    import matplotlib.pyplot as plt

    from qerl.files import atomic_open

    path = Path(path)
    try:
        with atomic_open(path, "wb") as f:
            fig.savefig(f, format=path.suffix.lstrip(".") or None, dpi=dpi)
    finally:
        plt.close(fig)
    return path
