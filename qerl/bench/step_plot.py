"""Figure of a ``qerl bench step`` file set: each measured step split into rollout / old log-probs / update
(stacked bars, seconds) beside its peak GPU memory, one row per configuration, methods of one configuration
adjacent. Written by ``qerl bench step`` (and ``--merge``) as ``<device>.png`` beside the CSV.
"""
from __future__ import annotations

from pathlib import Path

PHASES = (("rollout_s", "rollout"), ("logprob_s", "old log-probs"), ("update_s", "update"))
METHOD_COLOUR = {"lora": "C0", "qlora": "C2", "qerl": "C3"}


def _label(r: dict) -> str:
    extra = []
    if int(r.get("nproc") or 1) > 1:
        extra.append(f"{r['nproc']} GPUs")
    if str(r.get("micro_batch", "")) not in ("", "2", "None"):
        extra.append(f"μ{r.get('micro_batch')}")
    if (r.get("engine_cache") or "released") != "released":
        extra.append("cache kept")
    if (r.get("optimizer_states") or "gpu") != "gpu":
        extra.append("states parked")
    if (r.get("lengths") or "fixed") != "fixed":
        extra.append(str(r["lengths"]).split(":")[0] + " lengths")
    if str(r.get("samples_per_prompt") or 1) not in ("1", ""):
        extra.append(f"G{r['samples_per_prompt']}")
    if r.get("dense_update") in (True, "True"):
        extra.append("dense update")
    tail = f" [{', '.join(extra)}]" if extra else ""
    return f"{r['model']} {r['method']} b{r['batch']} × {r['gen_len']}{tail}"


def _size(model: str) -> float:
    try:
        return float(model.rstrip("Bb"))
    except ValueError:
        return float("inf")


def plot(rows: list[dict], png_path: Path, device: str) -> Path:
    """Write the figure of ``rows`` (typed bench-step rows; failed/OOM rows are listed in the title) to
    ``png_path`` atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r.get("status") == "ok"]
    if not ok:
        raise ValueError("no successful bench-step rows to plot")
    ok = sorted(ok, key=lambda r: (_size(r["model"]), int(r["gen_len"]), -int(r["batch"]), int(r.get("nproc") or 1),
                                   str(r.get("micro_batch")), r.get("engine_cache") or "", r.get("lengths") or "",
                                   r["method"]))
    y = list(range(len(ok)))[::-1]
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(13, 1.2 + 0.32 * len(ok)), sharey=True,
                                     gridspec_kw={"width_ratios": [3, 1]})
    left = [0.0] * len(ok)
    for i, (key, name) in enumerate(PHASES):
        vals = [float(r.get(key) or 0.0) for r in ok]
        ax_t.barh(y, vals, left=left, color=f"C{i + 4}", alpha=(1.0, 0.6, 0.8)[i], label=name, height=0.75)
        left = [a + b for a, b in zip(left, vals)]
    for yy, r, total in zip(y, ok, left):
        ax_t.text(total, yy, f" {total:.1f} s", va="center", fontsize=7)
    ax_m.barh(y, [float(r.get("peak_gb") or 0.0) for r in ok], height=0.75,
              color=[METHOD_COLOUR.get(r["method"], "C7") for r in ok])
    ax_m.axvline(80, color="k", ls="dashed", lw=1)
    ax_t.set_yticks(y, [_label(r) for r in ok], fontsize=8)
    for tick, r in zip(ax_t.get_yticklabels(), ok):
        tick.set_color(METHOD_COLOUR.get(r["method"], "C7"))
    ax_t.set_xlabel("seconds per GRPO step (second step)")
    ax_m.set_xlabel("peak GB (dashed: 80 GB)")
    ax_t.legend(loc="upper right", fontsize=8)
    for ax in (ax_t, ax_m):
        ax.grid(axis="x", alpha=0.3)
    failed = [f"{_label(r)}: {r.get('status')}" for r in rows if r.get("status") != "ok"]
    fig.suptitle(f"GRPO step split — {device}" + (f"\n(not measured: {'; '.join(failed)})" if failed else ""),
                 fontsize=10)
    fig.tight_layout()
    from qerl.figures import save_figure

    return save_figure(fig, png_path)
