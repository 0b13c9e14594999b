"""``qerl report``: tables shaped like the paper's (Markdown + CSV, paper numbers adjacent),
figures (training curves, σ schedule, accuracy bars) and an ``index.md`` that embeds them.

Built only from declared files: ``results/train/.../metrics.jsonl`` and ``results/eval/.../*.json``
(files are the truth; MLflow is the index).
"""
from __future__ import annotations

from pathlib import Path

from qerl.quant import scale_rules
from qerl.methods import ROWS, UNTRAINED, label as row_label
from qerl.readers import number, read_eval_summary, read_json
from qerl.stages.paper_numbers import TABLE1, TABLE2, TABLE2_BENCHMARKS, TABLE2_ROWS
from qerl.stages.report_figures import caption, figures, pass1 as _eval, planned_files
from qerl.variants import arm_changes
from qerl.workflow_config import base_method, runs
from qerl.files import write_text_atomic


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def _fmt(x) -> str:
    if isinstance(x, _Spread):
        return f"{x:.1f} ± {x.half:.1f} (n={x.n})"
    return "—" if x is None else f"{x:.1f}"


def _score(config, results, model, method, algo, dataset, bench):
    if method in UNTRAINED:
        return _eval(results, f"{model}/{method}/untrained/none/seed0", bench)
    seeds = [r.seed for r in runs(config) if (r.model, r.method, r.algo, r.dataset) == (model, method, algo, dataset)]
    got = [x for x in (_eval(results, f"{model}/{method}/{algo}/{dataset}/seed{s}", bench) for s in seeds)
           if x is not None]
    if len(got) < 2:
        return _mean(got)
    from qerl.stages.report_figures import mean_interval

    mean, low, _ = mean_interval(got)
    return _Spread(mean, mean - low, len(got))


class _Spread(float):
    """A trained cell over several seeds: the mean, printed with its 95% Student-t half-width and the seed count."""

    def __new__(cls, mean: float, half: float, n: int):
        obj = super().__new__(cls, mean)
        obj.half, obj.n = half, n
        return obj


def table1(config: dict, results: Path) -> tuple[str, list[list[str]]]:
    t = config.get("report", {}).get("table1", {})
    bench, algo, dataset = t.get("benchmark", "gsm8k_test"), t.get("algorithm", "grpo"), t.get("dataset")
    models = t.get("models") or list(dict.fromkeys(r.model for r in runs(config)))
    header = ["method"]
    for m in models:
        col = config["models"][m].get("paper_column")
        header += [f"{m} (ours)", f"{col} (paper)" if col else "paper"]
    rows = []
    for method in ROWS:
        row, cells = [row_label(method)], []
        for m in models:
            ds = dataset or next((r.dataset for r in runs(config) if r.model == m and r.algo == algo), None)
            col = config["models"][m].get("paper_column")
            cells += [_score(config, results, m, method, algo, ds, bench), TABLE1.get(row_label(method), {}).get(col)]
        if method in UNTRAINED and all(x is None for x in cells):
            continue  # an untrained base neither evaluated here nor in the paper (NF4: only beside QLoRA)
        rows.append(row + [_fmt(x) for x in cells])
    title = f"Table 1 — {bench} pass@1 (%) after {algo.upper()} on {dataset or 'the training set'}"
    return title, [header] + rows


def table2(config: dict, results: Path) -> tuple[str, list[list[str]]] | None:
    t = config.get("report", {}).get("table2")
    if not t:
        return None
    benches = t.get("benchmarks", list(TABLE2_BENCHMARKS))
    algo, dataset = t.get("algorithm", "dapo"), t.get("dataset")
    header = ["model", "method"] + [f"{b} (ours)" for b in benches] + ["avg (ours)"] + \
             [f"{b} (paper)" for b in TABLE2_BENCHMARKS] + ["avg (paper)"]
    rows = []
    for m in t.get("models") or list(dict.fromkeys(r.model for r in runs(config))):
        size = config["models"][m].get("paper_column")
        ds = dataset or next((r.dataset for r in runs(config) if r.model == m and r.algo == algo), None)
        for method in TABLE2_ROWS:
            ours = [_score(config, results, m, method, algo, ds, b) for b in benches]
            paper = TABLE2.get((size, method), (None,) * 5)
            if all(x is None for x in ours) and paper[0] is None:
                continue
            rows.append([m, row_label(method).replace(", untrained", " untrained")] + [_fmt(x) for x in ours] +
                        [_fmt(_mean(ours) if all(x is not None for x in ours) else None)] + [_fmt(x) for x in paper])
    return f"Table 2 — pass@1 (%) after {algo.upper()}", [header] + rows


def runs_table(config: dict, results: Path) -> tuple[str, list[list[str]]]:
    """Every run of the matrix (variants/ablations included): what its arm changes against its base method, reward
    at the start and the end of training and pass@1 per benchmark."""
    benches = config.get("evaluation", {}).get("benchmarks", [])
    header = ["model", "method", "base method", "changes", "algorithm", "dataset", "seed", "reward first",
              "reward last 10%"] + benches
    rows = []
    for r in runs(config):
        s = results / "train" / r.path / "summary.json"
        summ = read_json(s, "run summary") if s.exists() else {}
        first, last = (None if summ.get(k) is None else number(summ[k], f"{s}: {k}")
                       for k in ("reward_first", "reward_last10pct"))
        rows.append([r.model, r.method, base_method(config, r.method), arm_changes(config, r.method) or "—",
                     r.algo, r.dataset, str(r.seed),
                     "—" if first is None else f"{first:.3f}", "—" if last is None else f"{last:.3f}"] +
                    [_fmt(_eval(results, r.path, b)) for b in benches])
    return "All runs (pass@1 in %)", [header] + rows


def bases_table(config: dict, results: Path) -> tuple[str, list[list[str]]] | None:
    """``evaluation.base_models``: each untrained base with how it was quantized and its pass@1 per benchmark,
    then truncated completions (%) and mean completion tokens on the first benchmark."""
    bm = config.get("evaluation", {}).get("base_models")
    if not bm:
        return None
    benches = config.get("evaluation", {}).get("benchmarks", [])
    q = config.get("quantize", {})
    if not benches:
        return None
    header = ["model", "base", "scale_rule", "calibration", "keep_bf16_last", *benches,
              f"{benches[0]} truncated %", f"{benches[0]} tokens"]
    rows = []
    for model, bases in bm.items():
        m = config["models"][model]
        for base in bases:
            how = [m.get(k, q.get(k, d)) for k, d in (("scale_rule", scale_rules.DEFAULT), ("calibration", "none"),
                                                      ("keep_bf16_last", 0))] if base == "nvfp4" else ["—"] * 3
            path = f"{model}/{base}/untrained/none/seed0"
            f = results / "eval" / path / f"{benches[0]}.json"
            first = read_eval_summary(f) if f.exists() else {}
            rows.append([model, base, *(str(x) for x in how)] + [_fmt(_eval(results, path, b)) for b in benches] +
                        [_fmt(100 * first["truncated_frac"]) if "truncated_frac" in first else "—",
                         f"{first['completion_tokens_mean']:.0f}" if "completion_tokens_mean" in first else "—"])
    return "Untrained bases (pass@1 in %)", [header] + rows


def _markdown(title: str, rows: list[list[str]]) -> str:
    head, *body = rows
    from qerl.stages.numbers import cell

    lines = [f"### {title}", "", "| " + " | ".join(map(cell, head)) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(map(cell, r)) + " |" for r in body]
    return "\n".join(lines) + "\n"


def _html(title: str, rows: list[list[str]], note: str = "") -> str:
    """The table as a small standalone HTML page (``snakemake --report`` displays HTML files; a CSV it only offers
    for download)."""
    import html

    head, *body = rows
    cell = lambda tag, x: f"<{tag}>{html.escape(str(x))}</{tag}>"  # noqa: E731
    lines = ['<!doctype html><meta charset="utf-8">',
             "<style>body{font:13px sans-serif}table{border-collapse:collapse}th,td{border:1px solid #ccc;"
             "padding:3px 8px;text-align:right}th:first-child,td:first-child{text-align:left}th{background:#f3f3f3}"
             "</style>", f"<h3>{html.escape(title)}</h3>", "<table>",
             "<tr>" + "".join(cell("th", h) for h in head) + "</tr>",
             *("<tr>" + "".join(cell("td", x) for x in r) + "</tr>" for r in body), "</table>"]
    if note:
        lines.append(f"<p>{html.escape(note)}</p>")
    return "\n".join(lines) + "\n"


def table1_note(config: dict) -> str:
    """What Table 1's trained cells rest on: the seeds each is the mean of, and, on one seed, that the ordering is
    not a ranking (a seed moves trained pass@1 by several points; on the tiny default model by up to ±20)."""
    t = config.get("report", {}).get("table1", {})
    algo = t.get("algorithm", "grpo")
    seeds = sorted({len(v) for v in _seed_counts(config, algo).values()})
    if not seeds:
        return ""
    if seeds == [1]:
        return ("Each trained cell is one seed. Between seeds a trained pass@1 moves by several points (on the tiny "
                "default model by up to ±20, reports/default/tolerance.json): methods this close are not ranked by "
                "this table. Give the experiment `seeds: [0, 1, 2]` for intervals (the arms figure and runs table "
                "show them).")
    return (f"Each trained cell is the mean over its seeds ({', '.join(map(str, seeds))}), with a 95% Student-t "
            "half-width where there are two or more (`± h (n=seeds)`).")


def _seed_counts(config: dict, algo: str) -> dict[tuple, list[int]]:
    out: dict[tuple, list[int]] = {}
    for r in runs(config):
        if r.algo == algo:
            out.setdefault((r.model, r.method, r.dataset), []).append(r.seed)
    return out


def _csv(rows: list[list[str]]) -> str:
    import csv
    import io

    buf = io.StringIO()
    csv.writer(buf).writerows(rows)
    return buf.getvalue()


class ReportError(ValueError):
    """The workflow config or the results directory cannot make a report."""


def load_workflow_config(path: Path) -> dict:
    """A workflow config file (the effective one the workflow writes, or ``config/*.yaml``), checked for what a
    report reads."""
    from qerl.train.config import read_workflow_config_checked

    config = read_workflow_config_checked([path], "--workflow-config")  # (strict: duplicates, unknown keys, the schema)
    bases_only = config.get("experiments") == [] and (config.get("evaluation") or {}).get("base_models")
    for key in ("models",) + (() if bases_only else ("experiments",)):
        if not config.get(key):
            raise ReportError(f"--workflow-config {path}: has no '{key}' (a workflow config names models and "
                              "experiment blocks, or an empty experiments list with evaluation.base_models; see "
                              "config/config.yaml)")
    try:
        runs(config)
    except (KeyError, TypeError) as e:
        raise ReportError(f"--workflow-config {path}: an experiment block lacks {e} (models, datasets, methods, "
                          "algorithms)") from None
    return config


def check_report_dir(out: Path) -> None:
    """``out`` is empty, missing, or an earlier report (its ``runs.md``): a report never writes among other files."""
    if out.is_dir() and any(out.iterdir()) and not (out / "runs.md").exists():
        names = sorted(p.name for p in out.iterdir())[:4]
        raise ReportError(f"--output {out}: holds other files ({', '.join(names)}, …), not an earlier report; "
                          "choose an empty or new directory")


def check_results(config: dict, results: Path) -> int:
    """How many of the config's runs have a finished training or an evaluation under ``results``; a report of none
    (an all-'—' report that would replace a real one) is a :class:`ReportError`."""
    if not results.is_dir():
        raise ReportError(f"--results {results}: no such directory (the workflow writes results/ with train/ and "
                          "eval/ in it)")
    found = sum((results / "train" / r.path / "summary.json").exists() or
                any((results / "eval" / r.path).glob("*.json")) for r in runs(config))
    found += sum(any((results / "eval" / f"{m}/{b}/untrained/none/seed0").glob("*.json"))
                 for m, bases in config.get("evaluation", {}).get("base_models", {}).items() for b in bases)
    if not found and not runs(config):
        raise ReportError(f"--results {results}: holds no evaluation of the config's base_models, and it names no "
                          "runs; nothing to report")
    if not found:
        raise ReportError(f"--results {results}: holds no finished training or evaluation of the {len(runs(config))} "
                          f"run(s) this config names (e.g. {results / 'train' / runs(config)[0].path}/summary.json); "
                          "nothing to report")
    return found


def build_report(config: dict, results: Path, out: Path) -> Path:
    """Write tables, figures and index.md into ``out``; returns the index path."""
    check_results(config, results)
    out.mkdir(parents=True, exist_ok=True)
    name = config.get("configuration", "default")
    parts = [f"# qerl report — `{name}`", "",
             "Generated by `qerl report` from `results/` (metrics.jsonl and evaluation JSON files). "
             "Paper numbers are QeRL's (arXiv 2510.11696); '—' marks cells without a run or a paper value.", ""]
    trained = bool(runs(config))
    tabs = (("table1", table1(config, results) if trained else None), ("table2", table2(config, results)),
            ("runs", runs_table(config, results) if trained else None), ("bases", bases_table(config, results)))
    for tag, tab in tabs:
        if tab is None:
            continue
        title, rows = tab
        note = table1_note(config) if tag == "table1" else ""
        md = _markdown(title, rows) + (f"\n{note}\n" if note else "")
        write_text_atomic(out / f"{tag}.md", md)
        write_text_atomic(out / f"{tag}.csv", _csv(rows))
        write_text_atomic(out / f"{tag}.html", _html(title, rows, note))
        parts += [md, f"[{tag}.csv]({tag}.csv) · [{tag}.html]({tag}.html)", ""]
    parts += ["## Figures", ""]
    made = figures(config, results, out)
    planned = [f.name for f in planned_files(config)]  # (the workflow declares them as the report rule's outputs)
    stray, missing = {p.name for p in made} - set(planned), [n for n in planned if not (out / n).is_file()]
    if stray or missing:
        raise ReportError(f"{out}: the report's files differ from its plan (written, not planned: {sorted(stray)}; "
                          f"planned, not written: {missing}); a defect of qerl.stages.report_figures.planned_files")
    for p in made:  # each figure with its caption (the one `snakemake --report` shows)
        parts += [f"![{p.stem}]({p.name})" if p.suffix == ".png" else f"[{p.name}]({p.name})", ""]
        if text := caption(config, p.name):
            parts += [f"*{text}*", ""]
    idx = out / "index.md"
    write_text_atomic(idx, "\n".join(parts))
    return idx
