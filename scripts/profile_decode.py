"""Run the NVFP4 decode kernel once per shape (for ``ncu``): ``python scripts/profile_decode.py N K M``.

``ncu --clock-control none -k regex:nvfp4 --section SpeedOfLight --section WarpStateStats
--section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis python scripts/profile_decode.py 37888 3584 1``
"""
import sys

import torch

from qerl.quant import nvfp4
from qerl_kernels.ops import nvfp4_matmul

N, K, M = (int(a) for a in sys.argv[1:4])
p, s, g = nvfp4.quantize(torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02)
x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
for _ in range(3):
    y = nvfp4_matmul(x, p, s, g)
torch.cuda.synchronize()
print(tuple(y.shape))
