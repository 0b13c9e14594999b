"""One routed NVFP4 forward (7B gate/up, M = 64) inside cudaProfilerStart/Stop."""
import torch
from qerl.bench.kernels import _weights
from qerl_kernels.ops import nvfp4_matmul, launch_mode

with launch_mode("graph"):
    (w, p, s, g), = _weights(37888, 3584, 1)
    for M in (64,):
        x = torch.randn(M, 3584, device="cuda", dtype=torch.bfloat16)
        for _ in range(3):
            nvfp4_matmul(x, p, s, g)
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        nvfp4_matmul(x, p, s, g)
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
print("done")
