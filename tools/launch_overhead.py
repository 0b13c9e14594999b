"""GPU: host-side cost of one NVFP4 linear call in eager mode (the rollout engine runs eagerly), where
it goes (cProfile), and the same for cuBLAS ``F.linear``: a decode step of a 7B model makes ~200 of
these calls, so microseconds of Python per call are milliseconds per token. M = 16 runs in both launch modes
(``ops.launch_mode``): the eager config (one launch) against the graph-tuned one (WGMMA: pre-pass + kernel,
+ the PDL primary with LoRA) called eagerly.

``python tools/launch_overhead.py OUT.json``
"""
import cProfile
import io
import json
import pstats
import sys
import time

import torch

from qerl.ops import nvfp4_linear
from qerl.quant import nvfp4
from qerl_kernels import ops


def _host_us(fn, iters=500) -> float:
    """Wall time per call with the GPU far ahead of nothing: synchronise, then time ``iters`` calls
    and synchronise again (for tiny kernels this is the host cost)."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1e6 / iters


def main(out: str) -> int:
    N, K = 4608, 3584
    p, s, g = nvfp4.quantize(torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02)
    w = nvfp4.dequantize(p, s, g, torch.bfloat16)
    la = torch.randn(32, K, device="cuda", dtype=torch.bfloat16) * 0.01
    lb = torch.randn(N, 32, device="cuda", dtype=torch.bfloat16) * 0.01
    res = {"device": torch.cuda.get_device_name(), "N": N, "K": K, "rows": []}
    for M, mode in ((1, "eager"), (16, "eager"), (16, "graph")):
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        calls = {"cublas_linear": lambda: torch.nn.functional.linear(x, w),
                 "nvfp4_matmul": lambda: ops.nvfp4_matmul(x, p, s, g),
                 "nvfp4_matmul_lora": lambda: ops.nvfp4_matmul(x, p, s, g, None, None, lb, 2.0, lora_a=la),
                 "seam_nvfp4_linear": lambda: nvfp4_linear(x, p, s, g)}
        with torch.no_grad(), ops.launch_mode(mode):
            row = {"M": M, "mode": mode, **{k + "_us": _host_us(f) for k, f in calls.items()}}
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(300):
                ops.nvfp4_matmul(x, p, s, g)
            prof.disable()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
        row["profile_top_tottime"] = buf.getvalue()
        res["rows"].append(row)
        print(M, mode, {k: round(v, 1) for k, v in row.items() if k.endswith("_us")}, flush=True)
        print(buf.getvalue()[:1200], flush=True)
    with open(out, "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
