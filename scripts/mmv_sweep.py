"""GPU: the decode kernel's (``qerl_kernels.nvfp4_mmv``) memory-pipeline knobs on Qwen2.5 decode shapes.

For each (N, K) and M, every variant — register prefetch depth (num_stages 1 | 2), activations
prefetched or loaded at use (XPRE), the L2 fetch-size hint of the weight loads (L2 0 | 256) and the
L2 prefetch distance (PFD steps), at the tuned SPLIT and one other — is checked against the
dequantized reference and timed in one interleaved CUDA-graph replay with cuBLAS bf16. Then the LoRA
rank-32 cost is split into its parts: the kernel with a given ``xa`` vs without, and ``x · Aᵀ``.

``python scripts/mmv_sweep.py OUT.json [seconds]`` (``MMV_SWEEP_GRID=0``: tuned config only; ``=async``: the
cp.async pipeline (MMV 2) grid of stages, warps and splits; ``=wide``: the register-fragment kernel with
32 | 64 activation rows per program against the tuned tile / DQ config (for M = 32, 64); ``=rb``: two blocks
of 16 weight rows per warp (RB 2) against RB 1 and the tuned config; ``=xpad``: the tuned config with the
activations copied to a padded row stride (``XPAD``); ``MMV_SWEEP_MS=1,8,16``; ``MMV_SWEEP_LORA=0``): rows are written after every shape (a cut-off run
keeps its work); stops starting new shapes after ``seconds`` (default 400).
"""
import itertools
import json
import os
import sys
import time

import torch

from qerl.quant import nvfp4
from qerl.stages.bench_kernels import _graph_times, copy_bandwidth
from qerl_kernels import ops

SHAPES = [(55296, 5120), (3584, 3584), (5120, 27648), (4608, 3584), (37888, 3584), (3584, 18944), (5120, 5120),
          (7168, 5120), (27648, 5120), (5120, 13824)]


def _variants(base: dict, M: int, N: int, K: int, sms: int) -> dict:
    splits = {base.get("SPLIT", 1)}
    loop = -(-K // 128)
    tiles = -(-M // base["BM"]) * -(-N // base["BN"])
    splits.add(max(1, min(loop // 2, (16 * sms) // tiles)))
    out = {"tuned": dict(base)}
    for split, pre, xpre, l2, pfd in itertools.product(sorted(splits), (1, 2), (0, 1), (0, 256), (0, 4)):
        cfg = {**base, "SPLIT": split, "num_stages": pre, "XPRE": xpre, "L2": l2, "PFD": pfd}
        out[f"s{split}_p{pre}_x{xpre}_l{l2}_d{pfd}"] = cfg
    return out


def _async_variants(base: dict, M: int, N: int, K: int, sms: int) -> dict:
    """The tuned config and the cp.async pipeline (MMV 2): stages x warps x splits around the tuned one."""
    out = {"tuned": dict(base)}
    steps = K // 256
    bm = 8 if M <= 8 else 16
    for warps, stages in itertools.product((4, 8), (2, 3, 4, 6)):
        bn = 16 * warps
        tiles = -(-M // bm) * -(-N // bn)
        s0 = max(1, min(steps, round((4 * sms) / tiles)))  # ~4 programs per SM
        for split in sorted({s0, max(1, s0 // 2), min(steps, 2 * s0)}):
            out[f"a_w{warps}_s{stages}_k{split}"] = dict(MMV=2, BM=bm, BN=bn, BK=128, SPLIT=split, num_warps=warps,
                                                         num_stages=stages)
    return out


def _wide_variants(base: dict, M: int, N: int, K: int, sms: int) -> dict:
    """The tuned config (a tensor-core tile or DQ at M >= 32) against the register-fragment kernel with
    4 or 8 blocks of 8 activation rows per program (BM 32 | 64), prefetch depth 1 | 2, warps 4 | 8."""
    out = {"tuned": dict(base)}
    for bm, warps, pre in itertools.product((32, 64), (4, 8), (1, 2)):
        bn = 16 * warps
        tiles = -(-M // bm) * -(-N // bn)
        s0 = max(1, min(K // 128, round((4 * sms) / tiles)))
        for split in sorted({1, s0}):
            out[f"m_b{bm}_w{warps}_p{pre}_k{split}"] = dict(MMV=1, BM=bm, BN=bn, BK=128, SPLIT=split, num_warps=warps,
                                                            num_stages=pre, XPRE=0)
    return out


def _rb_variants(base: dict, M: int, N: int, K: int, sms: int) -> dict:
    """The tuned config against two blocks of 16 weight rows per warp (RB 2: the activation fragments
    loaded and permuted once for both), warps 2 | 4, prefetch 1 | 2, splits around ~4 programs per SM;
    and RB 1 at the same splits."""
    out = {"tuned": dict(base)}
    bm = 8 if M <= 8 else (16 if M <= 16 else 32)
    for rb, warps, pre in itertools.product((1, 2), (2, 4), (1, 2)):
        bn = 16 * rb * warps
        tiles = -(-M // bm) * -(-N // bn)
        s0 = max(1, min(K // 128, round((4 * sms * 4 / warps) / tiles)))
        for split in sorted({s0, min(K // 128, 2 * s0)}):
            out[f"r{rb}_w{warps}_p{pre}_k{split}"] = dict(MMV=1, BM=bm, BN=bn, BK=128, SPLIT=split, num_warps=warps,
                                                         num_stages=pre, XPRE=0, RB=rb)
    return out


MODE = os.environ.get("MMV_SWEEP_GRID", "1")  # 0: only the tuned config (and the LoRA split); async: MMV 2 grid
GRID = MODE != "0"


def _time(named):
    return _graph_times(named, reps=9)


def main(out: str, budget: float = 400.0) -> int:
    t_start = time.time()
    bw = copy_bandwidth()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    dev = torch.cuda.get_device_name()
    res = {"device": dev, "copy_GBps": bw, "rows": [], "lora": []}
    for N, K in SHAPES:
        if time.time() - t_start > budget:
            break
        copies = max(2, min(8, (256 * 2 ** 20) // (N * K // 2) + 1))
        ws = [nvfp4.quantize(torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02) for _ in range(copies)]
        dense = [nvfp4.dequantize(*w, torch.bfloat16) for w in ws[:max(2, min(4, 2 ** 28 // (N * K * 2) + 1))]]
        nbytes = N * K // 2 + N * K // 16
        for M in tuple(int(m) for m in os.environ.get("MMV_SWEEP_MS", "1,16").split(",")):
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            ref = x.float() @ nvfp4.dequantize(*ws[0], torch.float32).T
            base = ops.config_for("fwd", M, N, K, x.device)
            if not base.get("MMV") and MODE not in ("wide", "rb", "xpad"):
                continue
            named = {"cublas": [lambda w=w: torch.nn.functional.linear(x, w) for w in dense]}
            errs = {}
            for name, cfg in ({"1": _variants, "async": _async_variants, "wide": _wide_variants, "rb": _rb_variants,
               "xpad": lambda base, *a: {"tuned": dict(base), "xpad": {**base, "XPAD": 1}}}[MODE](base, M, N, K, sms) if GRID else {"tuned": dict(base)}).items():
                os.environ["QERL_KERNEL_CONFIG"] = json.dumps(cfg)
                try:
                    y = ops.nvfp4_matmul(x, *ws[0])
                    errs[name] = float((y.float() - ref).norm() / ref.norm())
                    if errs[name] < 1e-2:
                        named[name] = [lambda w=w, c=json.dumps(cfg): _with(c, x, w) for w in ws]
                except Exception as e:  # noqa: BLE001 - a variant that does not compile is reported
                    errs[name] = repr(e)[:120]
                finally:
                    os.environ.pop("QERL_KERNEL_CONFIG", None)
            t = _time(named)
            for name in named:
                if name == "cublas":
                    continue
                row = {"N": N, "K": K, "M": M, "variant": name, "us": t[name] * 1e6, "cublas_us": t["cublas"] * 1e6,
                       "speedup": t["cublas"] / t[name], "pct_copy_bw": 100 * nbytes / t[name] / 1e9 / bw,
                       "rel_err": errs[name]}
                res["rows"].append(row)
            bad = {k: v for k, v in errs.items() if not isinstance(v, float) or v >= 1e-2}
            best = min((r for r in res["rows"] if (r["N"], r["K"], r["M"]) == (N, K, M)), key=lambda r: r["us"])
            tuned = next(r for r in res["rows"] if (r["N"], r["K"], r["M"], r["variant"]) == (N, K, M, "tuned"))
            print(f"{N}x{K} M={M}: cuBLAS {t['cublas'] * 1e6:.1f} us, tuned {tuned['us']:.1f} us "
                  f"({tuned['pct_copy_bw']:.0f}% BW), best {best['variant']} {best['us']:.1f} us "
                  f"({best['pct_copy_bw']:.0f}% BW, {best['speedup']:.2f}x); bad {bad}", flush=True)
            if os.environ.get("MMV_SWEEP_LORA", "1") == "0":
                with open(out, "w") as f:
                    json.dump(res, f, indent=1)
                continue
            # LoRA rank 32: kernel with xa given, x·Aᵀ alone, both (the benchmark's fwd_lora)
            la = torch.randn(32, K, device="cuda", dtype=torch.bfloat16) * 0.01
            lb = torch.randn(N, 32, device="cuda", dtype=torch.bfloat16) * 0.01
            xa = x @ la.T
            y = ops.nvfp4_matmul(x, *ws[0], None, xa, lb, 2.0)
            want = ref + 2.0 * (xa.float() @ lb.float().T)
            lerr = float((y.float() - want).norm() / want.norm())
            tl_ = _time({"base": [lambda w=w: ops.nvfp4_matmul(x, *w) for w in ws],
                         "with_xa": [lambda w=w: ops.nvfp4_matmul(x, *w, None, xa, lb, 2.0) for w in ws],
                         "x_at": [lambda: x @ la.T for _ in ws],
                         "full": [lambda w=w: ops.nvfp4_matmul(x, *w, None, x @ la.T, lb, 2.0) for w in ws],
                         "fused": [lambda w=w: ops.nvfp4_matmul(x, *w, None, None, lb, 2.0, lora_a=la) for w in ws]})
            yf = ops.nvfp4_matmul(x, *ws[0], None, None, lb, 2.0, lora_a=la)
            ferr = float((yf.float() - want).norm() / want.norm())
            lrow = {"N": N, "K": K, "M": M, "rel_err": lerr, "fused_rel_err": ferr,
                    **{k + "_us": v * 1e6 for k, v in tl_.items()},
                    "epilogue_overhead": tl_["with_xa"] / tl_["base"] - 1, "total_overhead": tl_["full"] / tl_["base"] - 1,
                    "fused_overhead": tl_["fused"] / tl_["base"] - 1}
            res["lora"].append(lrow)
            print("  lora", {k: round(v, 4) if isinstance(v, float) else v for k, v in lrow.items()}, flush=True)
            with open(out, "w") as f:
                json.dump(res, f, indent=1)
        del ws, dense
    with open(out, "w") as f:
        json.dump(res, f, indent=1)
    return 0


def _with(cfg_json: str, x, w):
    os.environ["QERL_KERNEL_CONFIG"] = cfg_json
    try:
        return ops.nvfp4_matmul(x, *w)
    finally:
        os.environ.pop("QERL_KERNEL_CONFIG", None)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], float(sys.argv[2]) if len(sys.argv) > 2 else 400.0))
