"""GPU: every LoRA route of the decode path (``ops.lora_route``: fused producers, the PDL launch pair,
``x @ lora_a.T`` first) against the dequantized reference, three calls each (the launches leave their
tickets, flags and counters ready for the next one), on shapes where each route is the default.

``python scripts/lora_route_check.py`` — prints one line per shape and route (device, N, K, M, requested
route, route taken, max relative error).
"""
import torch

from qerl.quant import nvfp4
from qerl_kernels import ops


def main() -> None:
    dev = "cuda"
    for N, K, M in ((3584, 18944, 16), (5120, 13824, 12), (5120, 27648, 16), (4608, 3584, 4)):
        g = torch.Generator(device=dev).manual_seed(0)
        p, s, gs = nvfp4.quantize(torch.randn(N, K, device=dev, generator=g) * 0.02)
        x = torch.randn(M, K, device=dev, generator=g).bfloat16()
        la = (torch.randn(32, K, device=dev, generator=g) * 0.02).bfloat16()
        lb = (torch.randn(N, 32, device=dev, generator=g) * 0.02).bfloat16()
        want = x.float() @ nvfp4.dequantize(p, s, gs, torch.float32).T + 2.0 * ((x @ la.T).float() @ lb.float().T)
        for route in ("auto", "pdl", "fused"):
            ops.LORA_LAUNCH = route
            errs = []
            for _ in range(3):
                y = ops.nvfp4_matmul(x, p, s, gs, None, None, lb, 2.0, lora_a=la)
                errs.append(float((y.float() - want).norm() / want.norm()))
            cfg = ops._resolved_config("fwd", M, N, K, x, p, s, False)
            print(torch.cuda.get_device_name(), N, K, M, route, ops.lora_route("fwd", cfg, M, K, route),
                  "rel_err %.5f" % max(errs))
        ops.LORA_LAUNCH = "auto"


if __name__ == "__main__":
    main()
