"""GPU: the warpgroup-MMA kernel (``qerl_kernels.nvfp4_wgmma``) for mid-size M — layout probe,
correctness and a config sweep against cuBLAS bf16 and the currently routed kernel.

1. **Layout probe** (N = 64, K = 128, x = the identity, no activation permutation): column ``l`` of
   the kernel's output is the weight column the kernel multiplied at *logical* k = l; it must be
   ``π(l)`` (``nvfp4_wgmma.perm_128``). Prints and records the first mismatches (what the kernel did
   instead), so one run pins down a wrong fragment assembly.
2. **Sweep**: Qwen2.5 7B/14B/32B projection shapes x M (``WGMMA_MS``, default 16,32,64,128,256) x
   configs (warpgroups WG, activation rows BT, ring stages NS, split-K SPLIT): relative error against
   the dequantized fp32 reference, median time in interleaved CUDA-graph replay with cuBLAS and the
   routed ``ops.nvfp4_matmul`` (``tuned``); with the in-kernel activation gather (``XG``, ``us``) and
   with the activations permuted beforehand (``us_given_xp``, the permutation itself not timed).

``python scripts/wgmma_sweep.py OUT.json [seconds]`` — rows are written after every shape.
"""
import json
import os
import sys
import time

import torch

from qerl.quant import nvfp4
from qerl.stages.bench_kernels import _graph_times
from qerl_kernels import ops
from qerl_kernels.nvfp4_wgmma import nvfp4_wgmma_matmul, perm_128, permute_activations

SHAPES = [(37888, 3584), (3584, 18944), (4608, 3584), (3584, 3584), (55296, 5120), (5120, 27648), (7168, 5120),
          (5120, 5120), (27648, 5120), (5120, 13824)]


def probe(res):
    torch.manual_seed(0)
    N, K = 64, 128
    w = nvfp4.quantize(torch.randn(N, K, device="cuda", dtype=torch.bfloat16))
    dense = nvfp4.dequantize(*w, torch.float32)  # [N, K]
    x = torch.eye(K, device="cuda", dtype=torch.bfloat16)  # M = 128 tokens
    y = nvfp4_wgmma_matmul(x, *w, WG=1, BT=64, NS=3, XG=0, xp=x).float()  # y[l, n] = A[n, l]
    pi = perm_128()
    found, bad = [], []
    for l in range(K):
        col = y[l]
        d = (dense.T - col[None, :]).abs().amax(dim=1) / dense.abs().amax()
        j = int(d.argmin())
        found.append(j if float(d[j]) < 2e-2 else -1)
        if found[-1] != pi[l]:
            bad.append((l, pi[l], found[-1]))
    full = nvfp4_wgmma_matmul(x, *w, WG=1, BT=64, NS=3, XG=0).float()
    err = float((full - dense.T).norm() / dense.norm())
    res["probe"] = {"map": found, "expected": pi, "mismatches": len(bad), "first": bad[:16], "identity_rel_err": err}
    print(f"probe: {len(bad)} / 128 logical k mismatched (first {bad[:8]}); identity rel err {err:.2e}", flush=True)
    # in-kernel gather (XG): y = x · Ŵᵀ with x = I must be Ŵᵀ; else row m shows the column actually used
    g = nvfp4_wgmma_matmul(x, *w, WG=1, BT=64, NS=3, XG=1).float()
    gbad = []
    for m in range(K):
        d = (dense.T - g[m][None, :]).abs().amax(dim=1) / dense.abs().amax()
        j = int(d.argmin())
        if j != m or float(d[j]) > 2e-2:
            gbad.append((m, j if float(d[j]) < 2e-2 else -1))
    gerr = float((g - dense.T).norm() / dense.norm())
    res["probe_xg"] = {"mismatches": len(gbad), "first": gbad[:16], "identity_rel_err": gerr}
    print(f"probe XG: {len(gbad)} / 128 rows wrong (first {gbad[:8]}); rel err {gerr:.2e}", flush=True)
    return not bad and not gbad


def configs(M, N, K, sms):
    out = {}
    steps = K // 128
    for WG in (1, 2):
        for BT in sorted({min(128, max(16, -(-M // 16) * 16)), 64} if M > 16 else {16}):
            for NS in (3, 4):
                tiles = -(-N // (64 * WG)) * -(-M // BT)
                res = 3 if WG == 1 else 2
                s0 = max(1, min(steps // 2, round(res * sms / tiles)))
                for split in sorted({s0, max(1, s0 // 2)}):
                    out[f"w{WG}_b{BT}_s{NS}_k{split}"] = dict(WG=WG, BT=BT, NS=NS, SPLIT=split, XG=1)
    return out


def main(out, budget=300.0):
    t_start = time.time()
    dev = torch.cuda.get_device_name()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    res = {"device": dev, "rows": []}
    ok = probe(res)
    with open(out, "w") as f:
        json.dump(res, f, indent=1)
    if not ok and os.environ.get("WGMMA_FORCE", "0") != "1":
        return 1
    for N, K in SHAPES:
        if time.time() - t_start > budget:
            break
        copies = max(2, min(8, (256 * 2 ** 20) // (N * K // 2) + 1))
        ws = [nvfp4.quantize(torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02) for _ in range(copies)]
        dense = [nvfp4.dequantize(*w, torch.bfloat16) for w in ws[:2]]
        for M in (int(m) for m in os.environ.get("WGMMA_MS", "16,32,64,128,256").split(",")):
            if time.time() - t_start > budget:
                break
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            xp = permute_activations(x)
            ref = x.float() @ nvfp4.dequantize(*ws[0], torch.float32).T
            named = {"cublas": [lambda w=w: torch.nn.functional.linear(x, w) for w in dense],
                     "tuned": [lambda w=w: ops.nvfp4_matmul(x, *w) for w in ws]}
            errs = {}
            for name, cfg in configs(M, N, K, sms).items():
                try:
                    y = nvfp4_wgmma_matmul(x, *ws[0], **cfg)
                    errs[name] = float((y.float() - ref).norm() / ref.norm())
                    if errs[name] < 1e-2:
                        named[name] = [lambda w=w, c=cfg: nvfp4_wgmma_matmul(x, *w, **c) for w in ws]
                        named[name + "+xp"] = [lambda w=w, c=cfg: nvfp4_wgmma_matmul(x, *w, xp=xp, **{**c, "XG": 0})
                                               for w in ws]
                except Exception as e:  # noqa: BLE001 - reported
                    errs[name] = repr(e)[:200]
            t = _graph_times(named, reps=7)
            rows = []
            for name, cfg in configs(M, N, K, sms).items():
                if name not in named:
                    rows.append({"N": N, "K": K, "M": M, "variant": name, **cfg, "rel_err": errs[name]})
                    continue
                rows.append({"N": N, "K": K, "M": M, "variant": name, **cfg, "rel_err": errs[name],
                             "us": t[name] * 1e6, "us_given_xp": t[name + "+xp"] * 1e6,
                             "cublas_us": t["cublas"] * 1e6, "tuned_us": t["tuned"] * 1e6,
                             "speedup": t["cublas"] / t[name],
                             "speedup_given_xp": t["cublas"] / t[name + "+xp"], "vs_tuned": t["tuned"] / t[name]})
            res["rows"] += rows
            timed = [r for r in rows if "us" in r]
            bad = {r["variant"]: r["rel_err"] for r in rows if "us" not in r}
            if timed:
                b = min(timed, key=lambda r: r["us"])
                print(f"{N}x{K} M={M}: cuBLAS {t['cublas'] * 1e6:.1f} us, tuned {t['tuned'] * 1e6:.1f} us, "
                      f"best {b['variant']} {b['us']:.1f} us ({b['speedup']:.2f}x cuBLAS, {b['vs_tuned']:.2f}x tuned; "
                      f"given xp {b['us_given_xp']:.1f}), err {b['rel_err']:.1e}; bad {bad}", flush=True)
            else:
                print(f"{N}x{K} M={M}: nothing ran: {bad}", flush=True)
            with open(out, "w") as f:
                json.dump(res, f, indent=1)
        del ws, dense
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], float(sys.argv[2]) if len(sys.argv) > 2 else 300.0))
