"""What several benchmarks write: the rows of one device as ``<out>/<device>.csv``."""
from __future__ import annotations

import csv
from pathlib import Path


def device_csv(rows: list[dict], out: Path, device: str, tail: str = "") -> Path:
    """``rows`` (dicts with the same keys) and a ``device`` column to ``out/<device with _ for spaces><tail>.csv``;
    returns the path without its suffix (the stem the benchmark's ``.md`` takes)."""
    out.mkdir(parents=True, exist_ok=True)
    stem = out / (device.replace(" ", "_") + tail)
    with open(stem.with_suffix(".csv"), "w", newline="") as f:
        wr = csv.DictWriter(f, fieldnames=list(rows[0]) + ["device"])
        wr.writeheader()
        for r in rows:
            wr.writerow({**r, "device": device})
    return stem
