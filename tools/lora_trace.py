"""GPU: a timeline of one fused-LoRA decode launch (``qerl_kernels.nvfp4_mmv`` with ``TRACE=True``).

Every program of the launch writes ``%globaltimer`` stamps (ns) and its SM: tiles at start, main loop
done and outputs stored (the gap between the last two includes the wait for the producers' ready
flag); producers at start, MMAs done, ticket back and — the last one — flag raised. The same tile
config is traced with a precomputed ``xa`` (no producers) and without LoRA, so the summary shows
where the fused launch's extra time goes: when ``xa`` is ready vs when the first tiles finish their
loops, how long tiles wait, and how the span changes.

Also the PDL launch pair (``qerl_kernels.lora_xa`` then the decode kernel, released at the primary's
start or after its loads): there only the decode kernel is traced (its start stamps show the overlap).

``python tools/lora_trace.py OUT.json`` (``LORA_TRACE_MS=1,16``, ``LORA_TRACE_REPS=5``); CUDA only.
"""
import json
import os
import statistics
import sys

import torch
import triton

from qerl.quant import nvfp4
from qerl_kernels import ops
from qerl_kernels.nvfp4_mmv import _nvfp4_mmv_kernel

SHAPES = [(55296, 5120), (37888, 3584), (3584, 3584), (5120, 5120), (27648, 5120), (3584, 18944)]
R = 32


def _launch(x2, packed, s8, gs, lb, la, xa, cfg, trace: bool, pdl: int = 0):
    """ops._launch's MMV branch (same grid and arguments) with TRACE and room for the stamps; ``pdl``
    (with ``xa`` None): ``xa`` from qerl_kernels.lora_xa first (releasing the launch at its start: 1,
    after its loads: 2), the decode kernel waiting for it in its epilogue."""
    M, K = x2.shape
    N = packed.shape[0]
    cfg = dict(cfg)
    split, BM, BN, rb = cfg["SPLIT"], cfg["BM"], cfg["BN"], int(cfg.get("RB", 1))
    warps = BN // (16 * rb)
    xp = min(ops.XA_PRODUCERS[1], max(ops.XA_PRODUCERS[0], -(-K // 256))) if la is not None and not pdl else 0
    grid = (triton.cdiv(N, BN) + xp, triton.cdiv(M, BM), split)
    if cfg.get("XPAD") and M > 1 and x2.stride(0) * 2 % 128 == 0:
        padded = torch.empty(M, K + 8, device=x2.device, dtype=x2.dtype)
        padded[:, :K].copy_(x2)
        x2 = padded[:, :K]
    progs = grid[0] * grid[1] * grid[2]
    xap = torch.zeros(xp * 16 * R + 2 * 8 * progs, device=x2.device, dtype=torch.float32)
    xa_buf = torch.empty(16, R, device=x2.device, dtype=x2.dtype) if la is not None else xa
    out = torch.empty(M, N, device=x2.device, dtype=x2.dtype)
    part = torch.empty(split * M * N if split > 1 else 1, device=x2.device, dtype=torch.float32)
    locks = ops._locks(x2.device)
    if pdl:
        from qerl_kernels.lora_xa import _lora_xa_kernel

        nxp = min(64, -(-K // 128))
        xap2 = torch.empty(nxp * 16 * R, device=x2.device, dtype=torch.float32)
        a_stamps = torch.zeros(nxp, 8, device=x2.device, dtype=torch.int64)
        _lora_xa_kernel[(nxp,)](x2, la, xa_buf, xap2, locks[ops._LOCK_SLOTS - 4:], a_stamps, M, K, x2.stride(0), nxp,
                               R=R, KB=128, QB=16, PDL=pdl, TRACE=trace, num_warps=4, num_stages=1)
        la = None
    else:
        a_stamps = None
    lbuf = xa_buf if xa_buf is not None else x2
    _nvfp4_mmv_kernel[grid](
        x2, packed, s8, gs, out, x2, lbuf, lb if lb is not None else x2, part, locks, la if la is not None else x2,
        xap, locks[ops._LOCK_SLOTS - 4:], M, N, K, x2.stride(0), out.stride(0), packed.stride(0), s8.stride(0),
        2.0, split, HAS_BIAS=False, R=R if lb is not None else 0, USE_SPLIT=split > 1, EVEN_K=K % 128 == 0,
        WARPS=warps, NB=BM // 8, PREFETCH=cfg.get("num_stages", 1), XPRE=cfg.get("XPRE", 1), L2=cfg.get("L2", 0),
        PFD=cfg.get("PFD", 0), FUSED=xp > 0, UNROLL=bool(cfg.get("UNROLL", 0)), XP=xp, RB=rb, TRACE=trace,
        PDL=bool(pdl), num_warps=warps, num_stages=1, launch_pdl=bool(pdl))
    base = xp * 16 * R
    stamps = xap[base:].view(torch.int64).view(progs, 8) if trace else None
    return out, stamps, a_stamps, xp, grid


def _summary(stamps, a_stamps, xp, grid):
    s = stamps.cpu().tolist()
    a = a_stamps.cpu().tolist() if a_stamps is not None else []
    n0 = grid[0]
    t0 = min(r[0] for r in s + a)
    prod = [r for i, r in enumerate(s) if i % n0 < xp and (i // n0) == 0]
    tiles = [r for i, r in enumerate(s) if i % n0 >= xp]
    us = lambda v: (v - t0) / 1000.0  # noqa: E731
    loop_end = sorted(us(r[2]) for r in tiles)
    out = {"programs": len(s), "sms": len({r[1] for r in s}), "span_us": us(max(r[4] for r in tiles)),
           "tile_start_last_us": max(us(r[0]) for r in tiles), "tile_loop_end_first_us": loop_end[0],
           "tile_loop_end_median_us": statistics.median(loop_end), "tile_loop_end_last_us": loop_end[-1],
           "tile_epilogue_median_us": statistics.median(us(r[4]) - us(r[2]) for r in tiles),
           "tile_epilogue_max_us": max(us(r[4]) - us(r[2]) for r in tiles)}
    if a:  # the PDL primary (lora_xa): when its programs ran relative to the decode kernel's
        out.update(tile_start_first_us=min(us(r[0]) for r in tiles), xa_start_last_us=max(us(r[0]) for r in a),
                   xa_loads_last_us=max(us(r[2]) for r in a), xa_ticket_last_us=max(us(r[3]) for r in a),
                   xa_done_us=max(us(max(r[3], r[4])) for r in a))
        out["tiles_done_before_xa"] = sum(1 for v in loop_end if v < out["xa_done_us"])
    if prod:
        flag = [us(r[4]) for r in prod if r[4] > 0]
        out.update(producer_start_last_us=max(us(r[0]) for r in prod), producer_mma_last_us=max(us(r[2]) for r in prod),
                   producer_ticket_last_us=max(us(r[3]) for r in prod), flag_us=flag[0] if flag else None,
                   tiles_done_before_flag=sum(1 for v in loop_end if flag and v < flag[0]))
    return out


def main(path: str) -> None:
    dev = torch.device("cuda")
    ms = [int(v) for v in os.environ.get("LORA_TRACE_MS", "1,16").split(",")]
    reps = int(os.environ.get("LORA_TRACE_REPS", "5"))
    rows = []
    for N, K in SHAPES:
        g = torch.Generator(device=dev).manual_seed(0)
        packed, scale, gs = nvfp4.quantize(torch.randn(N, K, device=dev, generator=g) * 0.02)
        s8 = scale.view(torch.uint8)
        la = torch.randn(R, K, device=dev, generator=g).bfloat16() * 0.02
        lb = torch.randn(N, R, device=dev, generator=g).bfloat16() * 0.02
        for M in ms:
            x2 = torch.randn(M, K, device=dev, generator=g).bfloat16()
            cfg = ops._resolved_config("fwd", M, N, K, x2, packed, scale, False)
            if not cfg.get("MMV"):
                continue
            xa = x2 @ la.T
            want = x2.float() @ nvfp4.dequantize(packed, scale, gs, torch.float32).T + 2.0 * (xa.float() @ lb.float().T)
            row = {"N": N, "K": K, "M": M, "config": cfg}
            for name, args, pdl in (("base", (None, None, None), 0), ("with_xa", (lb, None, xa), 0),
                                    ("fused", (lb, la, None), 0), ("pdl_start", (lb, la, None), 1),
                                    ("pdl_loaded", (lb, la, None), 2)):
                for mode in ("eager", "graph"):
                    sums = []
                    if mode == "eager":
                        for rep in range(reps + 2):
                            out, st, ast, xp, grid = _launch(x2, packed, s8, gs, *args, cfg, True, pdl)
                            torch.cuda.synchronize()
                            if rep >= 2:
                                sums.append(_summary(st, ast, xp, grid))
                    else:  # replayed from a CUDA graph, as the benchmark times it (are PDL edges kept?)
                        graph = torch.cuda.CUDAGraph()
                        with torch.cuda.graph(graph):
                            out, st, ast, xp, grid = _launch(x2, packed, s8, gs, *args, cfg, True, pdl)
                        for rep in range(reps + 2):
                            graph.replay()
                            torch.cuda.synchronize()
                            if rep >= 2:
                                sums.append(_summary(st, ast, xp, grid))
                    if name != "base":
                        row[f"{name}_{mode}_rel_err"] = float((out.float() - want).norm() / want.norm())
                    med = {k: statistics.median(d[k] for d in sums) for k in sums[0] if sums[0][k] is not None}
                    row[f"{name}_{mode}"] = med
                    print(N, K, M, name, mode, {k: round(v, 2) for k, v in med.items()}, flush=True)
            rows.append(row)
            with open(path, "w") as f:
                json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
