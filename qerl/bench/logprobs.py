"""The trainer's per-token log-probs: ``qerl bench logprobs`` (GPU; writes ``<output>/<device>.csv / .md``).

Times :func:`qerl.ops.logits.token_logprobs` — log-probs and entropies of the sampled tokens from the final hidden
states through the lm_head, in blocks of ~1,024 tokens, forward and backward — with the fused blocks
(:mod:`qerl_kernels.token_logprob`, the default on CUDA) and with torch's composite (``qerl.ops.logits.FUSED[0] =
False``), on the same inputs in one process, and checks that they agree: the largest log-prob and entropy
differences and the relative difference of the hidden states' gradient. Times are medians of ``--reps`` runs
(CUDA-synchronised wall clock); ``peak_gb`` is the peak allocated during one forward + backward.
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from qerl.files import write_text_atomic

VOCAB = 151_936  # Qwen2.5


def bench(tokens: int, hidden: int, vocab: int = VOCAB, rows: int = 64, reps: int = 5, seed: int = 0) -> list[dict]:
    """One row per path (fused, composite) for ``tokens`` positions in ``rows`` sequences (see module docstring)."""
    from qerl.ops import logits as L

    g = torch.Generator(device="cuda").manual_seed(seed)
    T = max(1, tokens // rows)
    h = (torch.randn(rows, T, hidden, device="cuda", generator=g) * 0.3).bfloat16().requires_grad_()
    w = (torch.randn(vocab, hidden, device="cuda", generator=g) * 0.05).bfloat16()
    t = torch.randint(0, vocab, (rows, T), device="cuda", generator=g)
    coef = torch.randn(rows, T, device="cuda", generator=g)
    out, res = [], {}
    prev = L.FUSED[0]
    try:
        for fused in (True, False):
            L.FUSED[0] = fused
            fwd, bwd = [], []
            for i in range(reps + 1):
                torch.cuda.synchronize()
                if i == reps:
                    torch.cuda.reset_peak_memory_stats()
                t0 = time.perf_counter()
                lp, ent = L.token_logprobs(h, w, t, 1.0, None, with_entropy=True)
                torch.cuda.synchronize()
                t1 = time.perf_counter()
                (gh,) = torch.autograd.grad((lp * coef).sum(), (h,))
                torch.cuda.synchronize()
                if i:  # the first run compiles / warms up
                    fwd.append(t1 - t0), bwd.append(time.perf_counter() - t1)
            res[fused] = (lp.detach(), ent, gh)
            out.append({"tokens": rows * T, "vocab": vocab, "hidden": hidden,
                        "path": "fused" if fused else "composite", "forward_ms": round(statistics.median(fwd) * 1e3, 2),
                        "backward_ms": round(statistics.median(bwd) * 1e3, 2),
                        "peak_gb": round(torch.cuda.max_memory_allocated() / 2**30, 2)})
    finally:
        L.FUSED[0] = prev
    (a, ea, ga), (r, er, gr) = res[True], res[False]
    diff = {"max_lp_diff": float((a - r).abs().max()), "max_entropy_diff": float((ea - er).abs().max()),
            "grad_rel_diff": float((ga.float() - gr.float()).norm() / gr.float().norm())}
    return [{**row, **diff} for row in out]


def write(rows: list[dict], out: Path, device: str) -> Path:
    """``<device>.csv`` and ``.md`` (the table and the fused / composite speed-ups) under ``out``."""
    from qerl.bench.report import device_csv

    stem = device_csv(rows, out, device)
    lines = [f"# Per-token log-probs of the update — {device}", "",
             "`qerl bench logprobs`: `qerl.ops.logits.token_logprobs` (log-probs + entropies, then the hidden "
             "states' gradient), fused blocks vs torch's composite, the same inputs; medians.", "",
             "| tokens | vocab | hidden | path | forward ms | backward ms | peak GB | max lp diff | max entropy diff "
             "| grad rel diff |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['tokens']} | {r['vocab']} | {r['hidden']} | {r['path']} | {r['forward_ms']} | "
                     f"{r['backward_ms']} | {r['peak_gb']} | {r['max_lp_diff']:.1e} | {r['max_entropy_diff']:.1e} | "
                     f"{r['grad_rel_diff']:.1e} |")
    pairs = {}
    for r in rows:
        pairs.setdefault((r["tokens"], r["vocab"], r["hidden"]), {})[r["path"]] = r
    lines += ["", "| tokens | hidden | forward speed-up | backward speed-up |", "|---|---|---|---|"]
    for (tok, _, hid), p in pairs.items():
        if {"fused", "composite"} <= set(p):
            f, c = p["fused"], p["composite"]
            lines.append(f"| {tok} | {hid} | {c['forward_ms'] / f['forward_ms']:.2f}x | "
                         f"{c['backward_ms'] / f['backward_ms']:.2f}x |")
    path = stem.with_suffix(".md")
    write_text_atomic(path, "\n".join(lines) + "\n")
    return path


def build_parser() -> argparse.ArgumentParser:
    from qerl.argtypes import HelpFormatter

    p = argparse.ArgumentParser(prog="qerl bench logprobs", description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--output", default="reports/logprobs", help="directory of the <device>.csv / .md")
    p.add_argument("--tokens", nargs="+", type=int, default=[1024, 14080], help="positions per update")
    p.add_argument("--hidden", nargs="+", type=int, default=[896, 3584], help="hidden sizes (0.5B: 896, 7B: 3584)")
    p.add_argument("--vocab", type=int, default=VOCAB, help="vocabulary size")
    p.add_argument("--reps", type=int, default=5, help="timed runs per path (after one warm-up)")
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("qerl bench logprobs: needs a CUDA GPU")
    rows = []
    for hidden in a.hidden:
        for tokens in a.tokens:
            rows += bench(tokens, hidden, a.vocab, reps=a.reps)
            print(rows[-2], rows[-1], sep="\n", flush=True)
    print(write(rows, Path(a.output), torch.cuda.get_device_name()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
