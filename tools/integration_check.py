"""GPU check of the integration around the kernels: the ``qerl.ops.linear`` seam under the default
``QERL_KERNELS=auto`` (every call on the kernels: decode, tensor-core tiles and the dequantize + cuBLAS
path; forward and backward), the LoRA layer's one-call path (``nvfp4_lora_linear`` without autograd) on
every LoRA route, ``torch.compile(fullgraph=True)`` over the custom ops, and CUDA-graph capture (decode,
warpgroup-MMA and DQ calls). Writes JSON to argv[1].
"""
import json
import os
import sys

import torch

from qerl.ops import linear
from qerl.quant import nvfp4
from qerl_kernels import ops


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def main(out: str) -> int:
    torch.manual_seed(0)
    res = {"device": torch.cuda.get_device_name()}
    N, K = 4608, 3584
    p, s, g = nvfp4.quantize(torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02)
    bias = torch.randn(N, device="cuda", dtype=torch.bfloat16) * 0.1
    for M in (1, 8, 64, 2048):
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        os.environ.pop("QERL_KERNELS", None)
        linear._BACKENDS.clear()
        backend = linear.select_backend(x, p)
        y = linear.nvfp4_linear(x, p, s, g, bias)
        y.float().square().sum().backward()
        gx = x.grad.clone()
        x.grad = None
        yr = linear.reference_forward(x.detach(), p, s, g, bias)
        gr = linear.reference_backward_input(2 * yr.float().to(torch.bfloat16), p, s, g)
        res[f"seam_auto_M{M}"] = {"backend": backend.name if backend else "reference", "fwd_rel": rel(y, yr),
                                  "bwd_rel": rel(gx, gr)}
    f = torch.compile(lambda x: ops.nvfp4_matmul(x, p, s, g, bias) * 2.0, fullgraph=True)
    for M in (1, 4, 16, 256, 4096):
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        res[f"compile_M{M}"] = rel(f(x), 2.0 * linear.reference_forward(x, p, s, g, bias))
    # the LoRA layer's one-call path (no autograd: rollouts) through the seam as routed: the fused decode
    # kernel, the PDL pair in front of the warpgroup-MMA kernel (M 8..64 on the tuned tables), the matmul above
    la = torch.randn(32, K, device="cuda", dtype=torch.bfloat16) * 0.02
    lb = torch.randn(N, 32, device="cuda", dtype=torch.bfloat16) * 0.02
    with torch.no_grad():
        for mode in ops.LAUNCH_MODES:  # eager: the single-launch decode kernel at M <= 16; graph: as tuned
            with ops.launch_mode(mode):
                for M in (1, 8, 16, 40, 64, 100):
                    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
                    cfg = ops._resolved_config("fwd", M, N, K, x, p, s, False)
                    y = linear.nvfp4_lora_linear(x, p, s, g, bias, la, lb, 2.0)
                    yr = linear.reference_lora_forward(x, p, s, g, bias, la, lb, 2.0)
                    path = "WGMMA" if cfg.get("WGMMA") else ("MMV" if cfg.get("MMV") else "other")
                    res[f"lora_layer_{mode}_M{M}"] = {"path": path, "lora_route": ops.lora_route("fwd", cfg, M, K),
                                                      "rel": rel(y, yr)}
    for M in (2, 16, 2048):
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        graph = torch.cuda.CUDAGraph()
        with ops.launch_mode("graph"):
            ops.nvfp4_matmul(x, p, s, g)  # compile outside the capture
            with torch.cuda.graph(graph):
                yg = ops.nvfp4_matmul(x, p, s, g)
        x.copy_(torch.randn_like(x))
        graph.replay()
        res[f"cuda_graph_replay_M{M}_rel"] = rel(yg, linear.reference_forward(x, p, s, g, None))
    res["tickets_zero"] = int(ops._locks(x.device).abs().sum()) == 0
    ok = all(v < 5e-3 for k, v in res.items() if k.startswith(("compile", "cuda_graph"))) and res["tickets_zero"] and all(
        v["fwd_rel"] < 5e-3 and v["bwd_rel"] < 5e-3 for k, v in res.items() if k.startswith("seam")) and all(
        v["rel"] < 5e-3 for k, v in res.items() if k.startswith("lora_layer"))
    res["ok"] = ok
    with open(out, "w") as fh:
        json.dump(res, fh, indent=1)
    print(json.dumps(res))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
