"""``bases.png`` of ``qerl claims`` on a bases configuration: what each NVFP4 recipe costs the untrained model,
drawn from the rows of ``bases.csv`` (the committed table is the figure's data, which the regeneration test
compares where pixels could not be)."""
from __future__ import annotations

from pathlib import Path

from qerl.figures import save_figure


def bases_figure(rows: list[list[str]], path: Path, title: str, goal: float = 0.02) -> Path:
    """Two panels, one row per quantized base in ``bases.csv``'s order: its pass@1 gap to bf16 on the reported
    benchmark with the 95% interval (paired by problem) against the ``goal`` (a fraction: 0.02 is 2 points below
    bf16), and its KL to bf16 (where measured). The chosen base is drawn in orange and marked. ``rows``: the table
    :func:`qerl.stages.bases.bases_rows` returns (header first); the figure adds no number of its own."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    col = {h: i for i, h in enumerate(rows[0])}
    arms = [r for r in rows[1:] if r[col["gap_vs_bf16"]]]

    def name(r: list[str]) -> str:
        how = [r[col["scale_rule"]], f"calibration {r[col['calibration']]}"]
        keep = r[col["keep_bf16_last"]]
        if keep not in ("—", "") and float(keep) > 0:  # a fraction in (0, 1) or a layer count
            how.append(f"last {float(keep):.0%} bf16" if float(keep) < 1 else f"last {int(float(keep))} layers bf16")
        return f"{r[col['model']]}\n({', '.join(how)})" + ("  *chosen*" if r[col["chosen"]] == "yes" else "")

    fig, (gap_ax, kl_ax) = plt.subplots(1, 2, figsize=(11, 0.6 * len(arms) + 1.8), sharey=True,
                                        gridspec_kw={"width_ratios": [3, 2]})
    for y, r in enumerate(arms):
        gap, lo, hi = (float(r[col[k]]) for k in ("gap_vs_bf16", "gap_ci95_low", "gap_ci95_high"))
        color = "C1" if r[col["chosen"]] == "yes" else "C0"
        gap_ax.plot([lo, hi], [y, y], color=color, linewidth=3, solid_capstyle="butt")
        gap_ax.scatter([gap], [y], color=color, s=40, zorder=3)
        gap_ax.annotate(f"{gap:+.1f}", (lo, y), xytext=(-6, 0), textcoords="offset points", va="center", ha="right",
                        fontsize=8)
        if r[col["kl_vs_bf16"]]:
            kl_ax.barh(y, float(r[col["kl_vs_bf16"]]), color=color, height=0.5)
    gap_ax.axvline(0, color="0.3", linewidth=0.8)
    gap_ax.axvline(-100 * goal, color="C3", linestyle="--", linewidth=0.8, label=f"goal: within {100 * goal:g} points")
    left, right = gap_ax.get_xlim()
    gap_ax.set_xlim(left - 0.08 * (right - left), right)  # room for the gaps' labels
    gap_ax.set_yticks(range(len(arms)), [name(r) for r in arms], fontsize=8)
    gap_ax.invert_yaxis()
    gap_ax.set_xlabel("gap to bf16, pass@1 points (95% interval)")
    gap_ax.legend(fontsize=8, loc="lower right")
    kl_ax.set_xlabel("KL(bf16 || base) per token, validation text")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return save_figure(fig, path)
