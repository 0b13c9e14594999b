"""The report's figures, and the plan of every file a report writes (the workflow marks each with ``report()``).

One training-curve figure per (model, dataset, algorithm) with one colour per arm; one figure of the arms side by
side where a group has more than one (mean reward curve over seeds with its range, pass@1 with a 95% interval over
seeds where there are two or more, the untrained bases as reference lines) and its data as CSV; the AQN schedule of
every run with AQN on; the accuracy bars. A missing value is drawn missing, never as 0.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from qerl.readers import InputFileError, is_number, read_eval_summary, read_jsonl
from qerl.variants import arm_changes
from qerl.workflow_config import aqn_on, base_method, runs, untrained_bases
from qerl.files import atomic_open

CURVES = (("reward_mean", "reward"), ("accuracy", "accuracy"), ("entropy", "policy entropy"),
          ("response_len_mean", "response length (tokens)"))
#: two-sided 95% Student t quantiles by degrees of freedom (the interval of a mean over a few seeds)
_T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
        15: 2.131, 20: 2.086, 30: 2.042}


def pass1(results: Path, path: str, bench: str) -> float | None:
    """pass@1 (%) of one evaluation (``results/eval/<path>/<bench>.json``), ``None`` if it does not exist."""
    f = results / "eval" / path / f"{bench}.json"
    return 100 * read_eval_summary(f)["pass@1"] if f.exists() else None


def groups(config: dict) -> dict[tuple[str, str, str], list]:
    """The runs of each (model, dataset, algorithm), in config order."""
    out: dict[tuple, list] = {}
    for r in runs(config):
        out.setdefault((r.model, r.dataset, r.algo), []).append(r)
    return out


def arm_colors(config: dict) -> dict[str, str]:
    """One colour per arm across every figure of a report (its order in the matrix; tab10, then tab20's lighter
    shades past ten arms)."""
    import matplotlib

    arms = list(dict.fromkeys(r.method for r in runs(config)))
    return {a: f"C{i}" if i < 10 else matplotlib.colormaps["tab20"](2 * (i - 10) % 20 + 1) for i, a in enumerate(arms)}


def _legend_outside(fig, ax, fontsize: int = 7) -> None:
    """The legend of ``ax`` right of the figure, off the data (the figure uses constrained layout)."""
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="outside right upper", fontsize=fontsize, frameon=False)


def _arms(rs: list) -> dict[str, list]:
    out: dict[str, list] = {}
    for r in rs:
        out.setdefault(r.method, []).append(r)
    return out


@dataclass(frozen=True)
class ReportFile:
    """One file a report writes: its name in the report directory, the report's category and a caption file
    (``workflow/report/<caption>.rst``)."""
    name: str
    category: str
    caption: str


def planned_files(config: dict) -> list[ReportFile]:
    """Every table (CSV) and figure ``qerl report`` writes for ``config``, decided from the config alone (the
    workflow declares them as the report rule's outputs, marked for ``snakemake --report``)."""
    ev = config.get("evaluation", {})
    benches = ev.get("benchmarks", [])
    trained = bool(runs(config))
    files = []
    tables = (["table1", "runs"] if trained else []) + (["table2"] if config.get("report", {}).get("table2") else []) \
        + (["bases"] if ev.get("base_models") and benches else [])
    for t in tables:  # (the HTML one displays in `snakemake --report`; the CSV is the data)
        files += [ReportFile(f"{t}.html", "Tables", t), ReportFile(f"{t}.csv", "Tables", t)]
    for (model, dataset, algo), rs in groups(config).items():
        tag = f"{model}_{dataset}_{algo}"
        files.append(ReportFile(f"curves_{tag}.png", "Training curves", "curves"))
        if len(_arms(rs)) > 1:
            files += [ReportFile(f"arms_{tag}.png", "Arms side by side", "arms"),
                      ReportFile(f"arms_{tag}.csv", "Arms side by side", "arms_table")]
    if any(aqn_on(config, r) for r in runs(config)):
        files.append(ReportFile("aqn_sigma.png", "Training curves", "aqn_sigma"))
    if benches and trained:
        files.append(ReportFile("accuracy.png", "Evaluation", "accuracy"))
    return files


CAPTIONS = Path(__file__).resolve().parents[2] / "workflow" / "report"


def caption(config: dict, name: str) -> str:
    """The caption of report file ``name`` (``workflow/report/<caption>.rst``, which ``snakemake --report`` shows) as
    one Markdown paragraph for index.md; ``""`` where there is none."""
    import re

    f = next((x for x in planned_files(config) if x.name == name), None)
    path = CAPTIONS / f"{f.caption}.rst" if f is not None else None
    if path is None or not path.is_file():
        return ""
    return re.sub(r"``([^`]+)``", r"`\1`", " ".join(path.read_text().split()))


def _smooth(ys: list[float], alpha: float = 0.3) -> list[float]:
    out, acc = [], None
    for y in ys:
        acc = y if acc is None or y != y else alpha * y + (1 - alpha) * acc
        out.append(acc)
    return out


def _metrics(results: Path, run) -> list[dict]:
    """A run's metric rows; a step or a plotted value that is not a number is an error naming the file and the
    step (NaN stays: a gap in the curve)."""
    f = results / "train" / run.path / "metrics.jsonl"
    rows = read_jsonl(f, "metrics file", allow_nan=True) if f.exists() else []
    for i, row in enumerate(rows, 1):
        for key in ("step", "sigma", *(k for k, _ in CURVES)):
            v = row.get(key)
            if (v is None and key == "step") or (v is not None and not is_number(v, finite=False)):
                raise InputFileError(f"{f}: row {i} (step {row.get('step')}): {key} = {v!r} is not a number")
    return rows


def aqn_runs(config: dict, results: Path) -> list[tuple]:
    """(run, metric rows) of every run that trains with AQN on (its resolved ``aqn.enabled``, or QeRL's own
    choice): QeRL, and any variant or ablation arm that turns AQN on, whatever its method is called."""
    return [(r, _metrics(results, r)) for r in runs(config) if aqn_on(config, r)]


def accuracy_bars(config: dict, results: Path, benches: list[str]) -> tuple[list[str], dict[str, list]]:
    """The accuracy figure's bars: one label per untrained base and per run, pass@1 (%) per benchmark, ``None``
    where that evaluation does not exist (the label then says ``not evaluated``)."""
    labels, values = [], {b: [] for b in benches}
    for m in dict.fromkeys(r.model for r in runs(config)):
        cells = [(f"{m}\n{base} (untrained)", f"{m}/{base}/untrained/none/seed0")
                 for base in untrained_bases(config).get(m, [])]
        cells += [(f"{m}\n{r.method}/{r.algo}/s{r.seed}", r.path) for r in runs(config) if r.model == m]
        for text, path in cells:
            got = {b: pass1(results, path, b) for b in benches}
            labels.append(text + ("" if all(v is not None for v in got.values()) else "\n(not evaluated)"))
            for b in benches:
                values[b].append(got[b])
    return labels, values


def mean_interval(xs: list[float]) -> tuple[float | None, float | None, float | None]:
    """(mean, low, high): a 95% Student-t interval of the mean over seeds; no interval from fewer than 2 values,
    ``(None, None, None)`` from none."""
    if not xs:
        return None, None, None
    m = sum(xs) / len(xs)
    if len(xs) < 2:
        return m, None, None
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))
    df = len(xs) - 1
    t = _T95.get(df) or next((v for k, v in sorted(_T95.items()) if k >= df), 1.96)
    half = t * sd / math.sqrt(len(xs))
    return m, m - half, m + half


def arm_rows(config: dict, results: Path, rs: list, bench: str | None) -> list[list[str]]:
    """The arms of one group, one row each: what the arm changes against its base method, seeds trained and
    evaluated, the last-10% reward (mean over seeds) and pass@1 on ``bench`` with its 95% interval over seeds
    ('' where missing)."""
    rows = [["arm", "base method", "changes", "seeds trained", "seeds evaluated", "reward last 10%",
             f"{bench} pass@1" if bench else "pass@1", "ci95 low", "ci95 high"]]
    fmt = (lambda x, d=2: "" if x is None else f"{x:.{d}f}")
    for arm, members in _arms(rs).items():
        lasts = []
        for r in members:
            ys = [x["reward_mean"] for x in _metrics(results, r) if is_number(x.get("reward_mean"))]
            if ys:
                tail = ys[-max(1, len(ys) // 10):]
                lasts.append(sum(tail) / len(tail))
        accs = [a for a in (pass1(results, r.path, bench) for r in members) if a is not None] if bench else []
        m, lo, hi = mean_interval(accs)
        rows.append([arm, base_method(config, arm), arm_changes(config, arm) or "—", str(len(lasts)),
                     str(len(accs)), fmt(mean_interval(lasts)[0], 3), fmt(m), fmt(lo), fmt(hi)])
    return rows


def _arms_figure(plt, config, results, model, dataset, algo, rs, bench, rows):
    """``rows``: :func:`arm_rows` of ``rs`` (the CSV beside the figure), without its header."""
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 3.8), gridspec_kw={"width_ratios": [3, 2]}, layout="constrained")
    arms = _arms(rs)
    colour = arm_colors(config)
    for i, (arm, members) in enumerate(arms.items()):
        curves = [[(x["step"], x.get("reward_mean", float("nan"))) for x in _metrics(results, r)] for r in members]
        curves = [c for c in curves if c]
        if not curves:
            continue
        steps = sorted({s for c in curves for s, _ in c})
        smooth = [dict(zip([s for s, _ in c], _smooth([y for _, y in c]))) for c in curves]
        cols = [[sm[s] for sm in smooth if s in sm and sm[s] == sm[s]] for s in steps]
        mean = [sum(c) / len(c) if c else float("nan") for c in cols]
        ax.plot(steps, mean, color=colour[arm], lw=1.6, label=f"{arm} ({len(curves)} seed{'s' * (len(curves) > 1)})")
        if len(curves) > 1:
            ax.fill_between(steps, [min(c) if c else float("nan") for c in cols],
                            [max(c) if c else float("nan") for c in cols], color=colour[arm], alpha=0.15)
    ax.set_xlabel("step"), ax.set_ylabel("reward (EMA 0.3)"), ax.grid(alpha=0.3)
    _legend_outside(fig, ax)
    ax.set_title("reward: mean over seeds (band: their range)")
    labels = [r[0] + ("" if r[6] else "\n(not evaluated)") for r in rows]
    nan = float("nan")
    means = [float(r[6]) if r[6] else nan for r in rows]
    err = [[(float(r[6]) - float(r[7])) if r[7] else nan for r in rows],  # (no interval from one seed: no whisker)
           [(float(r[8]) - float(r[6])) if r[8] else nan for r in rows]]
    bx.bar(range(len(rows)), means, color=[colour.get(r[0], "0.5") for r in rows], yerr=err, capsize=4)
    for j, base in enumerate(untrained_bases(config).get(model, []) if bench else []):
        v = pass1(results, f"{model}/{base}/untrained/none/seed0", bench)
        if v is not None:  # (labels alternate ends, so that two close bases stay readable)
            bx.axhline(v, ls=("--", ":")[j % 2], lw=1, color="0.4")
            bx.annotate(f"{base} untrained", (len(rows) - 0.5 if j % 2 == 0 else -0.5, v), fontsize=7,
                        ha="right" if j % 2 == 0 else "left", va="bottom", color="0.3")
    bx.set_xticks(range(len(rows)), labels, fontsize=7, rotation=30, ha="right")
    bx.set_ylabel(f"{bench} pass@1 (%)" if bench else "pass@1 (%)"), bx.grid(axis="y", alpha=0.3)
    bx.set_title("pass@1: mean over seeds ± 95% (≥ 2 seeds)", fontsize=10)
    fig.suptitle(f"{model} · {dataset} · {algo.upper()}: arms side by side")
    return fig


def figures(config: dict, results: Path, out: Path) -> list[Path]:
    """Write the figures (and the arms' CSV) :func:`planned_files` names; returns the paths written."""
    import csv

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []
    benches = config.get("evaluation", {}).get("benchmarks", [])
    for (model, dataset, algo), rs in groups(config).items():
        tag = f"{model}_{dataset}_{algo}"
        arms = list(_arms(rs))
        colour = arm_colors(config)
        fig, axes = plt.subplots(1, len(CURVES), figsize=(4.2 * len(CURVES) + 1.6, 3.4), layout="constrained")
        for ax, (key, label) in zip(axes, CURVES):
            for r in rs:
                m = _metrics(results, r)
                if m:
                    xs, ys = [x["step"] for x in m], [x.get(key, float("nan")) for x in m]
                    color, first = colour[r.method], r is next(x for x in rs if x.method == r.method)
                    ax.plot(xs, ys, color=color, lw=0.8, alpha=0.3)
                    ax.plot(xs, _smooth(ys), color=color, lw=1.6, label=r.method if first else None,
                            ls=("-", "--", ":", "-.")[[x for x in rs if x.method == r.method].index(r) % 4])
            ax.set_xlabel("step")
            ax.set_title(label)
            ax.grid(alpha=0.3)
        _legend_outside(fig, axes[0], fontsize=8)
        fig.suptitle(f"{model} · {dataset} · {algo.upper()}  (one colour per arm, one line style per seed; "
                     "faint: per step; bold: EMA 0.3)")
        made.append(_save(plt, fig, out / f"curves_{tag}.png"))
        if len(arms) > 1:
            bench = benches[0] if benches else None
            rows = arm_rows(config, results, rs, bench)
            with atomic_open(out / f"arms_{tag}.csv", newline="") as f:
                csv.writer(f).writerows(rows)
            made.append(out / f"arms_{tag}.csv")
            made.append(_save(plt, _arms_figure(plt, config, results, model, dataset, algo, rs, bench, rows[1:]),
                              out / f"arms_{tag}.png"))
    sig = aqn_runs(config, results)
    if sig:
        fig, ax = plt.subplots(figsize=(7.5, 3.4), layout="constrained")
        colour = arm_colors(config)
        models = {r.model for r, _ in sig}
        algos = list(dict.fromkeys(r.algo for r, _ in sig))
        for r, m in sig:  # the arm's colour, one line style per algorithm; each run its own legend entry
            ax.step([x["step"] for x in m], [x.get("sigma", float("nan")) for x in m], where="post",
                    color=colour[r.method], ls=("-", "--", ":", "-.")[algos.index(r.algo) % 4],
                    label=" · ".join([*([r.model] if len(models) > 1 else []), r.method, r.algo.upper(),
                                      f"seed {r.seed}"]))
        if not any(m for _, m in sig):
            ax.text(0.5, 0.5, "no metrics yet", transform=ax.transAxes, ha="center")
        ax.set_xlabel("step"), ax.set_ylabel("AQN σ"), ax.set_title("AQN noise schedule")
        ax.grid(alpha=0.3)
        _legend_outside(fig, ax)
        made.append(_save(plt, fig, out / "aqn_sigma.png"))
    if benches and runs(config):
        labels, values = accuracy_bars(config, results, benches)
        nan = float("nan")  # a missing evaluation draws no bar (its label says so), never a bar at 0
        values = {b: [nan if v is None else v for v in vs] for b, vs in values.items()}
        fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(labels)) + 1.2, 3.8), layout="constrained")
        w = 0.8 / len(benches)
        for i, b in enumerate(benches):
            ax.bar([x + i * w for x in range(len(labels))], values[b], width=w, label=b)
        ax.set_xticks([x + w * (len(benches) - 1) / 2 for x in range(len(labels))], labels, fontsize=7, rotation=30, ha="right")
        ax.set_ylabel("pass@1 (%)"), ax.set_title("Evaluation"), ax.grid(axis="y", alpha=0.3)
        _legend_outside(fig, ax, fontsize=8)
        made.append(_save(plt, fig, out / "accuracy.png"))
    return made


def _save(plt, fig, path: Path) -> Path:
    from qerl.figures import save_figure

    return save_figure(fig, path)
