"""GPU: block shapes of the one-pass dequantization kernel (``qerl_kernels.nvfp4_dequant``) on the
largest and a small projection; prints and writes JSON (argv[1]) with µs and % of copy bandwidth."""
import json
import sys

import torch

from qerl.quant import nvfp4
from qerl.stages.bench_kernels import _graph_time, copy_bandwidth
from qerl_kernels.nvfp4_dequant import dequantize_into


def main(out: str) -> int:
    bw = copy_bandwidth()
    res = {"device": torch.cuda.get_device_name(), "copy_GBps": bw, "rows": []}
    for N, K in ((55296, 5120), (4608, 3584)):
        ws = [nvfp4.quantize(torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02) for _ in range(2)]
        ref = nvfp4.dequantize(*ws[0], torch.bfloat16)
        o = torch.empty(N, K, device="cuda", dtype=torch.bfloat16)
        for br, bg, warps in ((32, 16, 4), (16, 16, 4), (64, 16, 8), (32, 32, 8), (16, 32, 4), (64, 8, 4), (8, 64, 4),
                              (128, 8, 8), (32, 8, 4), (16, 8, 2)):
            def call(p, s, g):
                return dequantize_into(o, p, s.view(torch.uint8), g, BR=br, BG=bg, num_warps=warps)
            call(*ws[0])
            exact = torch.equal(o.view(torch.int16), ref.view(torch.int16))
            t = _graph_time([lambda w=w: call(*w) for w in ws])
            row = {"N": N, "K": K, "BR": br, "BG": bg, "warps": warps, "us": t * 1e6, "exact": exact,
                   "pct_copy_bw": 100 * N * K * 2.5625 / t / 1e9 / bw}
            print(row, flush=True)
            res["rows"].append(row)
    big = [r for r in res["rows"] if r["N"] == 55296 and r["exact"]]
    res["best"] = min(big, key=lambda r: r["us"])
    with open(out, "w") as f:
        json.dump(res, f, indent=1)
    b = res["best"]
    print(f"BEST {b['BR']} {b['BG']} {b['warps']}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
