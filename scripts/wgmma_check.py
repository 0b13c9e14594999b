"""GPU: the warpgroup-MMA route (``qerl_kernels.nvfp4_wgmma``) through the public op, as models call it —
odd M (activation-row masking), bias, LoRA (``lora_a`` and explicit ``xa``), split-K with the shared
tickets (called three times: they must come back to zero), an N that is not a multiple of 64, and CUDA-graph
capture and replay with new inputs — against the dequantized fp32 reference.

``python scripts/wgmma_check.py [OUT.json]`` — one line per case; exit status 1 if any case fails.
"""
import json
import sys

import torch

from qerl.quant import nvfp4
from qerl_kernels import ops


def main(out=None) -> int:
    dev = "cuda"
    rows, bad = [], 0
    g = torch.Generator(device=dev).manual_seed(0)
    for N, K in ((3584, 3584), (4608, 3584), (520, 18944), (5120, 13824)):
        p, s, gs = nvfp4.quantize(torch.randn(N, K, device=dev, generator=g) * 0.02)
        wref = nvfp4.dequantize(p, s, gs, torch.float32)
        bias = (torch.randn(N, device=dev, generator=g) * 0.1).bfloat16()
        la = (torch.randn(32, K, device=dev, generator=g) * 0.02).bfloat16()
        lb = (torch.randn(N, 32, device=dev, generator=g) * 0.02).bfloat16()
        for M in (17, 33, 50, 64, 100, 128):
            x = torch.randn(M, K, device=dev, generator=g).bfloat16()
            cfg = ops._resolved_config("fwd", M, N, K, x, p, s, False)
            base = x.float() @ wref.T
            xa = (x @ la.T)
            cases = {"plain": (lambda: ops.nvfp4_matmul(x, p, s, gs), base),
                     "bias": (lambda: ops.nvfp4_matmul(x, p, s, gs, bias), base + bias.float()),
                     "lora_a": (lambda: ops.nvfp4_matmul(x, p, s, gs, bias, None, lb, 2.0, lora_a=la),
                                base + bias.float() + 2.0 * (xa.float() @ lb.float().T)),
                     "xa": (lambda: ops.nvfp4_matmul(x, p, s, gs, None, xa, lb, 0.5),
                            base + 0.5 * (xa.float() @ lb.float().T))}
            for name, (fn, want) in cases.items():
                errs = [float((fn().float() - want).norm() / want.norm()) for _ in range(3)]
                ok = max(errs) < 5e-3
                bad += not ok
                rows.append({"N": N, "K": K, "M": M, "case": name, "wgmma": bool(cfg.get("WGMMA")),
                             "split": cfg.get("SPLIT"), "max_rel_err": max(errs), "ok": ok})
                print(torch.cuda.get_device_name(), N, K, M, name, "WGMMA" if cfg.get("WGMMA") else cfg,
                      f"split {cfg.get('SPLIT')}", f"rel_err {max(errs):.2e}", "ok" if ok else "FAIL", flush=True)
        assert int(ops._locks(torch.device(dev)).abs().sum()) == 0, "split tickets not back at zero"
    # CUDA graph: capture at M = 40, replay with new activations
    N, K = 3584, 3584
    p, s, gs = nvfp4.quantize(torch.randn(N, K, device=dev, generator=g) * 0.02)
    x = torch.randn(40, K, device=dev, generator=g).bfloat16()
    ops.nvfp4_matmul(x, p, s, gs)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = ops.nvfp4_matmul(x, p, s, gs)
    x.copy_(torch.randn(40, K, device=dev, generator=g).bfloat16())
    graph.replay()
    want = x.float() @ nvfp4.dequantize(p, s, gs, torch.float32).T
    gerr = float((y.float() - want).norm() / want.norm())
    bad += not gerr < 5e-3
    print("cuda graph replay M=40 rel_err", f"{gerr:.2e}", flush=True)
    res = {"device": torch.cuda.get_device_name(), "rows": rows, "graph_rel_err": gerr, "failed": bad}
    if out:
        with open(out, "w") as f:
            json.dump(res, f, indent=1)
    print(json.dumps({"checked": len(rows) + 1, "failed": bad}))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else None))
