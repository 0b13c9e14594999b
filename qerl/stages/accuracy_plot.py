"""``accuracy.png`` of ``qerl claims``: pass@1 per arm with its interval, each seed and the untrained base, drawn
from the rows of ``accuracy.csv`` and ``runs.csv`` (the committed tables are the figure's data, which the
regeneration test compares where pixels could not be)."""
from __future__ import annotations

from pathlib import Path

from qerl.figures import save_figure


def accuracy_figure(acc_rows: list[list[str]], runs_rows: list[list[str]], path: Path, title: str,
                    reference: str = "lora", margin: float = 0.02) -> Path:
    """pass@1 per arm, one row each in ``accuracy.csv``'s order: the mean over seeds with its 95% interval
    (problems x seeds), every seed's score, the arm's untrained base and a line from it to the mean (the gain);
    the ``reference`` arm's mean (bf16 LoRA) as a dashed line with the non-inferiority ``margin`` (a fraction: 0.02
    is 2 points) shaded below it, so claim (a) reads off the figure. ``acc_rows`` / ``runs_rows``: the tables
    :func:`qerl.stages.claims.build` writes (header first); the figure adds no number of its own."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    col = {h: i for i, h in enumerate(acc_rows[0])}
    rcol = {h: i for i, h in enumerate(runs_rows[0])}
    arms = acc_rows[1:]
    fig, ax = plt.subplots(figsize=(9, 0.55 * len(arms) + 2.2))
    for y, r in enumerate(arms):
        mean, lo, hi = (float(r[col[k]]) for k in ("pass1_mean", "ci95_low", "ci95_high"))
        if r[col["base_pass1"]]:
            base = float(r[col["base_pass1"]])
            ax.plot([base, mean], [y, y], color="0.75", linewidth=1, zorder=1)
            ax.scatter([base], [y], facecolors="none", edgecolors="0.4", s=36, zorder=2,
                       label="untrained base" if y == 0 else None)
        ax.plot([lo, hi], [y, y], color="C0", linewidth=3, solid_capstyle="butt", zorder=2,
                label="95% interval (problems x seeds)" if y == 0 else None)
        seeds = [float(x[rcol["pass1_after"]]) for x in runs_rows[1:]
                 if x[rcol["method"]] == r[col["method"]] and x[rcol["pass1_after"]]]
        ax.scatter(seeds, [y] * len(seeds), marker="|", color="C1", s=120, zorder=3,
                   label="each seed" if y == 0 else None)
        ax.scatter([mean], [y], color="C0", s=40, zorder=4, label="mean over seeds" if y == 0 else None)
        ax.annotate(f"{mean:.1f}", (hi, y), xytext=(6, 0), textcoords="offset points", va="center", fontsize=8)
        if r[col["method"]] == reference:
            ax.axvline(mean, color="C0", linestyle="--", linewidth=0.8, zorder=0)
            ax.axvspan(mean - 100 * margin, mean, color="C0", alpha=0.08, zorder=0,
                       label=f"within {100 * margin:g} points of {r[col['label']]}'s mean")
    ax.set_yticks(range(len(arms)), [r[col["label"]] for r in arms], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("pass@1 (%)")
    lo_x, hi_x = ax.get_xlim()
    ax.set_xlim(lo_x, hi_x + 0.06 * (hi_x - lo_x))  # room for the means' labels
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.1 - 0.6 / len(arms)), ncol=3, frameon=False)
    fig.tight_layout()
    return save_figure(fig, path)
