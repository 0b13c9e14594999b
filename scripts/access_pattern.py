"""GPU: how fast can the decode kernels' *memory access pattern* alone read packed NVFP4 weights?

A Triton kernel that only streams a [N, K/2] uint8 matrix (every byte read once, XOR-folded into one
int32 per row so nothing is optimised away) with the shape of the decode kernels' reads: each
program owns BN rows, and each step reads BK contiguous bytes of every one of them (the MMV kernel:
BN = 64, 64 bytes per row per step; its cp.async twin: 128), optionally SPLIT-K ways. Achieved GB/s
against the device-to-device copy bandwidth says whether the pattern (how many bytes of a row are
requested together) or the arithmetic limits the decode kernels.

``python scripts/access_pattern.py OUT.json``
"""
import itertools
import json
import sys

import torch
import triton
import triton.language as tl

from qerl.stages.bench_kernels import _graph_times, copy_bandwidth


@triton.jit
def _stream(w_ptr, out_ptr, N, KB, stride, SPLIT, BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    rows = pid_n * BN + tl.arange(0, BN)
    cols = tl.arange(0, BK // 4)
    wi = w_ptr.to(tl.pointer_type(tl.int32))
    base = tl.minimum(rows, N - 1)[:, None] * (stride // 4) + cols[None, :]
    steps = KB // BK
    per = tl.cdiv(steps, SPLIT)
    t0 = pid_s * per
    t1 = tl.minimum(steps, t0 + per)
    acc = tl.zeros((BN, BK // 4), tl.int32)
    if STAGES > 0:
        for t in tl.range(t0, t1, num_stages=STAGES):
            acc ^= tl.load(wi + base + t * (BK // 4))
    else:
        for t in range(t0, t1):
            acc ^= tl.load(wi + base + t * (BK // 4))
    r = tl.xor_sum(acc, axis=1)
    tl.atomic_xor(out_ptr + rows, r, mask=rows < N)


def main(out: str) -> int:
    bw = copy_bandwidth()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    res = {"device": torch.cuda.get_device_name(), "copy_GBps": bw, "rows": []}
    for N, K in ((55296, 5120), (4608, 3584), (5120, 27648)):
        KB = K // 2
        ws = [torch.randint(0, 255, (N, KB), device="cuda", dtype=torch.uint8) for _ in range(3)]
        o = torch.zeros(N, device="cuda", dtype=torch.int32)
        named = {}
        for BN, BK, warps, stages in itertools.product((16, 64), (64, 128, 256, 512, 1024), (4,), (0, 3)):
            if BN * BK > 32 * 1024 or KB % BK:
                continue
            tiles = -(-N // BN)
            for split in sorted({1, max(1, min(KB // BK, round(4 * sms / tiles)))}):
                name = f"bn{BN}_bk{BK}_s{stages}_k{split}"
                grid = (tiles, split)
                named[name] = [lambda w=w, g=grid, a=(BN, BK, stages, warps, split): _stream[g](
                    w, o, N, KB, KB, a[4], BN=a[0], BK=a[1], STAGES=a[2], num_warps=a[3]) for w in ws]
        t = _graph_times(named, reps=7)
        for name, s in sorted(t.items(), key=lambda kv: kv[1]):
            gbps = N * KB / s / 1e9
            res["rows"].append({"N": N, "K": K, "variant": name, "us": s * 1e6, "GBps": gbps, "pct_copy": 100 * gbps / bw})
        best = min(t, key=t.get)
        print(f"{N}x{K}: best {best} {N * KB / t[best] / 1e9:.0f} GB/s; "
              + ", ".join(f"{k} {N * KB / v / 1e9:.0f}" for k, v in sorted(t.items())), flush=True)
        with open(out, "w") as f:
            json.dump(res, f, indent=1)
        del ws
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
