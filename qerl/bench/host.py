"""Host time of one eager NVFP4 linear call: ``qerl bench host`` (GPU; writes ``<output>/<device>.csv / .md``).

Every path outside the rollout engine's CUDA graphs — prefill, the update's forward and backward, evaluation, anyone's
own loop over qerl's layers — launches its NVFP4 linears one by one from Python, so the host time of a call is paid
per projection and per layer. A call's *host time* here is the time Python spends issuing it: ``n`` calls back to back
issued while the GPU is held busy by one long ``torch.cuda._sleep`` launched first (so no call waits for the GPU,
whatever its own GPU time: ``n`` is kept below the launch queue's depth), divided by ``n``; the median of
``REPEATS`` such runs. A call's *loop time* is what a loop of such calls sees: ``n`` calls back to back and a
synchronisation, per call — the larger of its host time and its GPU time. The same for the cuBLAS calls a bf16 layer makes
(``F.linear``; with LoRA the engine's dense projection: ``F.linear``, ``x·Aᵀ``, ``addmm``).

Rows: projection shape (N, K) x M x call — ``fwd`` (``qerl_kernels.ops.nvfp4_matmul``), ``fwd_lora`` (with a
rank-32 adapter, ``lora_a=``), ``bwd`` (``nvfp4_matmul_t``), ``seam`` (``qerl.ops.nvfp4_linear``, what
``NVFP4Linear.forward`` calls), ``seam_tiled`` (the same on weights in the tile-contiguous layout, ``tiled=True``:
an ``NVFP4Linear`` re-laid at load; shapes with whole tiles), and the cuBLAS counterparts; ``path`` is the kernel route the call takes
(``ops.route_of``). The target (issue 45): at most 40 µs of host time per NVFP4 call at any M.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time
from pathlib import Path

import torch

from qerl.files import write_text_atomic

TARGET_US = 40.0
MS = (1, 8, 16, 64, 128, 512, 2048)


REPEATS = 5
CLOCK_HZ = 2.0e9  # GPU cycles per second assumed when sizing the sleep (H100 / H200 boost clocks are below it)


def host_us(fn, n: int = 100, warm: int = 10, repeats: int = REPEATS) -> float:
    """Microseconds of host time per call of ``fn``: the median over ``repeats`` runs of ``n`` calls issued behind a
    GPU sleep (see module docstring) twice as long as the warm-up calls say ``n`` calls take."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    cycles = int(2 * n * (time.perf_counter() - t0) / warm * CLOCK_HZ)
    runs = []
    for _ in range(repeats):
        torch.cuda._sleep(cycles)
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        runs.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
    return statistics.median(runs) * 1e6 / n


def loop_us(fn, n: int = 100, repeats: int = REPEATS) -> float:
    """Microseconds per call of ``n`` calls of ``fn`` back to back, the synchronisation included (median of
    ``repeats`` runs): what an eager loop pays, host or GPU, whichever is slower."""
    torch.cuda.synchronize()
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        runs.append(time.perf_counter() - t0)
    return statistics.median(runs) * 1e6 / n


def profile_top(fn, n: int = 200, lines: int = 18) -> str:
    """cProfile of ``n`` calls of ``fn``, the functions with the most own time first."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(lines)
    return buf.getvalue()


def bench_shape(model: str, proj: str, N: int, K: int, ms, rank: int = 32, direct: bool = True) -> list[dict]:
    """Rows of one projection shape at each M (see module docstring); ``direct``: with the direct launches of
    :mod:`qerl_kernels.launch` (False: every launch through Triton's own path, the comparison)."""
    from qerl.ops import nvfp4_linear
    from qerl.quant import nvfp4
    from qerl_kernels import launch, ops

    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02
    p, s, g = nvfp4.quantize(w)
    w = nvfp4.dequantize(p, s, g, torch.bfloat16)
    la = torch.randn(rank, K, device="cuda", dtype=torch.bfloat16) * 0.01
    lb = torch.randn(N, rank, device="cuda", dtype=torch.bfloat16) * 0.01
    tp = ts = None
    if hasattr(ops, "tiled_config"):  # (an A/B's baseline kernels may predate it)
        from qerl_kernels import layout

        if layout.tileable(N, K):
            tp, ts = layout.tile(p, s)
    rows = []
    for M in ms:
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
        F = torch.nn.functional
        fwd, bwd = ops.route_of("fwd", x, p, s)[:2], ops.route_of("bwd", dy, p, s)[:2]
        rule = getattr(ops, "lora_inkernel", None)  # (an A/B's baseline kernels may predate it)
        inkernel = rule and rule(dict(fwd[1]), M, N, K, ops.LORA_LAUNCH, True,
                                 torch.cuda.get_device_properties(x.device).multi_processor_count)
        calls = {
            "fwd": (lambda: ops.nvfp4_matmul(x, p, s, g), lambda: F.linear(x, w), fwd),
            "fwd_lora": (lambda: ops.nvfp4_matmul(x, p, s, g, None, None, lb, 2.0, lora_a=la),
                         lambda: torch.addmm(F.linear(x, w), F.linear(x, la), lb.t(), alpha=2.0),
                         ("tile_fwd_xa", inkernel) if inkernel is not None else fwd),
            "bwd": (lambda: ops.nvfp4_matmul_t(dy, p, s, g), lambda: dy @ w, bwd),
            "seam": (lambda: nvfp4_linear(x, p, s, g), lambda: F.linear(x, w), fwd),
        }
        if tp is not None:  # the public op on weights kept in the engine's tile-contiguous layout (NVFP4Linear tiled)
            calls["seam_tiled"] = (lambda: nvfp4_linear(x, tp, ts, g, tiled=True), lambda: F.linear(x, w),
                                   ops.route_of("fwd", x, tp, ts, tiled=True)[:2])
        with torch.no_grad():
            for call, (ours, cublas, (path, cfg)) in calls.items():
                # the direct launches (qerl_kernels.launch) must give Triton's own launches' result, bit for bit
                launch.DIRECT[0] = False
                want = ours()
                launch.DIRECT[0] = direct
                before = launch._STATS["direct"]
                us, ref = host_us(ours), host_us(cublas)
                loop, loop_ref = loop_us(ours), loop_us(cublas)
                got = ours()
                rows.append({"model": model, "proj": proj, "N": N, "K": K, "M": M, "call": call, "path": path,
                             "config": config_str(cfg),
                             "host_us": round(us, 1), "cublas_host_us": round(ref, 1), "loop_us": round(loop, 1),
                             "cublas_loop_us": round(loop_ref, 1), "meets": us <= TARGET_US,
                             "direct_launches": launch._STATS["direct"] - before,
                             "same_result": torch.equal(got, want)})
    return rows


def config_str(cfg) -> str:
    """A resolved config as one CSV field: ``KEY=value`` pairs, sorted, joined by spaces."""
    return " ".join(f"{k}={v}" for k, v in sorted(cfg.items())) if isinstance(cfg, dict) else str(cfg)


def with_comparison(rows: list[dict], triton_rows: list[dict]) -> list[dict]:
    """``rows`` (direct launches on), each with ``triton_host_us``: the same call's host time with every launch
    through Triton's own path (``triton_rows``, a ``--no-direct`` run of the same shapes and Ms)."""
    off = {(r["model"], r["proj"], int(r["M"]), r["call"]): float(r["host_us"]) for r in triton_rows}
    return [{**r, "triton_host_us": off.get((r["model"], r["proj"], int(r["M"]), r["call"]))} for r in rows]


def write(rows: list[dict], out: Path, device: str, profile: str = "") -> Path:
    from qerl.bench.report import device_csv

    stem = device_csv(rows, out, device)
    worst = max(rows, key=lambda r: r["host_us"])
    met = sum(r["meets"] for r in rows)
    lines = [f"# Host time per eager NVFP4 linear call — {device}", "",
             f"`qerl bench host`: µs of Python per call, {len(rows)} rows; target ≤ {TARGET_US:.0f} µs: "
             f"{met} / {len(rows)} meet it; the slowest is {worst['call']} {worst['model']} {worst['proj']} "
             f"M = {worst['M']} ({worst['path']}): {worst['host_us']} µs. Direct launches "
             f"(`qerl_kernels.launch`): {'off' if not any(r.get('direct_launches') for r in rows) else 'on'}; "
             f"results equal to Triton's own launches in {sum(bool(r.get('same_result', True)) for r in rows)} / "
             f"{len(rows)} rows.", "",
             "`Triton path µs`: the same call with every launch through Triton's own `kernel[grid](...)` "
             "(`--no-direct`, measured in the same run); `cuBLAS µs`: what a bf16 layer's calls cost (`F.linear`; "
             "with LoRA the "
             "engine's dense projection, three calls). Host µs: issued while the GPU sleeps (no call waits for it); "
             "loop µs: calls back to back and a synchronisation, per call (host or GPU, whichever is slower); "
             f"medians of {REPEATS} runs of 100 calls.", "",
             "| model | proj | N | K | M | call | path | host µs | Triton path µs | cuBLAS µs | loop µs | "
             "cuBLAS loop µs |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        tri = r.get("triton_host_us")
        lines.append(f"| {r['model']} | {r['proj']} | {r['N']} | {r['K']} | {r['M']} | {r['call']} | {r['path']} | "
                     f"{r['host_us']} | {'' if tri is None else tri} | {r['cublas_host_us']} | "
                     f"{r.get('loop_us', '')} | {r.get('cublas_loop_us', '')} |")
    if profile:
        lines += ["", "## Where the slowest call's host time goes (cProfile, own time first)", "", "```",
                  profile.strip(), "```"]
    path = stem.with_suffix(".md")
    write_text_atomic(path, "\n".join(lines) + "\n")
    return path


def build_parser() -> argparse.ArgumentParser:
    from qerl.argtypes import HelpFormatter
    from qerl.models.shapes import MODELS_HELP, model_arg

    p = argparse.ArgumentParser(prog="qerl bench host", description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--output", default="reports/host", help="directory of the <device>.csv / .md")
    p.add_argument("--models", nargs="+", default=["0.5B", "7B"], type=model_arg, metavar="MODEL", help=MODELS_HELP)
    p.add_argument("--projs", nargs="+", default=["qkv", "down"], choices=["qkv", "o", "gate_up", "down"],
                   help="projections of each model")
    p.add_argument("--ms", nargs="+", type=int, default=list(MS), help="token counts M")
    p.add_argument("--no-profile", action="store_true", help="leave the cProfile of the slowest call out")
    p.add_argument("--no-direct", action="store_true",
                   help="only the run with every launch through Triton's own path (qerl_kernels.launch.DIRECT off)")
    p.add_argument("--no-compare", action="store_true",
                   help="skip the comparison run through Triton's own path (default: both, the comparison first)")
    p.add_argument("--baseline-kernels", type=Path, default=None, metavar="DIR",
                   help="instead, an A/B on this machine against the kernels package in DIR (e.g. `git archive REV "
                        "kernels | tar -x -C DIR`; `self`: a copy of the installed kernels, a null A/B or, with "
                        "--lora-inkernel-flops, that knob's): writes <output>/<device>_ab.csv / .md (qerl.bench.host_ab)")
    p.add_argument("--rounds", type=int, default=2, help="with --baseline-kernels: alternations of the two sides")
    p.add_argument("--lora-inkernel-flops", type=float, default=None, metavar="F",
                   help="qerl_kernels.ops.LORA_INKERNEL_FLOPS for this run: eager LoRA calls (M > 16) of at most F "
                        "FLOPs compute x · lora_aᵀ inside one Triton tile launch (0: off); with --baseline-kernels, the "
                        "current side only (DIR may then be a copy of the current kernels: an A/B of the rule)")
    p.add_argument("--lora-inkernel-decode-weights", type=float, default=None, metavar="W",
                   help="qerl_kernels.ops.LORA_INKERNEL_DECODE_WEIGHTS for this run: eager LoRA calls at M <= 16 on "
                        "weights of at most W elements take the same one launch (0: off); with --baseline-kernels, the "
                        "current side only")
    return p


def main(argv: list[str] | None = None) -> int:
    from qerl.models.shapes import projections

    a = build_parser().parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("qerl bench host: needs a CUDA GPU (host time of kernel launches)")
    if a.lora_inkernel_flops is not None or a.lora_inkernel_decode_weights is not None:
        from qerl_kernels import ops

        if a.lora_inkernel_flops is not None:
            ops.LORA_INKERNEL_FLOPS = a.lora_inkernel_flops
        if a.lora_inkernel_decode_weights is not None:
            ops.LORA_INKERNEL_DECODE_WEIGHTS = a.lora_inkernel_decode_weights
    if a.baseline_kernels is not None:
        from qerl.bench import host_ab

        args = ["--models", *a.models, "--projs", *a.projs, "--ms", *map(str, a.ms)]
        knob = [] if a.lora_inkernel_flops is None else ["--lora-inkernel-flops", str(a.lora_inkernel_flops)]
        if a.lora_inkernel_decode_weights is not None:
            knob += ["--lora-inkernel-decode-weights", str(a.lora_inkernel_decode_weights)]
        print(host_ab.run(args, a.baseline_kernels, a.rounds, Path(a.output), torch.cuda.get_device_name(),
                          current_args=knob))
        return 0
    rows = []
    for model in a.models:
        for proj, (N, K) in projections(model).items():
            if proj in a.projs:
                start = len(rows)
                if a.no_direct or a.no_compare:
                    rows += bench_shape(model, proj, N, K, a.ms, direct=not a.no_direct)
                else:  # Triton's own path first (its compiles warm both), then the direct launches
                    off = bench_shape(model, proj, N, K, a.ms, direct=False)
                    rows += with_comparison(bench_shape(model, proj, N, K, a.ms, direct=True), off)
                done = ", ".join(f"{r['call']}@{r['M']} {r['host_us']}" for r in rows[start:])
                print(f"{model} {proj}: {done}", flush=True)
    profile = ""
    if not a.no_profile:
        from qerl.quant import nvfp4
        from qerl_kernels import ops

        worst = max((r for r in rows if not r["call"].startswith("seam")), key=lambda r: r["host_us"])
        p, s, g = nvfp4.quantize(torch.randn(worst["N"], worst["K"], device="cuda", dtype=torch.bfloat16) * 0.02)
        x = torch.randn(worst["M"], worst["K"] if worst["call"] != "bwd" else worst["N"], device="cuda",
                        dtype=torch.bfloat16)
        la = torch.randn(32, worst["K"], device="cuda", dtype=torch.bfloat16) * 0.01
        lb = torch.randn(worst["N"], 32, device="cuda", dtype=torch.bfloat16) * 0.01
        fn = {"fwd": lambda: ops.nvfp4_matmul(x, p, s, g), "bwd": lambda: ops.nvfp4_matmul_t(x, p, s, g),
              "fwd_lora": lambda: ops.nvfp4_matmul(x, p, s, g, None, None, lb, 2.0, lora_a=la)}[worst["call"]]
        with torch.no_grad():
            fn()
            profile = f"{worst['call']} {worst['model']} {worst['proj']} M = {worst['M']}\n" + profile_top(fn)
    print(write(rows, Path(a.output), torch.cuda.get_device_name(), profile))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
