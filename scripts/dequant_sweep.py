"""GPU: tile sweep of the dequantization kernel (``qerl_kernels.nvfp4_dequant``, the first half of the
large-M ``DQ`` path) on the Qwen2.5 projection shapes: rows x scale groups per program (BR x BG) and
warps, each checked bit for bit against the default tile and timed in CUDA-graph replays; % of the
device-to-device copy bandwidth (0.5625 B read + 2 B written per weight).

``python scripts/dequant_sweep.py OUT.json [workers]`` (kernels compiled in ``workers`` processes first).
"""
import itertools
import json
import multiprocessing as mp
import statistics
import sys

import torch

from qerl.quant import nvfp4
from qerl.stages.bench_kernels import _graph_time, copy_bandwidth, projections
from qerl_kernels.nvfp4_dequant import dequantize_into

TILES = [(br, bg, w) for br, bg, w in itertools.product((4, 8, 16, 32), (16, 32, 64, 128), (2, 4, 8))
         if 256 <= br * bg * 16 <= 32768]


def _compile(tile):
    br, bg, w = tile
    p, s, g = nvfp4.quantize(torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16))
    dequantize_into(torch.empty(64, 4096, device="cuda", dtype=torch.bfloat16), p, s.view(torch.uint8), g,
                    BR=br, BG=bg, num_warps=w)
    torch.cuda.synchronize()
    return tile


def main(out: str, workers: int = 14) -> int:
    with mp.get_context("spawn").Pool(workers) as pool:
        pool.map(_compile, TILES)
    bw = copy_bandwidth()
    res = {"device": torch.cuda.get_device_name(), "copy_GBps": bw, "rows": []}
    shapes = list(dict.fromkeys(nk for m in ("7B", "14B", "32B") for nk in projections(m).values()))
    for N, K in shapes:
        ws = [nvfp4.quantize(torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02) for _ in range(2)]
        outs = [torch.empty(N, K, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
        want = dequantize_into(torch.empty(N, K, device="cuda", dtype=torch.bfloat16), ws[0][0],
                               ws[0][1].view(torch.uint8), ws[0][2])
        nbytes = N * K * (0.5 + 1 / 16 + 2)
        for br, bg, w in TILES:
            got = dequantize_into(outs[0], ws[0][0], ws[0][1].view(torch.uint8), ws[0][2], BR=br, BG=bg, num_warps=w)
            exact = bool(torch.equal(got.view(torch.int16), want.view(torch.int16)))
            t = _graph_time([lambda o=o, p=p, s=s, g=g: dequantize_into(o, p, s.view(torch.uint8), g, BR=br, BG=bg,
                                                                        num_warps=w)
                             for o, (p, s, g) in zip(outs, ws)], reps=9)
            res["rows"].append({"N": N, "K": K, "BR": br, "BG": bg, "warps": w, "us": t * 1e6, "exact": exact,
                                "pct_copy_bw": 100 * nbytes / t / 1e9 / bw})
        rows = [r for r in res["rows"] if (r["N"], r["K"]) == (N, K)]
        best = max(rows, key=lambda r: r["pct_copy_bw"])
        dflt = next(r for r in rows if (r["BR"], r["BG"], r["warps"]) == (8, 64, 4))
        print(f"{N}x{K}: default {dflt['pct_copy_bw']:.1f}%, best {best['pct_copy_bw']:.1f}% "
              f"BR {best['BR']} BG {best['BG']} w {best['warps']}; inexact {sum(not r['exact'] for r in rows)}",
              flush=True)
        del ws, outs, want
    by_tile = {}
    for r in res["rows"]:
        by_tile.setdefault((r["BR"], r["BG"], r["warps"]), []).append(r["pct_copy_bw"])
    res["median_by_tile"] = sorted(([*k, statistics.median(v), min(v)] for k, v in by_tile.items()),
                                   key=lambda x: -x[3])
    print("best tiles (BR, BG, warps, median %, min %):", res["median_by_tile"][:5], flush=True)
    with open(out, "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 14))
