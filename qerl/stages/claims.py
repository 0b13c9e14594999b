"""``qerl claims``: the methods of a workflow run side by side against the paper's claims, from ``results/``.

For every (method, seed) run of one model / dataset / algorithm / benchmark it reads the training metrics
(``metrics.jsonl``) and the evaluation summaries (``*.json`` with per-problem scores) and writes:

- ``runs.csv`` / ``runs.md``: one row per method x seed: model and its source, device, steps, held-out problems,
  pass@1 of the untrained base (the method's base format) and after training, the adapter's sha256, median step
  time, GPU-hours, reward at the start / end, mismatch KL;
- ``accuracy.csv`` / ``accuracy.md``: pass@1 per method, mean over seeds with a 95% interval (bootstrap over
  problems and seeds), and its paired difference from the reference method (bf16 LoRA) with its interval;
- ``accuracy.png``: pass@1 per arm with its interval, each seed and the untrained base (``accuracy.csv`` and
  ``runs.csv`` are its data; :mod:`qerl.stages.accuracy_plot`);
- ``curves.png`` / ``curves.csv``: reward, accuracy, entropy, response length, mismatch KL and the AQN sigma per
  method, and the plotted numbers;
- ``claims.md``: the paper's claims (a) accuracy at least bf16 LoRA's, (b) faster reward growth, (c) AQN raises
  entropy early, (d) a faster step, each marked confirmed / refuted / inconclusive with the numbers behind it.

Intervals are percentile bootstraps with a fixed seed (a rerun writes the same files). The decision rule (written
into ``claims.md``, :data:`RULE`): an accuracy difference *exceeds* when its 95% interval lies above 0, *matches*
when it lies above -:data:`MARGIN` (non-inferior within the margin), *falls short* when it lies below -MARGIN, and
is *inconclusive* otherwise; every other claim is *confirmed* / *refuted* only when its interval excludes 0 (the
step time: a gap over 5% in every seed pair). A NaN or missing value is an error naming its run, never a verdict.
"""
from __future__ import annotations

import math
import random
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from qerl.methods import base_of, label as method_label
from qerl.readers import is_number, read_eval_summary, read_jsonl
from qerl.stages.numbers import cell, csv_text as _csv_text, p1
from qerl.stages.stats import BOOT, boot_diff, boot_mean, boot_seeds, pct as _pct, welch_log_ratio
from qerl.workflow_config import base_method, runs, train_config

REFERENCE = "lora"
MARGIN = 0.02  # non-inferiority margin of an accuracy claim: 2 points of pass@1
BORDERLINE = 0.005  # an accuracy interval's end this close to 0 or -MARGIN (0.5 points) is called borderline
RULE = (f"**Decision rule.** Every interval is at the level its data are independent at. Accuracy: 95% percentile "
        f"bootstraps ({BOOT} resamples, fixed seed) that resample seeds and problems together (paired by problem "
        "where two methods are compared). An accuracy difference *exceeds* when its interval lies above 0, *matches* "
        f"when it lies above -{100 * MARGIN:g} points (non-inferior within that margin), *falls short* when it lies "
        f"below -{100 * MARGIN:g}, and is *inconclusive* otherwise; claim (a) is confirmed by *exceeds* or *matches* "
        "and refuted by *falls short*, and a verdict whose interval ends within "
        f"{100 * BORDERLINE:g} points of 0 or -{100 * MARGIN:g} is marked *borderline*. Curves ((b), (c1), (c2)): one "
        "value a run (its steps stay together: a window mean), each arm's seeds resampled on their own (a bootstrap "
        f"of {BOOT}, fixed seed), at least 2 seeds an arm, else *not judged*; confirmed or refuted only when the "
        "interval excludes 0. (c1) is judged where the learning rate cannot enter: NVFP4 LoRA against bf16 LoRA at one "
        "common rate over the early window where such runs exist, else at step 1 (the rollout before any update); an "
        "early window of runs at different rates is shown, never judged. Step time (d): one median a run (step 1 left "
        "out), the ratio of the geometric means, bf16 LoRA / QeRL, with a 95% Welch t-interval on the logs, over at "
        "least 5 runs a method that had the GPU to themselves (else *not judged*); confirmed when the interval lies "
        "above 1.05, refuted when it lies below 0.95. A NaN or missing value stops the report with the run named; it "
        "is never a verdict.")


class ClaimsError(ValueError):
    """Results that cannot make the comparison (none found, a run without its evaluation...)."""


class NoRunsError(ClaimsError):
    """No training run of the configuration has both its metrics and its evaluation (none has landed yet)."""


@dataclass
class RunData:
    method: str  # the arm: the method (or variant), ``method@model`` when it trained on another model's base
    seed: int
    metrics: list[dict]
    evaluation: dict
    base_eval: dict | None
    per_problem: list[float] = field(default_factory=list)
    model: str = ""
    lr: float | None = None  # the learning rate of the run's resolved training config


def arm(method: str, model: str, first_model: str) -> str:
    """A run's arm: its method, or ``method@model`` for a run on another model (e.g. QeRL on another NVFP4 base of
    the same weights) of the same dataset and algorithm."""
    return method if model == first_model else f"{method}@{model}"


def arm_method(name: str) -> str:
    """The method (or variant) of an arm."""
    return name.split("@", 1)[0]


def _read_jsonl(path: Path) -> list[dict]:
    """A run's metrics rows in step order: a row without its step, a step twice or a step missing between the first
    and the last is an error naming the file and the step (rows are read by their keys, never by position)."""
    rows = read_jsonl(path, "metrics file", allow_nan=True)
    if bad := [i for i, r in enumerate(rows, 1) if not isinstance(r.get("step"), int) or isinstance(r["step"], bool)]:
        raise ClaimsError(f"{path}: row {bad[0]} has no integer step (fields: {sorted(rows[bad[0] - 1])[:6]})")
    rows.sort(key=lambda r: r["step"])
    steps = [r["step"] for r in rows]
    if dup := sorted({s for a, s in zip(steps, steps[1:]) if a == s}):
        raise ClaimsError(f"{path}: step {dup[0]} appears more than once; a run's metrics hold each step once")
    if rows and (gap := next((a + 1 for a, b in zip(steps, steps[1:]) if b != a + 1), None)) is not None:
        raise ClaimsError(f"{path}: step {gap} is missing (steps {steps[0]}..{steps[-1]}, {len(steps)} rows); a cut "
                          "or merged metrics file cannot be compared")
    return rows


def _eval_json(path: Path) -> dict | None:
    if not path.is_file():
        return None
    data = read_eval_summary(path)
    if "per_problem" not in data:
        raise ClaimsError(f"{path}: has no per-problem scores (written by an older qerl evaluate); rerun it")
    if "problems" in data and len(data["per_problem"]) != data["problems"]:
        raise ClaimsError(f"{path}: per_problem holds {len(data['per_problem'])} scores for {data['problems']} "
                          "problems (a cut or edited evaluation); rerun it")
    return data


CHECKED_METRICS = ("reward_mean", "entropy", "rollout_entropy", "accuracy", "rollout_seconds", "train_seconds")


def _check_finite(run: str, metrics: list[dict], ev: dict, base_ev: dict | None) -> None:
    """A NaN / inf (or non-number) where a verdict reads it is an error naming the run, the field and the step."""
    for m in metrics:
        for k in CHECKED_METRICS:
            if k in m and m[k] is not None and not is_number(m[k]):
                raise ClaimsError(f"run {run}: metrics.jsonl step {m.get('step', '?')} has {k} = {m[k]!r}; a "
                                  "non-finite value cannot enter a verdict (rerun or drop the run)")
    for what, e in (("evaluation", ev), ("untrained base's evaluation", base_ev)):
        if e is None:
            continue
        if not is_number(e.get("pass@1")) or not all(is_number(x) for x in e.get("per_problem", [])):
            raise ClaimsError(f"run {run}: its {what} holds a non-finite or non-numeric score (pass@1 "
                              f"{e.get('pass@1')!r}); a verdict cannot read it")


def collect(config: dict, results: Path, benchmark: str | None = None) -> tuple[list[RunData], dict]:
    """The runs of the config's first (dataset, algorithm), with their metrics and evaluations; runs on a model other
    than the first run's are arms of their own (:func:`arm`)."""
    all_runs = runs(config)
    if not all_runs:
        raise ClaimsError("the workflow config names no runs")
    first = all_runs[0]
    bench = benchmark or (config.get("report", {}).get("table1", {}).get("benchmark")
                          or config["evaluation"]["benchmarks"][0])
    out, missing, unfinished = [], [], []
    for r in all_runs:
        if (r.dataset, r.algo) != (first.dataset, first.algo):
            continue
        mfile = results / "train" / r.path / "metrics.jsonl"
        ev = _eval_json(results / "eval" / r.path / f"{bench}.json")
        if mfile.is_file() and not (mfile.parent / "summary.json").is_file():
            unfinished.append(r.path)  # training cut short (or still running): never counted
            continue
        if not mfile.is_file() or ev is None:
            missing.append(r.path)
            continue
        base = base_of(base_method(config, r.method))  # QLoRA: its NF4 base, when evaluated
        base_ev = _eval_json(results / "eval" / f"{r.model}/{base}/untrained/none/seed0" / f"{bench}.json")
        metrics = _read_jsonl(mfile)
        if len(metrics) < 2:
            raise ClaimsError(f"run {r.path}: metrics.jsonl holds {len(metrics)} step(s); a run needs at least 2 to "
                              "be compared (a run cut off at its start? rerun it)")
        _check_finite(r.path, metrics, ev, base_ev)
        lr = (train_config(config, r).get("optim") or {}).get("lr")  # None: the trainer's default
        out.append(RunData(arm(r.method, r.model, first.model), r.seed, metrics, ev, base_ev, ev["per_problem"],
                           r.model, float(lr) if lr is not None else None))
    if not out:
        parts = [f"missing: {', '.join(missing[:3])}{' …' if len(missing) > 3 else ''}"] if missing else []
        if unfinished:
            parts.append(f"training unfinished (no summary.json): {', '.join(unfinished[:3])}"
                         f"{' …' if len(unfinished) > 3 else ''}")
        raise NoRunsError(f"{results}: no finished run has both metrics.jsonl and a {bench} evaluation "
                          f"({'; '.join(parts)})")
    meta = {"model": first.model, "dataset": first.dataset, "algorithm": first.algo, "benchmark": bench,
            "missing": missing, "unfinished": unfinished}
    return out, meta


def collect_curves(config: dict, results: Path) -> list[RunData]:
    """The training runs (metrics alone, no evaluation needed) of a config's first (dataset, algorithm): the curves a
    second configuration contributes to a curve claim (``--matched-rate``)."""
    all_runs = runs(config)
    out = []
    for r in all_runs:
        if (r.dataset, r.algo) != (all_runs[0].dataset, all_runs[0].algo):
            continue
        mfile = results / "train" / r.path / "metrics.jsonl"
        if not mfile.is_file():
            continue
        metrics = _read_jsonl(mfile)
        _check_finite(r.path, metrics, {"pass@1": 0.0}, None)
        lr = (train_config(config, r).get("optim") or {}).get("lr")
        out.append(RunData(arm(r.method, r.model, all_runs[0].model), r.seed, metrics, {}, None, [], r.model,
                           float(lr) if lr is not None else None))
    if not out:
        raise ClaimsError(f"{results}: no training run of configuration {config.get('configuration')!r} "
                          "(train/**/metrics.jsonl)")
    return out


# -- statistics -------------------------------------------------------------------------------------------------
def _by_method(data: list[RunData]) -> dict[str, list[RunData]]:
    out: dict[str, list[RunData]] = {}
    for d in data:
        out.setdefault(d.method, []).append(d)
    for v in out.values():
        v.sort(key=lambda d: d.seed)
    return out


def _series(d: RunData, key: str) -> list[float]:
    return [float(m[key]) for m in d.metrics if key in m and m[key] is not None]


def step_seconds(d: RunData) -> list[float]:
    """Each step's rollout + update seconds, the first (compilation, graph capture) left out."""
    return [float(m.get("rollout_seconds", 0)) + float(m.get("train_seconds", 0)) for m in d.metrics[1:]]


def window_mean(xs: list[float], lo: float, hi: float) -> float:
    """Mean of the part of ``xs`` between fractions ``lo`` and ``hi`` of its length."""
    a, b = int(len(xs) * lo), max(int(len(xs) * lo) + 1, int(len(xs) * hi))
    part = xs[a:b]
    return sum(part) / len(part) if part else float("nan")


def early_noise_window(d: RunData) -> tuple[int, int]:
    """Steps [a, b) of the early noisy phase: from the first step with sigma > 0 over the next 30% of training."""
    sig = _series(d, "sigma")
    on = next((i for i, s in enumerate(sig) if s > 0), None)
    if on is None:
        n = len(d.metrics)
        return int(0.1 * n), int(0.4 * n)
    return on, min(len(sig), on + max(1, int(0.3 * len(sig))))


def accuracy_verdict(lo: float, hi: float, margin: float = MARGIN) -> str:
    """An accuracy difference's 95% interval ``[lo, hi]`` (fractions) under :data:`RULE`."""
    if lo > 0:
        return "exceeds"
    if lo > -margin:
        return "matches"
    if hi < -margin:
        return "falls short"
    return "inconclusive"


def _verdict(lo: float, hi: float, positive_is_confirmed: bool = True) -> str:
    if lo > 0:
        return "confirmed" if positive_is_confirmed else "refuted"
    if hi < 0:
        return "refuted" if positive_is_confirmed else "confirmed"
    return "inconclusive"


# -- tables -----------------------------------------------------------------------------------------------------
def label(config: dict, method: str) -> str:
    """The paper's row label of a method: a variant's own ``label`` where the config gives one, else ``variant
    (base label variant)`` (``base label + AQN`` for an AQN-only variant); for an arm on another model ``label (the
    <model> base)``."""
    if "@" in method:
        name, model = method.split("@", 1)
        return f"{label(config, name)} (the {model} base)"
    if method in config.get("variants", {}):
        if config["variants"][method].get("label"):
            return config["variants"][method]["label"]
        over = config["variants"][method].get("overrides", {})
        if over == {"aqn": {"enabled": True}}:
            return f"{method_label(base_method(config, method))} + AQN"
        return f"{method} ({method_label(base_method(config, method))} variant)"
    return method_label(method)


def gpu_hours(d: RunData) -> float:
    """Training (every step's rollout + update seconds) plus evaluation seconds, in hours of one GPU."""
    train = sum(float(m.get("rollout_seconds", 0)) + float(m.get("train_seconds", 0)) for m in d.metrics)
    return (train + float(d.evaluation.get("seconds", 0))) / 3600


def run_rows(data: list[RunData], meta: dict, config: dict) -> list[list[str]]:
    head = ["model", "model_source", "method", "label", "seed", "lr", "device", "steps", "skipped_updates",
            "truncated_frac", "problems",
            "samples_per_problem", "pass1_before", "pass1_after", "adapter_sha256", "median_step_s", "gpu_hours",
            "reward_first10pct", "reward_last10pct", "mismatch_kl_mean", "entropy_mean"]
    rows = [head]
    for d in data:
        ev, rew = d.evaluation, _series(d, "reward_mean")
        src = ev.get("model_source") or "hf"
        if src == "gguf":
            src = f"gguf (dequantized from {ev.get('model_dequantized_from', '?')})"
        kl, ent, cut = _series(d, "mismatch_kl"), _series(d, "entropy"), _series(d, "truncated_frac")
        rows.append([d.model or meta["model"], src, d.method, label(config, d.method), str(d.seed),
                     f"{d.lr:g}" if d.lr is not None else "", str(ev.get("device", "")), str(len(d.metrics)),
                     str(int(sum(_series(d, "skipped_updates")))),
                     f"{sum(cut) / len(cut):.4f}" if cut else "", str(ev["problems"]),
                     str(ev.get("samples_per_problem", "")),
                     f"{100 * d.base_eval['pass@1']:.2f}" if d.base_eval else "",
                     f"{100 * ev['pass@1']:.2f}", str(ev.get("adapter_sha256", "")),
                     f"{statistics.median(step_seconds(d)):.3f}" if len(d.metrics) > 1 else "",
                     f"{gpu_hours(d):.4f}", f"{window_mean(rew, 0, 0.1):.3f}", f"{window_mean(rew, 0.9, 1):.3f}",
                     f"{sum(kl) / len(kl):.2e}" if kl else "", f"{sum(ent) / len(ent):.4f}" if ent else ""])
    return rows


def accuracy_rows(data: list[RunData], config: dict) -> list[list[str]]:
    by = _by_method(data)
    rows = [["method", "label", "seeds", "problems", "pass1_mean", "ci95_low", "ci95_high", "base_pass1",
             f"diff_vs_{REFERENCE}", "diff_ci95_low", "diff_ci95_high"]]
    ref = by.get(REFERENCE)
    for method, ds in by.items():
        scores = [d.per_problem for d in ds]
        m, lo, hi = boot_mean(scores)
        base = ds[0].base_eval
        row = [method, label(config, method), str(len(ds)), str(len(scores[0])), f"{100 * m:.2f}", f"{100 * lo:.2f}",
               f"{100 * hi:.2f}", f"{100 * base['pass@1']:.2f}" if base else ""]
        if ref and method != REFERENCE:
            dm, dlo, dhi = boot_diff(scores, [d.per_problem for d in ref])
            row += [f"{100 * dm:+.2f}", f"{100 * dlo:+.2f}", f"{100 * dhi:+.2f}"]
        else:
            row += ["", "", ""]
        rows.append(row)
    return rows


# -- claims -----------------------------------------------------------------------------------------------------
def _pts(m: float, lo: float, hi: float) -> str:
    return f"{p1(m, True)} points [{p1(lo, True)}, {p1(hi, True)}]"


def _gains(ds: list[RunData]) -> list[list[float]]:
    """Per seed, per problem: trained score minus the untrained base's score on the same problem."""
    base = ds[0].base_eval["per_problem"]
    if len(base) != len(ds[0].per_problem):
        raise ClaimsError(f"{ds[0].method}: its base was evaluated on {len(base)} problems, the run on "
                          f"{len(ds[0].per_problem)}")
    return [[a - b for a, b in zip(d.per_problem, base)] for d in ds]


def _zeros(xs: list[list[float]]) -> list[list[float]]:
    return [[0.0] * len(x) for x in xs]


def accuracy_claim(config: dict, name: str, arm_runs: list[RunData], lora: list[RunData]) -> dict:
    """Claim (a) for one QeRL arm against bf16 LoRA: the paired difference judged by :func:`accuracy_verdict`,
    and each one's gain over its own untrained base beside it."""
    dm, dlo, dhi = boot_diff([d.per_problem for d in arm_runs], [d.per_problem for d in lora])
    qm, lm = boot_mean([d.per_problem for d in arm_runs])[0], boot_mean([d.per_problem for d in lora])[0]
    how = accuracy_verdict(dlo, dhi)
    verdict = {"exceeds": "confirmed", "matches": "confirmed", "falls short": "refuted"}.get(how, "inconclusive")
    gain = ""
    if arm_runs[0].base_eval and lora[0].base_eval:
        gq, gl = _gains(arm_runs), _gains(lora)
        g = boot_diff(gq, gl)
        gain = (f"; gain over its own untrained base (paired by problem): {label(config, name)} "
                f"{_pts(*boot_diff(gq, _zeros(gq)))} (NVFP4 base {p1(arm_runs[0].base_eval['pass@1'])}), bf16 "
                f"LoRA {_pts(*boot_diff(gl, _zeros(gl)))} (bf16 base {p1(lora[0].base_eval['pass@1'])}); the "
                f"difference of the gains {_pts(*g)}")
    title = ("(a) QeRL reaches at least bf16 LoRA's accuracy" if name == "qerl" else
             f"(a) also: {label(config, name)} against bf16 LoRA")
    near = min(abs(x - m) for x in (dlo, dhi) for m in (0.0, -MARGIN))
    return {"claim": title, "verdict": verdict, "borderline": near < BORDERLINE,
            "numbers": f"pass@1 {p1(qm)} vs {p1(lm)}; difference {_pts(dm, dlo, dhi)} (problems x "
                       f"seeds): {how} (margin -{100 * MARGIN:g}){gain}"}


def claims(data: list[RunData], config: dict, timing: dict[str, list[list[dict]]] | None = None,
           matched: tuple[dict, dict[str, list[RunData]]] | None = None) -> list[dict]:
    """The paper's four claims checked on these runs: ``{"claim", "verdict", "numbers"}`` each. ``timing``: method ->
    metrics of a run that had its GPU to itself (``--timing``), the step times of claim (d); without it the
    workflow runs' own step times are used, and when those runs shared GPUs (``resources.jobs_per_gpu`` > 1) the
    claim is not judged. ``matched``: another configuration's ``(config, runs by arm)`` holding NVFP4 LoRA and bf16
    LoRA at one rate, where claim (c1) is judged (:func:`format_entropy_claim`)."""
    by = _by_method(data)
    out = []
    qerl, lora = by.get("qerl"), by.get(REFERENCE)
    if not (qerl and lora):
        return [{"claim": c, "verdict": "inconclusive", "numbers": "needs runs of both qerl and lora"}
                for c in ("(a)", "(b)", "(c1)", "(c2)", "(d)")]
    # (a) accuracy: non-inferiority within MARGIN on the paired interval; the mechanism (each method's gain over
    # its own untrained base, paired by problem) beside it. Judged for QeRL, then for every other QeRL arm (the
    # paper's recipe at another rate, QeRL on another base) as a row of its own.
    qerl_arms = ["qerl"] + [a for a in by if a != "qerl" and base_method(config, arm_method(a)) == "qerl"]
    for name in qerl_arms:
        out.append(accuracy_claim(config, name, by[name], lora))
    # (b) reward growth: mean reward of the last 20% of steps minus the first 20%, one value a run
    out.append(growth_claim(qerl, lora))
    # (c) entropy early. Two halves: NVFP4's own rounding noise against bf16 (no AQN), then AQN against none
    out.append(format_entropy_claim(config, by, matched))
    pairs = [("qerl", "nvfp4_lora"), *[(v, base_method(config, v)) for v in by if v in config.get("variants", {})
                                       and config["variants"][v].get("overrides") == {"aqn": {"enabled": True}}]]
    found = [x for w, wo in pairs if w in by and wo in by and (x := early_entropy(config, by[w], by[wo]))]
    verdicts = {v for v, _ in found}
    out.append({"claim": "(c2) AQN raises policy entropy early in training",
                "verdict": verdicts.pop() if len(verdicts) == 1 else "inconclusive",
                "numbers": "; ".join(t for _, t in found) or "no run pair to compare"})
    out.append(step_time_claim(config, data, qerl, lora, timing))
    return out


NOT_JUDGED = "not judged"
MIN_SEEDS = 2  # a curve claim's runs a method (a seed-level interval)
MIN_TIMED_RUNS = 5  # claim (d)'s timed runs a method (a t-interval over runs)


def _few_seeds(what: str, *arms: list[RunData]) -> str | None:
    """The message of a curve claim that cannot be judged: an arm with fewer than :data:`MIN_SEEDS` runs."""
    short = [f"{ds[0].method} has {len(ds)} run(s)" for ds in arms if len(ds) < MIN_SEEDS]
    if not short:
        return None
    return (f"{what}: {'; '.join(short)}; a curve claim is judged over seeds (a run's steps are not independent "
            f"draws) and needs >= {MIN_SEEDS} seeds an arm")


def growth_claim(qerl: list[RunData], lora: list[RunData]) -> dict:
    """Claim (b): each run's reward gain (mean of its last 20% of steps minus its first 20%), QeRL's runs against bf16
    LoRA's, seeds resampled (:func:`qerl.stages.stats.boot_seeds`)."""
    claim = "(b) QeRL's reward grows faster than bf16 LoRA's"

    def growth(d):
        r = _series(d, "reward_mean")
        return window_mean(r, 0.8, 1.0) - window_mean(r, 0.0, 0.2)

    gq, gl = [growth(d) for d in qerl], [growth(d) for d in lora]
    shown = (f"reward gain, last 20% of steps minus first 20%: QeRL {', '.join(f'{g:+.3f}' for g in gq)} vs bf16 "
             f"LoRA {', '.join(f'{g:+.3f}' for g in gl)} (per seed)")
    if msg := _few_seeds(shown, qerl, lora):
        return {"claim": claim, "verdict": NOT_JUDGED, "numbers": msg}
    d, lo, hi = boot_seeds(gq, gl, seed=1)
    return {"claim": claim, "verdict": _verdict(lo, hi),
            "numbers": f"{shown}; difference {d:+.3f}, 95% interval [{lo:+.3f}, {hi:+.3f}] (seeds resampled)"}


def _entropy_key(runs_: list[RunData]) -> str:
    """The rollout policy's entropy (what AQN changes: the sampling distribution) where every run logged it, else the
    trainer's recomputation."""
    return "rollout_entropy" if all(_series(d, "rollout_entropy") for d in runs_) else "entropy"


def early_entropy(config: dict, with_: list[RunData], without: list[RunData], window: str = "early") -> tuple | None:
    """``(verdict, text)``: each run's mean entropy over the early window (``early_noise_window`` of the arm with the
    noise; ``window="step1"``: the first step alone, before any update), ``with_``'s runs against ``without``'s, seeds
    resampled. None when a window is empty."""
    key = _entropy_key(with_ + without)
    a_vals, b_vals = [], []
    for runs_, vals in ((with_, a_vals), (without, b_vals)):
        for i, d in enumerate(runs_):
            series = _series(d, key)
            lo_s, hi_s = (0, 1) if window == "step1" else early_noise_window(with_[min(i, len(with_) - 1)])
            part = series[lo_s:hi_s]
            if part:
                vals.append(sum(part) / len(part))
    if not a_vals or not b_vals:
        return None
    what = "rollout-policy entropy" if key == "rollout_entropy" else "entropy (trainer)"
    when = "at step 1 (before any update)" if window == "step1" else "early in training"
    rates = {x.lr for x in with_}, {x.lr for x in without}
    rate = ""
    if all(len(r) == 1 and None not in r for r in rates):
        (ra,), (rb,) = rates
        rate = f" (both at {ra:g})" if ra == rb else f" (at {ra:g} vs {rb:g})"
    head = (f"{label(config, with_[0].method)} vs {label(config, without[0].method)}{rate if window != 'step1' else ''}"
            f": {what} {when} {statistics.mean(a_vals):.4f} vs {statistics.mean(b_vals):.4f}")
    if msg := _few_seeds(head, with_, without):
        return NOT_JUDGED, msg
    diff, lo, hi = boot_seeds(a_vals, b_vals)
    per = ", ".join(f"{x - y:+.3f}" for x, y in zip(a_vals, b_vals))
    return _verdict(lo, hi), (f"{head}, difference {diff:+.4f}, 95% interval [{lo:+.4f}, {hi:+.4f}] (seeds "
                              f"resampled; per seed pair {per})")


def _bf16_lora_arms(config: dict, by: dict[str, list[RunData]]) -> list[str]:
    """Arms that train bf16 LoRA without AQN (``lora`` and its variants that leave AQN off)."""
    out = []
    for a in by:
        if base_method(config, arm_method(a)) != REFERENCE:
            continue
        over = (config.get("variants", {}).get(arm_method(a)) or {}).get("overrides") or {}
        if not (over.get("aqn") or {}).get("enabled"):
            out.append(a)
    return out


def matched_pair(config: dict, by: dict[str, list[RunData]]) -> tuple[list[RunData], list[RunData]] | None:
    """NVFP4 LoRA's runs and a bf16 LoRA arm's (no AQN) at the same learning rate, where these runs hold both."""
    nv = by.get("nvfp4_lora")
    if not nv or len({d.lr for d in nv}) != 1:
        return None
    for a in _bf16_lora_arms(config, by):
        if {d.lr for d in by[a]} == {nv[0].lr}:
            return nv, by[a]
    return None


def format_entropy_claim(config: dict, by: dict[str, list[RunData]],
                         matched: tuple[dict, dict[str, list[RunData]]] | None = None) -> dict:
    """Claim (c1), NVFP4's rounding against bf16 (no AQN on either). Judged where the learning rate cannot enter: on
    the runs of NVFP4 LoRA and bf16 LoRA at one common rate over the early window (these runs, or ``matched``: another
    configuration's ``(config, runs by arm)``), else at step 1 (the rollout before any update). The early window of
    runs at different rates is shown beside, never judged."""
    claim = "(c1) NVFP4 rounding raises policy entropy early in training (no AQN)"
    nv, lora = by.get("nvfp4_lora"), by.get(REFERENCE)
    parts, verdict = [], None
    pair = matched_pair(config, by)
    where = (config, pair) if pair else None
    if where is None and matched:
        mpair = matched_pair(matched[0], matched[1])
        where = (matched[0], mpair) if mpair else None
    if where:
        v, text = early_entropy(where[0], *where[1])
        verdict = v
        parts.append(f"at a matched rate ({where[0].get('configuration', '')}): {text}")
    if nv and lora:
        step1 = early_entropy(config, nv, lora, window="step1")
        if step1:
            if verdict is None:
                verdict = step1[0]
            parts.append(step1[1])
        unmatched = early_entropy(config, nv, lora)
        if unmatched and not pair:
            rates = f"{nv[0].lr:g} vs {lora[0].lr:g}" if nv[0].lr and lora[0].lr else "different rates"
            parts.append(f"not judged, the rates differ ({rates}): {unmatched[1]}")
    if not parts:
        return {"claim": claim, "verdict": "inconclusive", "numbers": "no run pair to compare"}
    return {"claim": claim, "verdict": verdict or "inconclusive", "numbers": "; ".join(parts)}


def step_time_claim(config: dict, data: list[RunData], qerl: list[RunData], lora: list[RunData],
                    timing: dict[str, list[list[dict]]] | None) -> dict:
    """Claim (d): bf16 LoRA's step time over QeRL's, one median a run (step 1 left out), the ratio of the geometric
    means with its Welch t-interval (:func:`qerl.stages.stats.welch_log_ratio`) over >= :data:`MIN_TIMED_RUNS` runs a
    method that had the GPU to themselves (``timing``, else the workflow's runs when they did not share GPUs)."""
    claim = "(d) the QeRL step is faster than bf16 LoRA's"
    shared = int((config.get("resources") or {}).get("jobs_per_gpu", 1) or 1) > 1
    if timing and "qerl" in timing and REFERENCE in timing:
        mq = [statistics.median(step_seconds(RunData("qerl", 0, rows, {}, None))) for rows in timing["qerl"]]
        ml = [statistics.median(step_seconds(RunData(REFERENCE, 0, rows, {}, None))) for rows in timing[REFERENCE]]
        how = f"runs alone on the GPU ({len(mq)} QeRL and {len(ml)} bf16 LoRA run(s), --timing)"
    else:
        mq = [statistics.median(step_seconds(d)) for d in qerl]
        ml = [statistics.median(step_seconds(d)) for d in lora]
        how = ("the workflow's runs, which shared GPUs (resources.jobs_per_gpu "
               f"{config['resources']['jobs_per_gpu']}): not a fair timing" if shared else "the workflow's runs")
    devices = sorted({str(d.evaluation.get("device", "?")) for d in data})
    shown = (f"median step (rollout + update, step 1 left out) QeRL {', '.join(f'{x:.2f}' for x in mq)} s vs bf16 "
             f"LoRA {', '.join(f'{x:.2f}' for x in ml)} s")
    if shared and not timing:
        return {"claim": claim, "verdict": NOT_JUDGED, "numbers": f"{shown}; {how} ({', '.join(devices)})"}
    if min(len(mq), len(ml)) < MIN_TIMED_RUNS:
        return {"claim": claim, "verdict": NOT_JUDGED,
                "numbers": f"{shown}; {how}: {len(mq)} QeRL and {len(ml)} bf16 LoRA run(s), the rule needs >= "
                           f"{MIN_TIMED_RUNS} timed runs a method ({', '.join(devices)})"}
    ratio, lo, hi, df = welch_log_ratio(ml, mq)
    verdict = "confirmed" if lo > 1.05 else "refuted" if hi < 0.95 else "inconclusive"
    return {"claim": claim, "verdict": verdict,
            "numbers": f"{shown}: bf16 LoRA / QeRL = {ratio:.2f}x (geometric means), 95% interval [{lo:.2f}, "
                       f"{hi:.2f}] (Welch t on log run medians, {df:.1f} df); {how} ({', '.join(devices)})"}


def step_table_claim(paths: list[Path], models: tuple[str, ...] = ("7B", "14B", "32B")) -> dict:
    """Claim (d) where the paper makes it: bf16 LoRA's step time over QeRL's at 7B-32B, from ``reports/step``
    tables (``qerl bench step``: one row per model x method x batch x lengths; the last row of a setting counts).
    Each setting is one timed step after warm-up, so there is no interval: confirmed when every ratio exceeds 1.05,
    refuted when every one is below 0.95."""
    from qerl.readers import read_csv

    ratios, parts = [], []
    for path in paths:
        if not Path(path).is_file():
            raise ClaimsError(f"--step-table {path}: not found (a reports/step/<device>.csv of `qerl bench step`)")
        table = read_csv(path, "step table (qerl bench step)",
                         ("status", "model", "method", "batch", "prompt_len", "gen_len", "lengths", "total_s"))
        rows = [r for r in table if r.get("status") == "ok" and r.get("model") in models
                and r.get("method") in ("lora", "qerl") and str(r.get("nproc", "1")) == "1"]
        last: dict[tuple, dict] = {}
        for r in rows:
            last[(r["model"], r["batch"], r["prompt_len"], r["gen_len"], r["lengths"], r["method"])] = r
        for key, r in sorted(last.items(), key=lambda kv: (models.index(kv[0][0]), int(kv[0][1]))):
            if key[-1] != "qerl" or (*key[:-1], "lora") not in last:
                continue
            q, lo = float(r["total_s"]), float(last[(*key[:-1], "lora")]["total_s"])
            if not (math.isfinite(q) and math.isfinite(lo) and q > 0):
                raise ClaimsError(f"{path}: {key[0]} batch {key[1]}: a non-finite or zero step time")
            ratios.append(lo / q)
            parts.append(f"{key[0]} batch {key[1]} ({key[2]} + {key[3]} tokens, {key[4]}): {lo:.1f} / {q:.1f} s = "
                         f"{lo / q:.2f}x ({r['device']})")
    if not ratios:
        return {"claim": "(d2) the QeRL step is faster than bf16 LoRA's at 7B-32B", "verdict": "inconclusive",
                "numbers": "no setting with both methods in the step tables"}
    verdict = ("confirmed" if all(x > 1.05 for x in ratios) else
               "refuted" if all(x < 0.95 for x in ratios) else "inconclusive")
    return {"claim": "(d2) the QeRL step is faster than bf16 LoRA's at 7B-32B (where the paper claims it)",
            "verdict": verdict, "scale": "7B-32B", "numbers": f"QeRL faster (> 1.05x) in {sum(x > 1.05 for x in ratios)} of {len(ratios)} "
                                           f"settings, slower (< 0.95x) in {sum(x < 0.95 for x in ratios)}; bf16 LoRA "
                                           "/ QeRL step time (rollout + log-probs + update), one step after warm-up "
                                           "each: " + "; ".join(parts)}


# -- figures and the report -------------------------------------------------------------------------------------
PANELS = (("reward_mean", "reward"), ("accuracy", "accuracy (training batch)"),
          ("rollout_entropy|entropy", "policy entropy (rollout, Monte Carlo; else the trainer's)"),
          ("response_len_mean", "response length (tokens)"), ("mismatch_kl", "rollout-vs-trainer KL"),
          ("sigma", "AQN sigma"))


def _moving(xs: list[float], w: int = 9) -> list[float]:
    out = []
    for i in range(len(xs)):
        part = xs[max(0, i - w + 1): i + 1]
        out.append(sum(part) / len(part))
    return out


def seed_band(runs_: list[list[float]], boot: int = 400, seed: int = 0) -> tuple[list[float], list[float]]:
    """Per step, the 2.5% / 97.5% percentiles of the mean over seeds resampled with replacement (``runs_``: one
    equal-length curve per seed)."""
    rng = random.Random(seed)
    k, n = len(runs_), len(runs_[0])
    means = []
    for _ in range(boot):
        pick = [runs_[rng.randrange(k)] for _ in range(k)]
        means.append([sum(r[i] for r in pick) / k for i in range(n)])
    lo = [_pct([m[i] for m in means], 0.025) for i in range(n)]
    hi = [_pct([m[i] for m in means], 0.975) for i in range(n)]
    return lo, hi


def figure(data: list[RunData], config: dict, path: Path, title: str) -> Path:
    """Six panels of training curves, one line per method (mean over seeds, moving average of 9 steps) with its
    95% band over seeds (bootstrap). The plotted numbers go beside it as ``<stem>.csv`` (panel, method, step, mean,
    band): the figure's data, compared by a regeneration test where pixels could not be."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from qerl.figures import save_figure
    from qerl.files import write_text_atomic

    by = _by_method(data)
    data_rows = [["panel", "method", "step", "mean", "band_low", "band_high"]]
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    for ax, (key, name) in zip(axes.flat, PANELS):
        for method, ds in by.items():
            keys = key.split("|")  # the first key every run of the method logged
            k = next((k for k in keys if all(_series(d, k) for d in ds)), keys[-1])
            series = [_series(d, k) for d in ds]
            n = min(len(x) for x in series)
            if not n:
                continue
            smooth = (lambda xs: xs) if key == "sigma" else _moving
            runs_ = [smooth(x[:n]) for x in series]
            mean = [sum(x[i] for x in runs_) / len(runs_) for i in range(n)]
            (line,) = ax.plot(range(1, n + 1), mean, label=label(config, method))
            lo = hi = [None] * n
            if len(runs_) > 1 and key != "sigma":  # 95% band: seeds resampled (bootstrap over seeds)
                lo, hi = seed_band(runs_)
                ax.fill_between(range(1, n + 1), lo, hi, color=line.get_color(), alpha=0.15, linewidth=0)
            data_rows += [[k, method, str(i + 1), f"{mean[i]:.6g}", "" if lo[i] is None else f"{lo[i]:.6g}",
                           "" if hi[i] is None else f"{hi[i]:.6g}"] for i in range(n)]
        ax.set_title(name)
        ax.set_xlabel("step")
        if key == "mismatch_kl":
            if any(line.get_ydata().min() != line.get_ydata().max() for line in ax.get_lines()):
                ax.set_yscale("log")
    axes.flat[0].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    save_figure(fig, path)
    write_text_atomic(str(path.with_suffix(".csv")), _csv_text(data_rows))
    return path


def _md(rows: list[list[str]], skip: tuple[str, ...] = ()) -> str:
    keep = [i for i, h in enumerate(rows[0]) if h not in skip]
    lines = ["| " + " | ".join(cell(rows[0][i]) for i in keep) + " |", "|" + "---|" * len(keep)]
    lines += ["| " + " | ".join(cell(r[i]) for i in keep) + " |" for r in rows[1:]]
    return "\n".join(lines) + "\n"


TIMING_KEYS = ("step", "rollout_seconds", "rollout_gen_seconds", "generated_tokens", "train_seconds", "sigma",
               "rollout_capture_seconds", "rollout_prefill_seconds", "peak_memory_gb")


def read_timing(specs: list[str]) -> dict[str, list[list[dict]]]:
    """``METHOD=FILE`` pairs -> method -> its timed runs, each a list of metrics rows: a ``metrics.jsonl`` of a run
    that had its GPU to itself (give several per method, one file each, for an interval), or the
    ``step_alone.csv`` an earlier ``qerl claims`` wrote (its runs of that method, by its ``run`` column)."""
    from qerl.methods import NAMES

    out: dict[str, list[list[dict]]] = {}
    seen: set[tuple[str, Path]] = set()
    for spec in specs:
        method, sep, path = spec.partition("=")
        if not sep or not method or not path:
            raise ClaimsError(f"--timing {spec!r}: expected METHOD=FILE (metrics.jsonl or step_alone.csv)")
        if method not in NAMES:
            raise ClaimsError(f"--timing {spec}: {method!r} is not a method ({', '.join(NAMES)})")
        f = Path(path)
        if (method, f.resolve()) in seen:
            raise ClaimsError(f"--timing {spec}: the same file is given twice for {method} (one file per timed run)")
        seen.add((method, f.resolve()))
        if not f.is_file():
            raise ClaimsError(f"--timing {spec}: {f} not found")
        if f.suffix == ".csv":
            from qerl.readers import cell, read_csv

            by_run: dict[str, list[dict]] = {}
            for i, r in enumerate(read_csv(f, "step-time table", ("method",)), 2):
                if r["method"] == method:
                    by_run.setdefault(r.get("run", "0"), []).append(
                        {k: cell(v, f"--timing {spec}: {f}:{i}: {k}") for k, v in r.items()
                         if k not in ("method", "run") and v != ""})
            runs = list(by_run.values())
        else:
            runs = [_read_jsonl(f)]
        if not runs:
            raise ClaimsError(f"--timing {spec}: no steps of {method} in {f}")
        for rows in runs:
            if len(rows) < 2:
                raise ClaimsError(f"--timing {spec}: fewer than 2 steps of {method} in {f}")
            if bad := [i + 1 for i, r in enumerate(rows) if not {"rollout_seconds", "train_seconds"} <= set(r)]:
                raise ClaimsError(f"--timing {spec}: row {bad[0]} of {f} has no rollout_seconds / train_seconds (the "
                                  "step times claim (d) reads)")
        out.setdefault(method, []).extend(runs)
    return out


def scale(model: str) -> str:
    """The model size a verdict holds at, read from its name (``qwen2.5-coder-0.5b`` -> ``0.5B``); ``this scale``
    where the name gives none."""
    import re

    sizes = re.findall(r"(?<![\w.])(\d+(?:\.\d+)?)b(?![a-z])", model.lower())
    return f"{sizes[-1]}B" if sizes else "this scale"


def verdict_text(c: dict, model: str) -> str:
    """``**refuted** at 0.5B`` (``, borderline`` where the interval's end is within :data:`BORDERLINE` of a margin)."""
    if c["verdict"] == NOT_JUDGED:
        return f"**{NOT_JUDGED}**"
    return (f"**{c['verdict']}** at {c.get('scale') or scale(model)}"
            + (", borderline" if c.get("borderline") else ""))


def benchmark_table_alone(config: dict, results: Path, out: Path, why: str) -> dict | None:
    """A configuration whose training runs have not landed: ``benchmarks.csv`` / ``.md`` of its untrained bases and a
    ``claims.md`` that says so (no verdict); None when there is no evaluation either."""
    from qerl.stages.benchmarks_table import benchmarks_md, write_benchmarks
    from qerl.files import write_text_atomic

    if not any((results / "eval").glob("*/*/untrained/none/seed0/*.json")):
        return None
    rows = write_benchmarks(config, results, out, label, _eval_json)
    if len(rows) < 2:
        return None
    text = [f"# Claims checked: `{config.get('configuration', '')}` — no verdict yet", "",
            f"No training run of this configuration has landed ({why}); the untrained bases' scores alone:", "",
            benchmarks_md(rows, list(config["evaluation"]["benchmarks"]))]
    write_text_atomic(str(out / "claims.md"), "\n".join(text))
    return {"claims": [], "runs": 0, "bases": len(rows) - 1}


def build(config: dict, results: Path, out: Path, benchmark: str | None = None,
          timing: dict[str, list[list[dict]]] | None = None, step_tables: list[Path] | None = None,
          matched: tuple[dict, Path] | None = None) -> dict:
    """Write runs.csv/.md, accuracy.csv/.md/.png, curves.png/.csv and claims.md (and step_alone.csv with
    ``timing``) into ``out``; returns the claims. ``matched``: ``(config, results)`` of the runs claim (c1) is
    judged on at one common rate (``--matched-rate``)."""
    from qerl.files import write_text_atomic

    from qerl.stages.benchmarks_table import benchmarks_md, write_benchmarks

    try:
        data, meta = collect(config, results, benchmark)
    except NoRunsError:  # no trained run yet: the untrained bases' table, if any, is the report
        planned = len(runs(config))
        table = benchmark_table_alone(config, results, out, f"{planned} planned, none with its metrics and a "
                                      f"{benchmark or (config.get('report', {}).get('table1', {}).get('benchmark'))} "
                                      "evaluation")
        if table is None:
            raise
        return table
    more = None
    if matched:
        more = (matched[0], _by_method(collect_curves(*matched)))
    out.mkdir(parents=True, exist_ok=True)
    runs_rows, acc_rows = run_rows(data, meta, config), accuracy_rows(data, config)
    found = claims(data, config, timing, more)
    if step_tables:
        found.append(step_table_claim(step_tables))
    if timing:
        rows = [["method", "run", *TIMING_KEYS]] + [[m, str(i), *(str(r.get(k, "")) for k in TIMING_KEYS)]
                                                     for m, runs in timing.items() for i, rs in enumerate(runs)
                                                     for r in rs]
        write_text_atomic(str(out / "step_alone.csv"), _csv_text(rows))
    write_text_atomic(str(out / "runs.csv"), _csv_text(runs_rows))
    write_text_atomic(str(out / "runs.md"), _md(runs_rows, skip=("model", "adapter_sha256")))
    write_text_atomic(str(out / "accuracy.csv"), _csv_text(acc_rows))
    write_text_atomic(str(out / "accuracy.md"), _md(acc_rows))
    from qerl.stages.accuracy_plot import accuracy_figure

    figure(data, config, out / "curves.png",
           f"{meta['model']} - {meta['algorithm']} on {meta['dataset']} (mean over seeds; band: 95% over seeds)")
    accuracy_figure(acc_rows, runs_rows, out / "accuracy.png",
                    f"{meta['model']} - {meta['algorithm']} on {meta['dataset']}: pass@1 on {meta['benchmark']}",
                    REFERENCE, MARGIN)
    text = [f"# Claims checked: `{config.get('configuration', '')}` — {meta['model']}, {meta['algorithm'].upper()} on "
            f"{meta['dataset']}, pass@1 on {meta['benchmark']}", "",
            "Generated by `qerl claims` from the workflow's results (metrics.jsonl and evaluation JSON files).", "",
            "| claim (paper) | verdict | numbers |", "|---|---|---|"]
    text += [f"| {cell(c['claim'])} | {verdict_text(c, meta['model'])} | {cell(c['numbers'])} |" for c in found]
    text += ["", RULE, "", "## pass@1 per method (mean over seeds, 95% interval over problems and seeds)", "", _md(acc_rows),
             "![pass@1 per arm](accuracy.png)", "", "## Runs", "", _md(runs_rows, skip=("model", "adapter_sha256"))]
    cut = sorted(float(r[runs_rows[0].index("truncated_frac")]) for r in runs_rows[1:]
                 if r[runs_rows[0].index("truncated_frac")])
    if cut:
        text += [f"Training completions cut at the new-token cap: median {statistics.median(cut):.4f} over runs "
                 f"(from {cut[0]:.4f} to {cut[-1]:.4f}).", ""]
    text += ["![training curves](curves.png)", ""]
    if len(config["evaluation"]["benchmarks"]) > 1:
        rows = write_benchmarks(config, results, out, label, _eval_json)
        text += ["## Every benchmark (the paper's Table 2 shape; [benchmarks.csv](benchmarks.csv))", "",
                 benchmarks_md(rows, list(config["evaluation"]["benchmarks"]))]
    if meta["missing"]:
        text += [f"Runs without results (left out): {', '.join(meta['missing'])}", ""]
    if meta["unfinished"]:
        text += [f"Runs whose training did not finish (no summary.json; left out): {', '.join(meta['unfinished'])}",
                 ""]
    write_text_atomic(str(out / "claims.md"), "\n".join(text))
    return {"claims": found, "runs": len(data), "missing": meta["missing"], "unfinished": meta["unfinished"]}
