"""Tile-contiguous against row-major NVFP4 weights: ``qerl bench layout`` (GPU; writes ``<output>/<device>.csv / .md``).

For each projection of the chosen Qwen2.5 shapes and each token count M, the same forward call is timed twice in
one process, beside cuBLAS:
- on row-major weights, through the config the tables route;
- on tiled copies of the same weights (:func:`qerl_kernels.layout.tile`; ``nvfp4_linear(..., tiled=True)``,
  routed by :func:`qerl_kernels.ops.tiled_config`).

Both go through the public op (:func:`qerl.ops.nvfp4_linear`, no autograd: what a module's forward calls) and run
as CUDA-graph replays over rotating copies of the weights (so none stays in L2), interleaved with cuBLAS on the bf16
weights (``F.linear``). The report gives the path of each call and whether the tiled call kept the row-major config;
where it did, the two outputs must be bit-equal. It also gives their relative difference, the speed-up of tiled over
row-major and each one's speed-up over cuBLAS, with the per-M medians against issue 66's goals (tiled ≥ 1.6x cuBLAS
at M = 64, ≥ 1.25x at M = 128). Reports: reports/layout/README.md.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from qerl.files import write_text_atomic

MS = (1, 8, 16, 64, 128, 256)
GOALS = {64: 1.6, 128: 1.25}  # issue 66: the public op on tiled weights against cuBLAS bf16 (CUDA graphs)


def bench_shape(model: str, proj: str, N: int, K: int, ms, reps: int = 11, device: str = "cuda",
                timer=None) -> list[dict]:
    """One row per M for the projection ``proj`` (``[N, K]``) of ``model`` (see module docstring). ``timer``:
    ``(named closures, reps) -> {name: seconds}``, :func:`qerl.bench.timing.graph_times` by default (the tests
    pass a stand-in and run the calls on the CPU under the interpreter)."""
    import torch.nn.functional as F

    from qerl.bench.timing import graph_times
    from qerl.ops import nvfp4_linear
    from qerl.quant import nvfp4
    from qerl_kernels import layout, ops

    timer = timer or graph_times
    copies = max(2, min(8, (256 * 2 ** 20) // (N * K // 2) + 1))  # rotate past the L2
    dense = [torch.randn(N, K, device=device, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    rows_w = [nvfp4.quantize(w) for w in dense]
    tiled_w = [(*layout.tile(p, s), g) for p, s, g in rows_w]
    out = []
    with ops.launch_mode("graph"), torch.no_grad():
        for M in ms:
            x = torch.randn(M, K, device=device, dtype=torch.bfloat16)
            path_r, cfg_r, _ = ops.route_of("fwd", x, *rows_w[0][:2])
            path_t, cfg_t, _ = ops.route_of("fwd", x, *tiled_w[0][:2], tiled=True)
            y_r = nvfp4_linear(x, *rows_w[0])
            y_t = nvfp4_linear(x, *tiled_w[0], tiled=True)
            t = timer({"rows": [lambda w=w: nvfp4_linear(x, *w) for w in rows_w],
                       "tiled": [lambda w=w: nvfp4_linear(x, *w, tiled=True) for w in tiled_w],
                       "cublas": [lambda w=w: F.linear(x, w) for w in dense]}, reps=reps)
            same = cfg_r == cfg_t
            out.append({"model": model, "proj": proj, "N": N, "K": K, "M": M, "path_rows": path_r,
                        "path_tiled": path_t, "same_config": same, "rows_us": round(t["rows"] * 1e6, 2),
                        "tiled_us": round(t["tiled"] * 1e6, 2), "cublas_us": round(t["cublas"] * 1e6, 2),
                        "speedup": round(t["rows"] / t["tiled"], 3),
                        "rows_x_cublas": round(t["cublas"] / t["rows"], 3),
                        "tiled_x_cublas": round(t["cublas"] / t["tiled"], 3),
                        "equal": bool(torch.equal(y_r, y_t)),
                        "rel_diff": float((y_t.float() - y_r.float()).norm() / y_r.float().norm()),
                        "config_tiled": json.dumps(cfg_t, sort_keys=True)})
    return out


def medians(rows: list[dict]) -> list[dict]:
    """Per M: the median speed-ups over cuBLAS of the row-major and the tiled call and of tiled over row-major,
    with the goal at that M (``GOALS``) and whether the tiled median meets it."""
    import statistics

    out = []
    for M in sorted({r["M"] for r in rows}):
        at = [r for r in rows if r["M"] == M]
        tiled = statistics.median(r["tiled_x_cublas"] for r in at)
        goal = GOALS.get(M)
        out.append({"M": M, "rows": len(at), "rows_x_cublas": round(statistics.median(r["rows_x_cublas"] for r in at), 2),
                    "tiled_x_cublas": round(tiled, 2), "tiled_x_rows": round(statistics.median(r["speedup"] for r in at), 2),
                    "goal": goal, "met": None if goal is None else tiled >= goal})
    return out


def write(rows: list[dict], out: Path, device: str) -> Path:
    """``<device>.csv`` and ``.md`` under ``out``; raises when a call that kept its config is not bit-equal."""
    from qerl.bench.report import device_csv

    bad = [r for r in rows if r["same_config"] and not r["equal"]]
    stem = device_csv(rows, out, device)
    lines = [f"# Tile-contiguous against row-major NVFP4 weights — {device}", "",
             "`qerl bench layout`: one forward call per row through the public op (`qerl.ops.nvfp4_linear`, no "
             "autograd) on row-major weights (the routed config) and on tiled copies (`qerl_kernels.layout`; "
             "`ops.tiled_config`), and cuBLAS (`F.linear`) on the bf16 weights, CUDA-graph replays over rotating "
             "weights, interleaved, medians; `same config`: the tiled call kept the row-major config (then the "
             "outputs are bit-equal).", "",
             "## Medians per M (speed-up over cuBLAS bf16)", "",
             "| M | rows | row-major x cuBLAS | tiled x cuBLAS | tiled x row-major | goal (tiled) | met |",
             "|---|---|---|---|---|---|---|"]
    for m in medians(rows):
        goal = "" if m["goal"] is None else f"≥ {m['goal']}x"
        met = "" if m["met"] is None else ("yes" if m["met"] else "no")
        lines.append(f"| {m['M']} | {m['rows']} | {m['rows_x_cublas']:.2f}x | {m['tiled_x_cublas']:.2f}x | "
                     f"{m['tiled_x_rows']:.2f}x | {goal} | {met} |")
    lines += ["", "## Every call", "",
              "| model | proj | N | K | M | path rows / tiled | same config | rows µs | tiled µs | cuBLAS µs | "
              "tiled x rows | rows x cuBLAS | tiled x cuBLAS | equal | rel diff |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['proj']} | {r['N']} | {r['K']} | {r['M']} | {r['path_rows']} / "
                     f"{r['path_tiled']} | {'yes' if r['same_config'] else 'no'} | {r['rows_us']} | {r['tiled_us']} | "
                     f"{r['cublas_us']} | {r['speedup']:.2f}x | {r['rows_x_cublas']:.2f}x | {r['tiled_x_cublas']:.2f}x "
                     f"| {'yes' if r['equal'] else 'no'} | {r['rel_diff']:.1e} |")
    path = stem.with_suffix(".md")
    write_text_atomic(path, "\n".join(lines) + "\n")
    if bad:
        raise AssertionError(f"qerl bench layout: {len(bad)} call(s) kept their config but differ: "
                             + ", ".join(f"{r['model']} {r['proj']} M={r['M']}" for r in bad))
    return path


def build_parser() -> argparse.ArgumentParser:
    from qerl.argtypes import HelpFormatter
    from qerl.models.shapes import MODELS_HELP, model_arg

    p = argparse.ArgumentParser(prog="qerl bench layout", description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--output", default="reports/layout", help="directory of the <device>.csv / .md")
    p.add_argument("--models", nargs="+", default=["7B", "14B", "32B"], type=model_arg, metavar="MODEL",
                   help=MODELS_HELP)
    p.add_argument("--projs", nargs="+", default=["qkv", "o", "gate_up", "down"],
                   choices=["qkv", "o", "gate_up", "down"], help="projections")
    p.add_argument("--ms", nargs="+", type=int, default=list(MS), help="token counts M")
    p.add_argument("--reps", type=int, default=11, help="interleaved graph replays per path")
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("qerl bench layout: needs a CUDA GPU")
    from qerl.models.shapes import projections

    rows = []
    for model in a.models:
        for proj, (N, K) in projections(model).items():
            if proj in a.projs:
                rows += bench_shape(model, proj, N, K, a.ms, a.reps)
                for r in rows[-len(a.ms):]:
                    print(json.dumps(r), flush=True)
    print(write(rows, Path(a.output), torch.cuda.get_device_name()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
