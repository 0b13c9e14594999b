"""GPU: where the LoRA-32 cost of the warpgroup-MMA route goes, per launch, timed in CUDA graphs (interleaved
replays, ``qerl.stages.bench_kernels._graph_times``) on the routed config of each shape:

* ``kernel``: the WGMMA kernel alone on pre-permuted activations; ``permute``: the activation pre-pass
  alone; ``base``: the op without LoRA (pre-pass + kernel);
* ``lora_xa``: the PDL primary alone (plain launch); ``xa_given``: the op with ``xa`` given (pre-pass + kernel
  with the LoRA epilogue, no x·Aᵀ); ``pdl``: the op with ``lora_a`` as routed (pre-pass + ``lora_xa`` +
  the dependent kernel); ``matmul``: ``x @ lora_a.T`` (cuBLAS) then the op with ``xa``;
* the primary's knobs: ``lora_xa_s3`` / ``pdl_s3`` (chunk loop pipelined 3 deep; ``pdl_s1``: not pipelined —
  ``pdl`` is as routed: 3 deep above K = 8192), ``lora_xa_p128`` / ``pdl_p128``
  (up to 128 programs), ``pdl_s3_p128``.

``python scripts/wgmma_lora_split.py OUT.json`` — one line per (shape, M); rows rotate weight copies past the
L2 like the benchmark.
"""
import json
import sys

import torch

from qerl.quant import nvfp4
from qerl.stages.bench_kernels import _graph_times
from qerl_kernels import ops
from qerl_kernels.lora_xa import _lora_xa_kernel
from qerl_kernels.nvfp4_wgmma import nvfp4_wgmma_matmul, permute_activations

SHAPES = {"7B qkv": (4608, 3584), "7B o": (3584, 3584), "7B gate_up": (37888, 3584), "7B down": (3584, 18944),
          "32B down": (5120, 27648)}


def _with(knobs: dict, fn):
    """Call ``fn`` with ``ops`` module knobs set (at capture time: the graph keeps what was launched)."""
    old = {k: getattr(ops, k) for k in knobs}
    for k, v in knobs.items():
        setattr(ops, k, v)
    try:
        return fn()
    finally:
        for k, v in old.items():
            setattr(ops, k, v)


def main(out: str) -> int:
    dev, R = "cuda", 32
    rows = []
    for name, (N, K) in SHAPES.items():
        copies = max(2, min(8, (256 * 2 ** 20) // (N * K // 2) + 1))
        ws = [nvfp4.quantize(torch.randn(N, K, device=dev, dtype=torch.bfloat16) * 0.02) for _ in range(copies)]
        la = (torch.randn(R, K, device=dev) * 0.02).bfloat16()
        lb = (torch.randn(N, R, device=dev) * 0.02).bfloat16()
        for M in (8, 16, 32, 64):
            x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
            cfg = ops._resolved_config("fwd", M, N, K, x, *ws[0][:2], False)
            if not cfg.get("WGMMA"):
                print(name, M, "not on WGMMA:", cfg, flush=True)
                continue
            xp = permute_activations(x)
            xa = x @ la.T
            blocks = -(-M // 16)
            nxp = min(64, -(-K // 128))
            xa16 = torch.empty(16 * blocks, R, device=dev, dtype=torch.bfloat16)
            xap = torch.empty(blocks * nxp * 16 * R, device=dev)
            lock = torch.zeros(4, device=dev, dtype=torch.int32)
            part = torch.empty(int(cfg.get("SPLIT", 1)) * M * N, device=dev)
            locks = ops._locks(x.device)
            kw = {k: v for k, v in cfg.items() if k != "WGMMA"}
            named = {
                "kernel": [lambda w=w: nvfp4_wgmma_matmul(x, w[0], w[1].view(torch.uint8), w[2], xp=xp, part=part,
                                                          lock=locks, **kw) for w in ws],
                "permute": [lambda: permute_activations(x)] * len(ws),  # as many launches per graph as the others
                "base": [lambda w=w: ops.nvfp4_matmul(x, *w) for w in ws],
                "lora_xa": [lambda: _lora_xa_kernel[(nxp, blocks)](x, la, xa16, xap, lock, lock, M, K, x.stride(0), nxp,
                                                                   R=R, KB=128, QB=16, PDL=0, num_warps=4,
                                                                   num_stages=1)] * len(ws),
                "xa_given": [lambda w=w: ops.nvfp4_matmul(x, *w, None, xa, lb, 2.0) for w in ws],
                "pdl": [lambda w=w: ops.nvfp4_matmul(x, *w, None, None, lb, 2.0, lora_a=la) for w in ws],
                "matmul": [lambda w=w: ops.nvfp4_matmul(x, *w, None, x @ la.T, lb, 2.0) for w in ws],
            }
            # the PDL primary's knobs (ops.XA_*: programs, chunk-loop pipeline depth), alone and as routed
            nxp2 = min(128, -(-K // 128))
            xap2 = torch.empty(blocks * nxp2 * 16 * R, device=dev)
            named["lora_xa_s3"] = [lambda: _lora_xa_kernel[(nxp, blocks)](
                x, la, xa16, xap, lock, lock, M, K, x.stride(0), nxp, R=R, KB=128, QB=16, PDL=0, STAGES=3,
                num_warps=4, num_stages=1)] * len(ws)
            named["lora_xa_p128"] = [lambda: _lora_xa_kernel[(nxp2, blocks)](
                x, la, xa16, xap2, lock, lock, M, K, x.stride(0), nxp2, R=R, KB=128, QB=16, PDL=0, num_warps=4,
                num_stages=1)] * len(ws)
            for tag, knobs in (("pdl_s1", {"XA_STAGES": 1}), ("pdl_s3", {"XA_STAGES": 3}), ("pdl_p128", {"XA_PROGRAMS": 128}),
                               ("pdl_s3_p128", {"XA_STAGES": 3, "XA_PROGRAMS": 128})):
                named[tag] = [lambda w=w, knobs=knobs: _with(knobs, lambda: ops.nvfp4_matmul(
                    x, *w, None, None, lb, 2.0, lora_a=la)) for w in ws]
            t = _graph_times(named, reps=15)
            per_call = {k: 1e6 * v for k, v in t.items()}  # _graph_times: seconds per call
            row = {"device": torch.cuda.get_device_name(), "shape": name, "N": N, "K": K, "M": M, "config": cfg,
                   "us": per_call}
            rows.append(row)
            print(name, M, {k: round(v, 2) for k, v in per_call.items()}, flush=True)
    with open(out, "w") as f:
        json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    with ops.launch_mode("graph"):  # CUDA-graph timings: the graph-mode configs
        sys.exit(main(sys.argv[1]))
