"""Kernel experiments on a GPU (evidence for reports/kernels/README.md), one JSON line per result.

``python scripts/kernel_experiments.py OUT_DIR`` (repo root on PYTHONPATH, ``kernels/`` as ``qerl_kernels``)

1. *dequant cost*: the decode forward timed as is and with the packed-word dequantization replaced
   by a trivial stand-in (wrong numbers, same loads / MMAs / layout) — the difference is what the
   dequantization costs; if the stand-in is not faster, the kernel is bound elsewhere.
2. *occupancy*: the same tile with 4 and 8 warps, deeper pipelines, wider and swapped tiles.
"""
import json
import os
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

from qerl.quant import nvfp4
from qerl.stages.bench_kernels import _graph_time
from qerl_kernels import nvfp4_matmul as km
from qerl_kernels import ops


@triton.jit
def _fake_pairs(p, s2):
    return p.to(tl.int32) | s2  # same inputs, ~1 instruction per byte


def timeit(kind, M, N, K, cfg, copies=6):
    ws = [nvfp4.quantize(torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02) for _ in range(copies)]
    x = torch.randn(M, K if kind == "fwd" else N, device="cuda", dtype=torch.bfloat16)
    op = ops.nvfp4_matmul if kind == "fwd" else ops.nvfp4_matmul_t
    os.environ["QERL_KERNEL_CONFIG"] = json.dumps(cfg)
    try:
        return _graph_time([lambda w=w: op(x, *w) for w in ws], reps=9) * 1e6
    finally:
        os.environ.pop("QERL_KERNEL_CONFIG")


def main():
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    res = []
    base = dict(BM=16, BN=128, BK=128, SWAP=0, num_warps=4, num_stages=4, SPLIT=1)
    shapes = [("gate_up", 37888, 3584), ("qkv", 4608, 3584)]
    variants = {"base": base, "w8": {**base, "num_warps": 8}, "w8_bn256": {**base, "num_warps": 8, "BN": 256},
                "st6": {**base, "num_stages": 6}, "bk256_w8": {**base, "BK": 256, "num_warps": 8},
                "bn64_w2": {**base, "BN": 64, "num_warps": 2}, "swap_bn128": {**base, "SWAP": 1},
                "swap_bn64_w4": {**base, "SWAP": 1, "BN": 64}}
    for name, N, K in shapes:
        for vname, cfg in variants.items():
            for split in ((1, 4) if name == "qkv" else (1,)):
                c = {**cfg, "SPLIT": split}
                try:
                    t = timeit("fwd", 1, N, K, c)
                except Exception as e:
                    t = repr(e)[:100]
                res.append({"exp": "occupancy", "shape": name, "variant": vname, "split": split, "us": t})
                print(json.dumps(res[-1]), flush=True)
    # dequant stand-in: a fresh process whose module global is swapped before anything compiles
    # (Triton hashes the sources of the functions a kernel calls, so it compiles a new kernel)
    import subprocess

    for name, N, K in shapes:
        row = {"exp": "dequant_cost", "shape": name}
        for mode in ("real", "standin"):
            code = (f"import sys; sys.argv=['x']; import kernel_experiments as e; "
                    f"e.km._fp4_pairs = e._fake_pairs if '{mode}' == 'standin' else e.km._fp4_pairs; "
                    f"print(e.timeit('fwd', 1, {N}, {K}, {{**{base!r}, 'num_stages': 5}}))")
            r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                               cwd=Path(__file__).parent, env={**os.environ})
            row[f"{mode}_us"] = float(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else r.stderr[-200:]
        res.append(row)
        print(json.dumps(row), flush=True)
    (out / "experiments.json").write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": res}, indent=1))


if __name__ == "__main__":
    main()
