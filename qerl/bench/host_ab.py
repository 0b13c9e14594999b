"""Same-machine A/B of the host time: ``qerl bench host --baseline-kernels DIR [--rounds N]``.

The host time of an eager call differs up to 1.7x between machines of one kind and from run to run on one machine
(reports/host), more than most changes to the call path move it, so a change is measured as an A/B on one machine:
``qerl bench host`` run as child processes, alternately with a baseline copy of the kernels (``DIR``, e.g. made by
``git archive <rev> kernels | tar -x -C DIR``; ``self``: a copy of the installed ones, a null A/B) shadowing
``qerl_kernels`` on ``PYTHONPATH`` and with the kernels installed now, ``N`` rounds each, in the order baseline,
current, current, baseline, … (so that a drift of the machine that is linear in time weighs on both sides alike over
two rounds). Per row the median over the rounds of each side; ``<output>/<device>_ab.csv / .md`` give each row's
route and host / loop time before and after and, in the ``.md``, the rows at the target before and after and the
medians of the rows whose route or config changed, by call.
"""
from __future__ import annotations

import csv
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from qerl.files import write_text_atomic

TARGET_US = 40.0
KEY = ("model", "proj", "M", "call")


def baseline_package(kernels_dir: Path) -> Path:
    """The baseline ``qerl_kernels`` package in ``kernels_dir``: the directory itself when it holds ``ops.py``,
    else its ``qerl_kernels/`` (what ``git archive <rev> qerl_kernels`` unpacks) or ``kernels/`` (its former
    name)."""
    for cand in (kernels_dir, kernels_dir / "qerl_kernels", kernels_dir / "kernels"):
        if (cand / "ops.py").is_file():
            return cand.resolve()
    raise SystemExit(f"qerl bench host: --baseline-kernels {kernels_dir}: no ops.py there, nor in its qerl_kernels/ "
                     f"or kernels/ (expected a copy of the kernels package, e.g. from `git archive <rev> qerl_kernels`)")


SELF = "self"  # --baseline-kernels self: a copy of the installed kernels (a null A/B, or a knob's with current_args)


def self_copy(tmp: Path) -> Path:
    """A copy of the installed ``qerl_kernels`` package (the portion its ``ops`` module comes from) in ``tmp``: the
    baseline of a null A/B — the same kernels on both sides, so any difference is the method's own — or of a knob's
    A/B (``current_args``)."""
    import shutil

    from qerl_kernels import ops

    dest = tmp / "self_copy" / "qerl_kernels"
    shutil.copytree(Path(os.path.realpath(ops.__file__)).parent, dest, ignore=shutil.ignore_patterns("__pycache__"))
    return dest.resolve()


def shadow_site(package: Path, tmp: Path) -> Path:
    """A directory to put first on ``PYTHONPATH`` in which ``qerl_kernels`` is the baseline ``package``."""
    site = tmp / "baseline_site"
    site.mkdir(parents=True, exist_ok=True)
    link = site / "qerl_kernels"
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(package, target_is_directory=True)
    return site


def baseline_env(site: Path) -> dict:
    """The environment overrides of a baseline child: ``site`` first on ``PYTHONPATH``."""
    return {"PYTHONPATH": os.pathsep.join([str(site)] + [p for p in [os.environ.get("PYTHONPATH", "")] if p])}


def plan(bench_args: list[str], site: Path, out: Path, rounds: int,
         current_args: list[str] = ()) -> list[tuple[str, int, dict, list[str]]]:
    """The child runs in order: ``(side, round, environment overrides, command)``; baseline then current in even
    rounds, current then baseline in odd ones."""
    base_env = baseline_env(site)
    runs = []
    for r in range(rounds):
        pair = (("baseline", base_env), ("current", {}))
        for side, env in (pair if r % 2 == 0 else pair[::-1]):
            cmd = [sys.executable, "-m", "qerl", "bench", "host", *bench_args,
                   *(current_args if side == "current" else ()), "--no-compare", "--no-profile",
                   "--output", str(out / f"{side}{r}")]
            runs.append((side, r, env, cmd))
    return runs


def _read(run_dir: Path) -> list[dict]:
    files = sorted(run_dir.glob("*.csv"))
    if not files:
        raise SystemExit(f"qerl bench host: the run in {run_dir} wrote no CSV")
    with open(files[0], newline="") as f:
        return list(csv.DictReader(f))


def merge(baseline: list[list[dict]], current: list[list[dict]]) -> list[dict]:
    """One row per (model, proj, M, call) of the current runs: each side's route and median host / loop µs over its
    runs, the current side's cuBLAS loop µs, and whether every current run's result equalled Triton's launches."""
    def index(runs):
        return [{tuple(str(r[k]) for k in KEY): r for r in run} for run in runs]

    b, c = index(baseline), index(current)
    med = statistics.median
    rows = []
    for key, r in c[0].items():
        missing = [i for i, run in enumerate(b + c) if key not in run]
        if missing:
            raise SystemExit(f"qerl bench host: row {key} missing from run {missing[0]} of the A/B")
        rows.append({"model": r["model"], "proj": r["proj"], "N": r["N"], "K": r["K"], "M": r["M"], "call": r["call"],
                     "path_before": b[0][key]["path"], "path_after": r["path"],
                     "config_changed": b[0][key].get("config", "") != r.get("config", ""),
                     "host_before": round(med(float(run[key]["host_us"]) for run in b), 1),
                     "host_after": round(med(float(run[key]["host_us"]) for run in c), 1),
                     "loop_before": round(med(float(run[key]["loop_us"]) for run in b), 1),
                     "loop_after": round(med(float(run[key]["loop_us"]) for run in c), 1),
                     "cublas_loop": round(med(float(run[key]["cublas_loop_us"]) for run in c), 1),
                     # direct launches per side (fewest over its runs): 0 means the calls went through Triton's path
                     "direct_before": min(int(float(run[key].get("direct_launches") or 0)) for run in b),
                     "direct_after": min(int(float(run[key].get("direct_launches") or 0)) for run in c),
                     "same_result": all(str(run[key]["same_result"]) == "True" for run in c)})
    return rows


def changed(row: dict) -> bool:
    """Whether a merged row's call runs differently after: another route, or the same route with another config
    (e.g. one launch instead of a pre-pass and the kernel)."""
    return row["path_before"] != row["path_after"] or str(row.get("config_changed")) == "True"


def run_medians(order: list[tuple[str, int, list[dict]]], rows: list[dict]) -> list[tuple[str, float]]:
    """Per child run ``(side, round, its rows)``, in the order they ran, the median host µs of the rows whose route
    did not change: what the machine itself drifted by between runs."""
    same = {tuple(str(r[k]) for k in KEY) for r in rows if not changed(r)}
    out = []
    for side, r, run in order:
        vals = [float(x["host_us"]) for x in run if tuple(str(x[k]) for k in KEY) in same]
        if vals:
            out.append((f"{side} {r + 1}", statistics.median(vals)))
    return out


def summary_lines(rows: list[dict], rounds: int, runs: list[tuple[str, float]] = ()) -> list[str]:
    """The ``.md`` summary: rows at the target before / after; the unchanged rows' medians, overall and per child
    run (how far the machine drifted); the rows whose route or config changed, by call (medians), also divided by the
    unchanged rows' ratio."""
    med = statistics.median
    same = [r for r in rows if not changed(r)]
    changed_rows = [r for r in rows if changed(r)]
    out = [f"{len(rows)} rows, {rounds} round(s) per side (medians); rows at ≤ {TARGET_US:.0f} µs of host time: "
           f"**{sum(r['host_before'] <= TARGET_US for r in rows)} → {sum(r['host_after'] <= TARGET_US for r in rows)}**"
           f"; results equal to Triton's launches in {sum(r['same_result'] for r in rows)} / {len(rows)}.", ""]
    drift = 1.0
    if same:
        before, after = med(r['host_before'] for r in same), med(r['host_after'] for r in same)
        drift = after / before if before else 1.0
        out += [f"Rows whose route and config did not change ({len(same)}): host µs median {before:.1f} → "
                f"{after:.1f} (×{drift:.2f}: the machine's drift between the sides, which the same code should not "
                "show)."]
        if runs:
            out += ["Their median per child run, in the order run: "
                    + ", ".join(f"{n} {v:.1f}" for n, v in runs) + "."]
        out.append("")
    if changed_rows:
        out += [f"Rows whose route or config changed ({len(changed_rows)}), medians by call; the last column "
                "divides the after / before ratio of host time by the unchanged rows' ratio:", "",
                "| call (rows) | host µs before → after | loop µs before → after | cuBLAS loop µs "
                "| host ratio ÷ drift |", "|---|---|---|---|---|"]
        for call in sorted({r["call"] for r in changed_rows}):
            c = [r for r in changed_rows if r["call"] == call]
            hb, ha = med(r['host_before'] for r in c), med(r['host_after'] for r in c)
            out.append(f"| {call} ({len(c)}) | {hb:.1f} → {ha:.1f}"
                       f" | {med(r['loop_before'] for r in c):.1f} → {med(r['loop_after'] for r in c):.1f} | "
                       f"{med(r['cublas_loop'] for r in c):.1f} | {(ha / hb if hb else 1.0) / drift:.2f} |")
        out.append("")
    return out


def write(rows: list[dict], out: Path, device: str, rounds: int, baseline: Path,
          runs: list[tuple[str, float]] = ()) -> Path:
    from qerl.bench.report import device_csv

    stem = device_csv(rows, out, device, tail="_ab")
    lines = [f"# Host time per eager NVFP4 call, A/B on one machine — {device}", "",
             f"`qerl bench host --baseline-kernels {baseline}`: the baseline kernels and the current ones run "
             f"alternately (baseline, current, current, baseline, …) as child processes of one machine.", ""]
    lines += summary_lines(rows, rounds, runs)
    lines += ["| model | proj | M | call | path before | path after | host µs before | after | loop µs before | after "
              "| cuBLAS loop µs |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['proj']} | {r['M']} | {r['call']} | {r['path_before']} | {r['path_after']} "
                     f"| {r['host_before']} | {r['host_after']} | {r['loop_before']} | {r['loop_after']} | "
                     f"{r['cublas_loop']} |")
    path = stem.with_suffix(".md")
    write_text_atomic(path, "\n".join(lines) + "\n")
    return path


def run(bench_args: list[str], kernels_dir: Path, rounds: int, output: Path, device: str,
        runner=subprocess.run, current_args: list[str] = ()) -> Path:
    """The A/B (module docstring): ``rounds`` >= 1 alternations of the baseline ``kernels_dir`` and the current
    kernels over the rows ``bench_args`` select, ``current_args`` added to the current side's runs only (a knob's
    A/B); ``runner`` runs one child (``subprocess.run``'s signature)."""
    if rounds < 1:
        raise SystemExit(f"qerl bench host: --rounds must be at least 1, got {rounds}")
    with tempfile.TemporaryDirectory(prefix="qerl_host_ab_") as tmp:
        tmp = Path(tmp)
        package = self_copy(tmp) if str(kernels_dir) == SELF else baseline_package(kernels_dir)
        site = shadow_site(package, tmp)
        probe = runner([sys.executable, "-c", "import qerl_kernels, os; print(os.path.realpath(qerl_kernels.__path__[0]))"],
                       env={**os.environ, **baseline_env(site)}, capture_output=True, text=True)
        if probe.returncode or Path(probe.stdout.strip()) != package:
            raise SystemExit(f"qerl bench host: the baseline child imports qerl_kernels from {probe.stdout.strip() or '?'}"
                             f", not {package} (is qerl_kernels installed in a way PYTHONPATH cannot shadow?)")
        sides, order = {"baseline": [], "current": []}, []
        for side, r, env, cmd in plan(bench_args, site, tmp, rounds, current_args):
            print(f"A/B round {r + 1} / {rounds}: {side}", flush=True)
            done = runner(cmd, env={**os.environ, **env})
            if done.returncode:
                raise SystemExit(f"qerl bench host: the {side} run of round {r + 1} failed (exit {done.returncode})")
            sides[side].append(_read(tmp / f"{side}{r}"))
            order.append((side, r, sides[side][-1]))
        rows = merge(sides["baseline"], sides["current"])
        runs = run_medians(order, rows)
    return write(rows, output, device, rounds, kernels_dir, runs)
