"""What several benchmarks write: the rows of one device as ``<out>/<device>.csv``."""
from __future__ import annotations

import csv
from pathlib import Path

from qerl.files import atomic_open


def device_csv(rows: list[dict], out: Path, device: str, tail: str = "") -> Path:
    """``rows`` (dicts with the same keys) and a ``device`` column to ``out/<device with _ for spaces><tail>.csv``;
    returns the path without its suffix (the stem the benchmark's ``.md`` takes)."""
    out.mkdir(parents=True, exist_ok=True)
    stem = out / (device.replace(" ", "_") + tail)
    with atomic_open(stem.with_suffix(".csv"), newline="") as f:
        wr = csv.DictWriter(f, fieldnames=list(rows[0]) + ["device"])
        wr.writeheader()
        for r in rows:
            wr.writerow({**r, "device": device})
    return stem


def existing_csv(out: Path, device: str, paths) -> Path | None:
    """The CSV already at ``out`` for ``device`` when a ``--merge`` into ``out`` must keep its rows (it exists and is
    not one of the merged ``paths``), else None: a merge goes *into* the output's file set, so nothing already
    written there is lost."""
    path = out / (device.replace(" ", "_") + ".csv")
    if path.exists() and all(path.resolve() != Path(p).resolve() for p in paths):
        return path
    return None
