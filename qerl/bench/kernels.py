"""``qerl bench kernels``: NVFP4 Triton kernels vs cuBLAS bf16 on Qwen2.5 projection shapes.

For each model (7B/14B/32B) and projection (fused q/k/v, o, fused gate/up, down) and each M, the
forward ``x·Ŵᵀ`` and backward ``dY·Ŵ`` are timed (median of CUDA-graph replays over rotating weight
copies, so the 50-60 MB L2 cache does not flatter small matrices) next to ``F.linear`` / ``matmul``
on the bf16 weight, in the same run, the replays of the two interleaved. Reported: median µs, achieved GB/s (packed weights + scales +
activations + outputs), TFLOP/s, speed-up over cuBLAS, LoRA-32 overhead at decode sizes, and the
card's device-to-device copy bandwidth. ``--tune`` also searches tile configs per (kind, M bucket,
N, K) and writes ``qerl_kernels/tuned/<device>.json`` (the committed tuned defaults).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from qerl.bench.timing import copy_bandwidth
from qerl.bench.timing import eager_time as _eager_time, graph_time as _graph_time, graph_times as _graph_times
from qerl.models.shapes import MODELS_HELP, QWEN25, SHAPES, model_arg, projections  # noqa: F401 (projections: the bench's public shape table)
from qerl.files import atomic_open, write_text_atomic

MODELS = ("7B", "14B", "32B")  # the Qwen2.5 sizes whose projections are timed (their shapes: qerl.models.shapes)
MS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 2048, 8192)
GEMLITE_MAX_M = 512  # the peer is a W4A16 decode / small-batch kernel; larger M go to the DQ path + cuBLAS


def _weights(N: int, K: int, copies: int):
    from qerl.quant import nvfp4

    out = []
    for i in range(copies):
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02
        p, s, g = nvfp4.quantize(w)
        out.append((w, p, s, g))
    return out


def _gemlite_modules(ws) -> list | None:
    """gemlite ``A16W4_NVFP`` modules on each weight copy's packed tensors, or None when it will not build."""
    from qerl.bench import gemlite_peer

    try:
        return [gemlite_peer.linear(p, s, g) for _, p, s, g in ws]
    except Exception as e:  # a peer that fails is reported, never fatal for our own rows
        print(f"gemlite: cannot build A16W4_NVFP ({type(e).__name__}: {e}); column left empty")
        return None


def _gemlite_times(mods, x, ws) -> dict:
    """gemlite forward on ``x``: seconds per call (CUDA graph, or eager launches when its path cannot be
    captured: ``timing`` says which), µs, and relative error against our reference forward."""
    from qerl.ops.linear import reference_forward
    from qerl.bench import gemlite_peer

    _, p, s, g = ws[0]
    try:
        err = gemlite_peer.relative_error(mods[0](x), reference_forward(x, p, s, g, None))
    except Exception as e:  # e.g. gemlite 0.6 + Triton 3.6 on sm_90: its tl.dot_scaled path does not compile
        msg = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        print(f"gemlite: forward failed at M={x.shape[0]} ({msg})")
        return {"error": msg}
    calls = [lambda m=m: m(x) for m in mods]
    try:
        sec, timing = _graph_times({"g": calls})["g"], "graph"
    except Exception:  # e.g. a host-side step in its launcher
        torch.cuda.synchronize()
        sec, timing = _eager_time(calls), "eager"
    return {"s": sec, "us": sec * 1e6, "rel_err": err, "timing": timing}


def bench_shape(model: str, proj: str, N: int, K: int, ms, lora_rank: int = 32, gemlite: bool = False) -> list[dict]:
    from qerl.ops.linear import reference_backward_input, reference_forward
    from qerl_kernels.ops import config_source, nvfp4_matmul, nvfp4_matmul_t

    device, sms = torch.cuda.get_device_name(), torch.cuda.get_device_properties(0).multi_processor_count
    bf16_bytes = N * K * 2
    copies = max(2, min(16, (512 * 2 ** 20) // bf16_bytes + 1))  # > L2 of the bf16 working set
    ws = _weights(N, K, copies)
    la = torch.randn(lora_rank, K, device="cuda", dtype=torch.bfloat16) * 0.01
    lb = torch.randn(N, lora_rank, device="cuda", dtype=torch.bfloat16) * 0.01
    rows = []
    peers = _gemlite_modules(ws) if gemlite else None
    for M in ms:
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
        named = {
            "fwd": [lambda p=p, s=s, g=g: nvfp4_matmul(x, p, s, g) for _, p, s, g in ws],
            "fwd_cublas": [lambda w=w: torch.nn.functional.linear(x, w) for w, *_ in ws],
            "bwd": [lambda p=p, s=s, g=g: nvfp4_matmul_t(dy, p, s, g) for _, p, s, g in ws],
            "bwd_cublas": [lambda w=w: dy @ w for w, *_ in ws],
        }
        if M <= 64:
            # the whole LoRA (x·Aᵀ included): fused into the decode launch at M <= 16
            named["fwd_lora"] = [lambda p=p, s=s, g=g: nvfp4_matmul(x, p, s, g, None, None, lb, 2.0, lora_a=la)
                                 for _, p, s, g in ws]
            # what the bf16 LoRA policy runs for the same projection (the engine's dense Proj): cuBLAS, x·Aᵀ, addmm
            named["fwd_cublas_lora"] = [lambda w=w: torch.addmm(torch.nn.functional.linear(x, w),
                                                                torch.nn.functional.linear(x, la), lb.t(), alpha=2.0)
                                        for w, *_ in ws]
        t = {
            **_graph_times(named),
            # the seam's pure-torch reference (dequantize, then cuBLAS): what runs without the kernels
            "fwd_reference": _eager_time([lambda p=p, s=s, g=g: reference_forward(x, p, s, g, None)
                                          for _, p, s, g in ws[:2]]),
            "bwd_reference": _eager_time([lambda p=p, s=s, g=g: reference_backward_input(dy, p, s, g)
                                          for _, p, s, g in ws[:2]]),
        }
        peer = _gemlite_times(peers, x, ws) if peers and M <= GEMLITE_MAX_M else {}
        q_bytes = N * K // 2 + N * K // 16
        for kind in ("fwd", "bwd"):
            io = M * K * 2 + M * N * 2
            sec = t[kind]
            rows.append({
                "model": model, "proj": proj, "N": N, "K": K, "M": M, "kind": kind,
                "config_source": config_source(device, kind, M, N, K, sms), "us": sec * 1e6,
                "cublas_us": t[f"{kind}_cublas"] * 1e6, "speedup": t[f"{kind}_cublas"] / sec,
                "reference_us": t[f"{kind}_reference"] * 1e6, "vs_reference": t[f"{kind}_reference"] / sec,
                "GBps": (q_bytes + io) / sec / 1e9, "cublas_GBps": (bf16_bytes + io) / t[f"{kind}_cublas"] / 1e9,
                "TFLOPs": 2 * M * N * K / sec / 1e12,
                "lora32_overhead": (t["fwd_lora"] / t["fwd"] - 1) if kind == "fwd" and "fwd_lora" in t else None,
                "lora_us": t["fwd_lora"] * 1e6 if kind == "fwd" and "fwd_lora" in t else None,
                "lora_speedup": t["fwd_cublas_lora"] / t["fwd_lora"] if kind == "fwd" and "fwd_lora" in t else None,
                **({} if not gemlite else {  # gemlite A16W4_NVFP on the same packed weights (forward only)
                    "gemlite_us": peer.get("us") if kind == "fwd" else None,
                    "gemlite_speedup": t["fwd_cublas"] / peer["s"] if kind == "fwd" and peer.get("s") else None,
                    "gemlite_rel_err": peer.get("rel_err") if kind == "fwd" else None,
                    "gemlite_timing": peer.get("timing") if kind == "fwd" else None,
                    "gemlite_error": peer.get("error") if kind == "fwd" else None}),
            })
    del ws
    torch.cuda.empty_cache()
    return rows


def bench_dequant(model: str, proj: str, N: int, K: int, copy_gbps: float) -> dict:
    """The dequantization kernel alone (the ``DQ`` path's first half): µs and GB/s for the whole W
    (0.5625 B read + 2 B written per weight) next to the reference's dequantization."""
    from qerl.quant.nvfp4 import dequantize
    from qerl_kernels.nvfp4_dequant import dequantize_into

    ws = _weights(N, K, 2)
    out = torch.empty(N, K, device="cuda", dtype=torch.bfloat16)
    t = _graph_time([lambda p=p, s=s, g=g: dequantize_into(out, p, s.view(torch.uint8), g) for _, p, s, g in ws])
    t_ref = _eager_time([lambda p=p, s=s, g=g: dequantize(p, s, g, torch.bfloat16) for _, p, s, g in ws])
    nbytes = N * K * (0.5 + 1 / 16 + 2)
    del ws, out
    torch.cuda.empty_cache()
    return {"model": model, "proj": proj, "N": N, "K": K, "us": t * 1e6, "GBps": nbytes / t / 1e9,
            "pct_copy_bw": 100 * nbytes / t / 1e9 / copy_gbps, "reference_us": t_ref * 1e6, "vs_reference": t_ref / t}


def _write_csv(rows: list[dict], device: str, path: Path) -> Path:
    import csv

    with atomic_open(path, newline="") as f:
        w = csv.DictWriter(f, fieldnames=["device", *rows[0].keys()])
        w.writeheader()
        w.writerows({"device": device, **r} for r in rows)
    return path


def write_reports(rows: list[dict], copy_gbps: float, device: str, out_dir: Path,
                  peer: str | None = None) -> tuple[Path, Path]:
    """``<device>.csv`` and ``.md``; ``peer`` (gemlite's version) adds its columns to the Markdown."""
    import csv

    out_dir.mkdir(parents=True, exist_ok=True)
    stem = device.replace(" ", "_")
    csv_path, md_path = out_dir / f"{stem}.csv", out_dir / f"{stem}.md"
    with atomic_open(csv_path, newline="") as f:
        w = csv.DictWriter(f, fieldnames=["device", "copy_GBps", *rows[0].keys()])
        w.writeheader()
        for r in rows:
            w.writerow({"device": device, "copy_GBps": round(copy_gbps, 1), **r})
    lines = [f"# NVFP4 kernels vs cuBLAS bf16 — {device}", "",
             f"Device-to-device copy bandwidth: **{copy_gbps:.0f} GB/s**. Times: median of CUDA-graph replays "
             "over rotating weight copies. speed-up = cuBLAS time / ours.", "",
             "reference = the seam's pure-torch path (dequantize, then cuBLAS), i.e. what runs without the kernels.", "",
             "| model | proj | N | K | M | kind | ours µs | cuBLAS µs | speed-up | reference µs | vs reference | GB/s | "
             "% copy BW | TFLOP/s | LoRA-32 overhead | with LoRA-32 vs cuBLAS + LoRA |"
             + (" gemlite µs | gemlite speed-up | gemlite rel. err |" if peer else ""),
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|---|---|" if peer else "")]
    lines[4:4] = ["with LoRA-32 vs cuBLAS + LoRA = the bf16 LoRA projection's time (`F.linear`, `x·Aᵀ`, `addmm`, as the "
                  "rollout engine runs a dense one) / ours with the adapter on the call (M ≤ 64).", ""]
    if peer:
        lines[2:2] = [f"gemlite = `gemlite.helper.A16W4_NVFP` ({peer}) on the same packed weights, forward only, M ≤ "
                      f"{GEMLITE_MAX_M}; speed-up = cuBLAS time / gemlite's; rel. err = ‖y − reference‖ / ‖reference‖ "
                      "(ours: bf16 rounding, ~3e-3); a time marked * could not be captured in a CUDA graph (eager).", ""]
        errors = sorted({r["gemlite_error"] for r in rows if r.get("gemlite_error")})
        if errors:
            failed = sum(1 for r in rows if r.get("gemlite_error"))
            lines[4:4] = [f"gemlite failed on {failed} of {sum(r['kind'] == 'fwd' for r in rows)} forward rows: "
                          + "; ".join(f"`{e}`" for e in errors[:3]), ""]
    for r in rows:
        lo = "" if r["lora32_overhead"] is None else f"{100 * r['lora32_overhead']:.0f}%"
        lo += " | " + ("" if r.get("lora_speedup") is None else f"{r['lora_speedup']:.2f}x")
        gl = ""
        if peer:
            gl = (" failed | | |" if r.get("gemlite_error") else " | | |") if r.get("gemlite_us") is None else (
                f" {r['gemlite_us']:.1f}{'*' if r['gemlite_timing'] == 'eager' else ''} | {r['gemlite_speedup']:.2f}x | "
                f"{r['gemlite_rel_err']:.1e} |")
        lines.append(f"| {r['model']} | {r['proj']} | {r['N']} | {r['K']} | {r['M']} | {r['kind']} | {r['us']:.1f} | "
                     f"{r['cublas_us']:.1f} | {r['speedup']:.2f}x | {r.get('reference_us', float('nan')):.1f} | "
                     f"{r.get('vs_reference', float('nan')):.2f}x | {r['GBps']:.0f} | {100 * r['GBps'] / copy_gbps:.0f}% | "
                     f"{r['TFLOPs']:.1f} | {lo} |" + gl)
    write_text_atomic(md_path, "\n".join(lines) + "\n")
    return csv_path, md_path


def precompile_jobs(models, ms, device) -> list[tuple]:
    """(kind, M, config, lora, K) of every launch the benchmark makes, for
    :func:`qerl.bench.kernels_tune.precompile`."""
    from qerl_kernels import ops

    out = []
    for N, K in dict.fromkeys(nk for m in models for nk in projections(m).values()):
        for M in ms:
            for kind in ("fwd", "bwd"):
                cfg = ops.config_for(kind, M, N, K, device)
                eager = cfg.pop("EAGER", None)  # both launch modes' kernels
                for c in (cfg, eager) if eager else (cfg,):
                    out.append((kind, M, c, int(kind == "fwd" and M <= 64), K))
    return out


def run(out_dir: Path, models=("7B", "14B", "32B"), ms=MS, tune: bool = False, progress: bool = True,
        workers: int = 0, gemlite: bool | None = None) -> dict:
    """Benchmark (and with ``tune`` first search) every projection at every M; the kernels' configs are
    those of ``launch_mode("graph")`` (the times are CUDA-graph replays)."""
    if not torch.cuda.is_available():
        raise ValueError("qerl bench kernels needs a CUDA GPU; none is visible here")
    from qerl_kernels import ops

    with ops.launch_mode("graph"):  # every time below is a CUDA-graph replay: the configs tuned for that
        return _run(out_dir, models, ms, tune, progress, workers, gemlite)


def _run(out_dir: Path, models, ms, tune: bool, progress: bool, workers: int, gemlite: bool | None) -> dict:
    from qerl.bench import gemlite_peer

    from tqdm.auto import tqdm

    device = torch.cuda.get_device_name()
    if tune:
        from qerl.bench.kernels_tune import tune_all

        tune_all([s for m in models for s in projections(m).values()], ms, progress=progress, workers=workers)
    if workers > 1:  # compile every kernel the benchmark launches in parallel first (minutes -> seconds)
        from qerl.bench.kernels_tune import precompile

        precompile(precompile_jobs(models, ms, torch.device("cuda")), workers, progress)
    if gemlite is None:
        gemlite = gemlite_peer.available()
    elif gemlite and not gemlite_peer.available():
        raise ValueError("--gemlite: the gemlite package is not importable here (pip install gemlite)")
    bw = copy_bandwidth()
    rows = []
    jobs = [(m, p, nk) for m in models for p, nk in projections(m).items()]
    dq = []
    for m, p, (N, K) in tqdm(jobs, desc="bench", disable=not progress):
        rows += bench_shape(m, p, N, K, ms, gemlite=gemlite)
        dq.append(bench_dequant(m, p, N, K, bw))
    peer = f"gemlite {gemlite_peer.version()}" if gemlite else None
    csv_path, md_path = write_reports(rows, bw, device, out_dir, peer)
    dq_path = _write_csv(dq, device, out_dir / f"{device.replace(' ', '_')}_dequant.csv")
    res = {"device": device, "copy_GBps": bw, "csv": str(csv_path), "md": str(md_path), "rows": len(rows),
           "dequant_csv": str(dq_path), "dequant_min_pct_copy_bw": min(r["pct_copy_bw"] for r in dq), "peer": peer}
    try:
        from qerl.bench.kernels_plot import plot

        res["png"] = str(plot(csv_path))
    except ImportError:  # a GPU box without matplotlib: regenerate later with --plot CSV
        res["png"] = None
    return res


def build_parser():
    import argparse

    from qerl.argtypes import HelpFormatter

    p = argparse.ArgumentParser(prog="qerl bench kernels", description=__doc__.splitlines()[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--output", default="reports/kernels", help="directory for <device>.csv / .md")
    p.add_argument("--models", nargs="*", default=list(MODELS), type=model_arg, metavar="MODEL",
                   help="whose projection shapes are timed: " + MODELS_HELP)
    p.add_argument("--ms", nargs="*", type=int, default=list(MS), help="token counts M")
    p.add_argument("--tune", action="store_true", help="search tile configs first (writes qerl_kernels/tuned/<device>.json)")
    p.add_argument("--workers", type=int, default=0,
                   help="compile the kernels in this many processes first (0/1: compile while measuring)")
    p.add_argument("--gemlite", dest="gemlite", action="store_true", default=None,
                   help="time gemlite's A16W4_NVFP beside ours (default: when gemlite is importable)")
    p.add_argument("--no-gemlite", dest="gemlite", action="store_false", help="leave the gemlite columns out")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--untuned", choices=["transfer", "heuristic"], default="transfer",
                   help="configs of shapes without tuned entries: borrowed from the nearest tuned shape (the default, "
                        "qerl_kernels.ops.transferred_entry) or the heuristic (the comparison); the CSV's "
                        "config_source column says which each row ran")
    p.add_argument("--plot", metavar="CSV", default=None,
                   help="only draw the figure of an existing benchmark CSV (no GPU needed) and exit")
    p.add_argument("--targets", metavar="CSV", default=None,
                   help="only print issue 5's targets for an existing benchmark CSV (no GPU needed) and exit")
    p.add_argument("--against", metavar="OLD_CSV", default=None,
                   help="with --targets: per-M change against an older run of the same shapes")
    p.add_argument("--json", action="store_true", help="with --targets: JSON instead of Markdown")
    return p


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    if a.targets:
        from qerl.bench import kernels_targets as bt

        rows, copy_gbps, device = bt.read_csv(Path(a.targets))
        t = bt.targets(rows, copy_gbps)
        cmp = bt.compare(rows, bt.read_csv(Path(a.against))[0]) if a.against else None
        print(json.dumps({"device": device, "copy_GBps": copy_gbps, **t, "against": cmp}, default=str) if a.json
              else bt.markdown(t, device, copy_gbps, cmp), end="" if not a.json else "\n")
        return 0
    if a.plot:
        from qerl.bench.kernels_plot import plot

        print(json.dumps({"png": str(plot(Path(a.plot)))}))
        return 0
    from qerl_kernels import ops

    ops.TRANSFER = a.untuned == "transfer"
    res = run(Path(a.output), models=tuple(a.models), ms=tuple(a.ms), tune=a.tune, progress=not a.no_progress,
              workers=a.workers, gemlite=a.gemlite)
    print(json.dumps(res))
    return 0


if __name__ == "__main__":  # python -m qerl.bench.kernels --output DIR [--tune] [--models 7B] [--ms 1 16]
    raise SystemExit(main())
