"""Wave-aligned split-K probe: C=1 OCC=2 TMA at M=64 (and C=2 BT=128 at M=128) with SPLIT 1..4 vs SK, CUDA graphs."""
import json, os, torch
from qerl.bench.kernels import _weights
from qerl.bench.timing import graph_time
from qerl_kernels.ops import nvfp4_matmul, launch_mode

out = []
with launch_mode("graph"):
    for N, K in ((37888, 3584), (27648, 5120), (55296, 5120), (3584, 18944), (5120, 13824)):
        ws = _weights(N, K, 4)
        for M, base in ((64, dict(WGMMA=1, WS=1, C=1, MT=1, BT=64, NS=4, OCC=2, TMA=1)),
                        (128, dict(WGMMA=1, WS=1, C=2, MT=1, BT=128, NS=4, OCC=1, TMA=1))):
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            t_cu = graph_time([lambda w=w: torch.nn.functional.linear(x, w[0]) for w in ws], reps=9)
            for v in ({"SPLIT": 1}, {"SPLIT": 1, "SK": 1}, {"SPLIT": 2}, {"SPLIT": 3}, {"SPLIT": 4}):
                cfg = {**base, **v}
                os.environ["QERL_KERNEL_CONFIG"] = json.dumps(cfg)
                try:
                    from qerl.quant import nvfp4
                    ref = x.float() @ nvfp4.dequantize(*ws[0][1:], torch.float32).T
                    y = nvfp4_matmul(x, *ws[0][1:])
                    err = float((y.float() - ref).norm() / ref.norm())
                    t = graph_time([lambda w=w: nvfp4_matmul(x, *w[1:]) for w in ws], reps=9)
                finally:
                    os.environ.pop("QERL_KERNEL_CONFIG")
                row = dict(N=N, K=K, M=M, **v, us=t * 1e6, cublas_us=t_cu * 1e6, speedup=t_cu / t, err=err)
                out.append(row)
                print(json.dumps(row), flush=True)
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "split_probe.json"), "w"), indent=1)
