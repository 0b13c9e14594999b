"""``lr_sweep.png`` of ``qerl claims --sweep``: validation pass@1 against the learning rate, one line per method,
drawn from the rows of ``lr_sweep.csv`` (the committed table is the figure's data, which the regeneration test
compares where pixels could not be)."""
from __future__ import annotations

from pathlib import Path

from qerl.figures import save_figure


def sweep_figure(rows: list[list[str]], path: Path, title: str) -> Path:
    """Per method: validation pass@1 at each rate (log scale) with its 95% interval, the chosen rate ringed, the
    untrained base as a dotted line in the method's colour. ``rows``: the table
    :func:`qerl.stages.sweep.sweep_rows` returns (header first: method, lr, val_pass1, ci95_low, ci95_high,
    base_pass1, chosen); the figure adds no number of its own."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from qerl.methods import label

    col = {h: i for i, h in enumerate(rows[0])}
    by: dict[str, list[list[str]]] = {}
    for r in rows[1:]:
        by.setdefault(r[col["method"]], []).append(r)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, (method, rs) in enumerate(by.items()):
        rs = sorted(rs, key=lambda r: float(r[col["lr"]]))
        lr = [float(r[col["lr"]]) for r in rs]
        val = [float(r[col["val_pass1"]]) for r in rs]
        err = [[v - float(r[col["ci95_low"]]) for v, r in zip(val, rs)],
               [float(r[col["ci95_high"]]) - v for v, r in zip(val, rs)]]
        color = f"C{i}"
        ax.errorbar(lr, val, yerr=err, color=color, marker="o", capsize=3, label=label(method))
        for r, x, y in zip(rs, lr, val):
            if r[col["chosen"]] == "yes":
                ax.scatter([x], [y], s=220, facecolors="none", edgecolors=color, linewidths=1.5, zorder=3)
                ax.annotate(f"chosen {x:g}", (x, y), xytext=(8, 8), textcoords="offset points", fontsize=8,
                            color=color)
        if rs[0][col["base_pass1"]]:
            ax.axhline(float(rs[0][col["base_pass1"]]), color=color, linestyle=":", linewidth=1,
                       label=f"{label(method)}: untrained base")
    ax.set_xscale("log")
    ax.set_xlabel("learning rate")
    ax.set_ylabel("validation pass@1 (%)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return save_figure(fig, path)
