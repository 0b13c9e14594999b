"""Figure of a ``qerl bench kernels`` CSV: speed-up over cuBLAS bf16 and share of the copy bandwidth
against the token count M, one line per projection, forward and backward, with the issue's targets.

``python -m qerl.bench.kernels --plot reports/kernels/NVIDIA_H200.csv`` writes ``NVIDIA_H200.png``
beside it (CPU is enough: the numbers come from the CSV).
"""
from __future__ import annotations

import csv
from pathlib import Path

# (M range, speed-up goal) of issue 5; drawn as horizontal segments
TARGETS = (((1, 16), 2.8), ((64, 64), 2.0), ((2048, 8192), 0.85))


def load(csv_path: Path) -> list[dict]:
    with open(csv_path, newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows or not {"model", "proj", "M", "kind", "speedup", "GBps", "copy_GBps"} <= set(rows[0]):
        raise ValueError(f"{csv_path}: not a `qerl bench kernels` CSV (needs model, proj, M, kind, speedup, GBps, "
                         f"copy_GBps columns)")
    return rows


def plot(csv_path: Path, png_path: Path | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = load(Path(csv_path))
    png_path = Path(png_path) if png_path else Path(csv_path).with_suffix(".png")
    fig, axes = plt.subplots(2, 2, figsize=(12, 8), sharex=True)
    for col, kind in enumerate(("fwd", "bwd")):
        lines = sorted({(r["model"], r["proj"]) for r in rows if r["kind"] == kind})
        models = sorted({m for m, _ in lines})
        projs = sorted({p for _, p in lines})
        for model, proj in lines:  # colour = projection, line style = model
            style = dict(color=f"C{projs.index(proj) % 10}", ls=("-", "--", ":", "-.")[models.index(model) % 4])
            sel = sorted((int(r["M"]), float(r["speedup"]), float(r["GBps"]) / float(r["copy_GBps"]))
                         for r in rows if r["kind"] == kind and r["model"] == model and r["proj"] == proj)
            ms = [s[0] for s in sel]
            axes[0][col].plot(ms, [s[1] for s in sel], marker="o", ms=3, label=f"{model} {proj}", **style)
            axes[1][col].plot(ms, [100 * s[2] for s in sel], marker="o", ms=3, label=f"{model} {proj}", **style)
        for (lo, hi), goal in TARGETS:
            if kind == "fwd" or lo >= 2048:
                axes[0][col].hlines(goal, lo * 0.8, hi * 1.25, colors="k", linestyles="dashed", lw=1.5)
        axes[0][col].axhline(1.0, color="grey", lw=0.8)
        axes[1][col].axhline(80, color="k", ls="dashed", lw=1, xmax=0.35)
        axes[0][col].set_title(f"{kind}: speed-up over cuBLAS bf16 (dashed: issue-5 targets)")
        axes[1][col].set_title(f"{kind}: % of device-to-device copy bandwidth")
        axes[1][col].set_xlabel("tokens M")
        for ax in (axes[0][col], axes[1][col]):
            ax.set_xscale("log", base=2)
            ax.grid(alpha=0.3)
    axes[0][0].set_yscale("log", base=2)
    axes[0][1].set_yscale("log", base=2)
    axes[0][0].legend(fontsize=7, ncol=2)
    device = rows[0].get("device", "")
    fig.suptitle(f"NVFP4 W4A16 kernels vs cuBLAS bf16 — {device}, copy BW {float(rows[0]['copy_GBps']):.0f} GB/s")
    fig.tight_layout()
    from qerl.figures import save_figure

    return save_figure(fig, png_path)
