"""Saving a figure as every qerl result file is written: to a temporary file beside it, then one rename, so a killed
run leaves the previous figure (or none), never half a PNG. The one place the commands' figures are saved."""
from __future__ import annotations

import os
from pathlib import Path


def save_figure(fig, path: str | Path, dpi: int = 110) -> Path:
    """Write matplotlib ``fig`` to ``path`` (its format from the suffix) atomically and close it; returns ``path``."""
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.stem}.tmp-{os.getpid()}{path.suffix}")
    try:
        fig.savefig(tmp, dpi=dpi)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        plt.close(fig)
    os.replace(tmp, path)
    return path
