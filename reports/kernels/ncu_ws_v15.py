"""One routed NVFP4 forward per shape inside cudaProfilerStart/Stop (ncu --profile-from-start off)."""
import sys
import torch
from qerl.bench.kernels import _weights
from qerl_kernels.ops import nvfp4_matmul, launch_mode

SHAPES = [("gate_up", 37888, 3584, (64, 128, 256)), ("qkv", 4608, 3584, (64, 128)), ("down", 3584, 18944, (128,))]
cublas = "--cublas" in sys.argv
with launch_mode("graph"):
    for name, N, K, ms in SHAPES:
        (w, p, s, g), = _weights(N, K, 1)
        for M in ms:
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            f = (lambda: torch.nn.functional.linear(x, w)) if cublas else (lambda: nvfp4_matmul(x, p, s, g))
            for _ in range(3):
                f()
            torch.cuda.synchronize()
            torch.cuda.nvtx.range_push(f"{name}_M{M}")
            torch.cuda.profiler.start()
            f()
            torch.cuda.synchronize()
            torch.cuda.profiler.stop()
            torch.cuda.nvtx.range_pop()
print("done")
