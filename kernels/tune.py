"""Tile-config search for the NVFP4 kernels; writes ``kernels/tuned/<device>.json``.

Keyed on ``"<kind>:<M bucket>:<N>:<K>"`` (kind 'fwd' or 'bwd'); :func:`qerl_kernels.ops.config_for`
reads the file, so committed tuned defaults apply to every later run on that GPU.
"""
import json
import os
from pathlib import Path

import torch

from qerl_kernels import ops

TUNED_DIR = Path(__file__).parent / "tuned"


def candidates(kind: str, M: int, N: int, K: int, sms: int) -> list[dict]:
    h = ops.heuristic(kind, M, N, K, sms)
    if M <= 16:
        tiles = [(16, bn, bk, 4, 3) for bn in (32, 64, 128) for bk in (128, 256, 512)]
    elif M <= 64:
        tiles = [(bm, bn, bk, 4, 3) for bm in (32, 64) for bn in (64, 128) for bk in (64, 128, 256) if bm >= min(M, 64)]
    elif M <= 512:
        tiles = [(64, 128, 64, 4, 4), (128, 128, 64, 8, 3), (128, 64, 64, 4, 4), (64, 64, 128, 4, 4), (64, 256, 64, 8, 3)]
    else:
        tiles = [(128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (256, 128, 64, 8, 3), (128, 128, 128, 8, 3), (64, 128, 64, 4, 4)]
    out = []
    for bm, bn, bk, w, st in tiles:
        if kind == "bwd":
            bn, bk = bk, bn  # dX tiles over (M, K)
        base = dict(BM=bm, BN=bn, BK=bk, num_warps=w, num_stages=st)
        loop = -(-(K if kind == "fwd" else N) // (bk if kind == "fwd" else bn))
        tiles_out = -(-M // bm) * -(-(N if kind == "fwd" else K) // (bn if kind == "fwd" else bk))
        split_h = max(1, min(loop, (2 * sms) // max(1, tiles_out)))
        for split in sorted({1, split_h, min(loop, 2 * split_h)} if M <= 512 else {1}):
            out.append({**base, "SPLIT": split})
    out.append(h)
    return out


def tune_all(shapes, ms, progress: bool = True) -> Path:
    from tqdm.auto import tqdm

    from qerl.quant import nvfp4
    from qerl.stages.bench_kernels import _graph_time

    device = torch.cuda.get_device_name()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    path = TUNED_DIR / (device.replace(" ", "_") + ".json")
    table = json.loads(path.read_text()) if path.exists() else {}
    jobs = [(kind, M, N, K) for (N, K) in dict.fromkeys(shapes) for M in ms for kind in ("fwd", "bwd")]
    weights = {}
    for kind, M, N, K in tqdm(jobs, desc="tune", disable=not progress):
        key = f"{kind}:{ops.m_bucket(M)}:{N}:{K}"
        if (N, K) not in weights:
            weights.clear()
            weights[(N, K)] = nvfp4.quantize(torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02)
        p, s, g = weights[(N, K)]
        x = torch.randn(M, K if kind == "fwd" else N, device="cuda", dtype=torch.bfloat16)
        best = None
        fn = (lambda: ops.nvfp4_matmul(x, p, s, g)) if kind == "fwd" else (lambda: ops.nvfp4_matmul_t(x, p, s, g))
        for cfg in candidates(kind, M, N, K, sms):
            os.environ["QERL_KERNEL_CONFIG"] = json.dumps(cfg)  # overrides every key of config_for's choice
            try:
                t = _graph_time([fn] * 4, reps=5)
            except Exception:  # a config that does not compile (e.g. out of shared memory)
                t = float("inf")
            finally:
                os.environ.pop("QERL_KERNEL_CONFIG", None)
            if best is None or t < best[0]:
                best = (t, cfg)
        table[key] = best[1]
        TUNED_DIR.mkdir(exist_ok=True)
        path.write_text(json.dumps(table, indent=0, sort_keys=True))  # after every key: a cut-off run keeps its work
    ops._tuned.cache_clear()
    return path
