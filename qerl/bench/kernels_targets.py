"""Issue 5's targets read off a ``qerl bench kernels`` CSV (no GPU): ``qerl bench kernels --targets CSV
[--against OLD_CSV]`` prints them as a Markdown table (and JSON with ``--json``), so that every number in
reports/kernels/README.md can be recomputed from the committed runs.

Targets (issue 5): M <= 16 forward >= 80% of the copy bandwidth and >= 2.8x cuBLAS; M = 64 >= 2x; M >= 2048
forward and backward >= 0.85x; the rank-32 LoRA (x·Aᵀ included) adding <= 10% at decode sizes. Also the
per-M forward medians and, against an older run of the same shapes, the change of the median speed-up
and of the base + LoRA time.
"""
from __future__ import annotations

import csv
import statistics
from pathlib import Path

DECODE_BW, DECODE_X, M64_X, LARGE_X, LORA_MAX = 80.0, 2.8, 2.0, 0.85, 0.10


def read_csv(path: Path) -> tuple[list[dict], float, str]:
    """Rows of a benchmark CSV with numeric fields parsed; (rows, copy GB/s, device)."""
    with open(path, newline="") as f:
        raw = list(csv.DictReader(f))
    if not raw:
        raise ValueError(f"{path}: no rows")
    need = {"device", "copy_GBps", "model", "proj", "M", "kind", "us", "cublas_us", "speedup", "GBps",
            "lora32_overhead"}
    missing = need - set(raw[0])
    if missing:
        raise ValueError(f"{path}: not a `qerl bench kernels` CSV (missing columns {sorted(missing)})")
    rows = []
    for r in raw:
        rows.append({**r, "M": int(r["M"]), "us": float(r["us"]), "cublas_us": float(r["cublas_us"]),
                     "speedup": float(r["speedup"]), "GBps": float(r["GBps"]),
                     "lora32_overhead": float(r["lora32_overhead"]) if r["lora32_overhead"] not in ("", "None")
                     else None})
    return rows, float(raw[0]["copy_GBps"]), raw[0]["device"]


def _span(xs: list[float]) -> dict:
    return {"min": min(xs), "max": max(xs), "median": statistics.median(xs), "n": len(xs)} if xs else {}


def targets(rows: list[dict], copy_gbps: float) -> dict:
    """The targets on one run: ranges, medians and how many rows meet each."""
    dec = [r for r in rows if r["M"] <= 16 and r["kind"] == "fwd"]
    m64 = [r["speedup"] for r in rows if r["M"] == 64 and r["kind"] == "fwd"]
    big = [r for r in rows if r["M"] >= 2048]
    lora = [r["lora32_overhead"] for r in rows if r["lora32_overhead"] is not None and r["M"] <= 16]
    out = {
        "decode_speedup": _span([r["speedup"] for r in dec]),
        "decode_pct_copy_bw": _span([100 * r["GBps"] / copy_gbps for r in dec]),
        "decode_met": sum(r["speedup"] >= DECODE_X and 100 * r["GBps"] / copy_gbps >= DECODE_BW for r in dec),
        "m64_speedup": _span(m64), "m64_met": sum(x >= M64_X for x in m64),
        "large_speedup": _span([r["speedup"] for r in big]), "large_met": sum(r["speedup"] >= LARGE_X for r in big),
        "large_missed": [(r["model"], r["proj"], r["M"], r["kind"], round(r["speedup"], 3)) for r in big
                         if r["speedup"] < LARGE_X],
        "lora_decode": _span(lora), "lora_decode_met": sum(x <= LORA_MAX for x in lora),
        "fwd_median_by_M": {M: statistics.median(r["speedup"] for r in rows if r["M"] == M and r["kind"] == "fwd")
                            for M in sorted({r["M"] for r in rows if r["kind"] == "fwd"})},
        "lora_median_by_M": {M: statistics.median(v) for M in sorted({r["M"] for r in rows})
                             if (v := [r["lora32_overhead"] for r in rows
                                       if r["M"] == M and r["lora32_overhead"] is not None])},
    }
    return out


def compare(new: list[dict], old: list[dict]) -> dict:
    """Per forward M: median speed-up old -> new and the median ratio new / old of the base + LoRA-32 time
    (base time x (1 + overhead)), over the shapes both runs have."""
    key = lambda r: (r["model"], r["proj"], r["M"], r["kind"])  # noqa: E731
    olds = {key(r): r for r in old}
    out = {}
    for M in sorted({r["M"] for r in new if r["kind"] == "fwd"}):
        pairs = [(olds[key(r)], r) for r in new if r["M"] == M and r["kind"] == "fwd" and key(r) in olds]
        if not pairs:
            continue
        lora = [(b["us"] * (1 + b["lora32_overhead"])) / (a["us"] * (1 + a["lora32_overhead"])) for a, b in pairs
                if a["lora32_overhead"] is not None and b["lora32_overhead"] is not None]
        out[M] = {"old_median": statistics.median(a["speedup"] for a, _ in pairs),
                  "new_median": statistics.median(b["speedup"] for _, b in pairs),
                  "base_plus_lora_ratio": statistics.median(lora) if lora else None}
    return out


def markdown(t: dict, device: str, copy_gbps: float, cmp: dict | None = None) -> str:
    """The targets table (and the per-M comparison) as Markdown."""
    def rng(s: dict, fmt: str = "{:.2f}x") -> str:
        return f"{fmt.format(s['min'])}–{fmt.format(s['max'])} (median {fmt.format(s['median'])})" if s else "—"

    d, big, lo = t["decode_speedup"], t["large_speedup"], t["lora_decode"]
    lines = [f"Targets on {device} (copy {copy_gbps:.0f} GB/s)", "",
             "| target | goal | measured | met |", "|---|---|---|---|",
             f"| M ≤ 16 fwd | ≥ {DECODE_X}x, ≥ {DECODE_BW:.0f}% copy BW | {rng(d)}, "
             f"{rng(t['decode_pct_copy_bw'], '{:.0f}%')} | {t['decode_met']}/{d.get('n', 0)} |",
             f"| M = 64 fwd | ≥ {M64_X}x | {rng(t['m64_speedup'])} | {t['m64_met']}/{t['m64_speedup'].get('n', 0)} |",
             f"| M ≥ 2048 fwd + bwd | ≥ {LARGE_X}x | {rng(big, '{:.3f}x')} | {t['large_met']}/{big.get('n', 0)} |",
             f"| LoRA-32 at M ≤ 16 | ≤ {100 * LORA_MAX:.0f}% | {rng(lo, '{:.0%}')} | "
             f"{t['lora_decode_met']}/{lo.get('n', 0)} |", "",
             "| M | fwd median speed-up | LoRA-32 median |" + (" vs old: speed-up | base + LoRA time |" if cmp else ""),
             "|---|---|---|" + ("---|---|" if cmp else "")]
    for M, med in t["fwd_median_by_M"].items():
        lora = t["lora_median_by_M"].get(M)
        row = f"| {M} | {med:.2f}x | {'' if lora is None else f'{lora:.0%}'} |"
        if cmp:
            c = cmp.get(M)
            if c is None:
                row += " | |"
            else:
                ratio = c["base_plus_lora_ratio"]
                change = "" if ratio is None else f"{ratio - 1:+.0%}"
                row += f" {c['old_median']:.2f}x → {c['new_median']:.2f}x | {change} |"
        lines.append(row)
    return "\n".join(lines) + "\n"
