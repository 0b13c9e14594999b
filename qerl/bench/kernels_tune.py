"""Tile-config search for the NVFP4 kernels; writes ``qerl_kernels/tuned/<device>.json`` (``$QERL_TUNED_DIR/<device>.json``
where that is set: a user's own searches, kept out of the package and read over it, ``qerl_kernels.ops.table_dirs``).

Keyed on ``"<kind>:<M bucket>:<N>:<K>"`` (kind 'fwd' or 'bwd'); :func:`qerl_kernels.ops.config_for`
reads the file (falling back to the nearest tuned M bucket of the same shape), so committed tuned
defaults apply to every later run on that GPU. Every candidate is also checked against the
reference (relative error) before its time counts, and every measurement can be written to a CSV
(``--csv``) so that the search itself is evidence.

``python -m qerl.bench.kernels_tune --models 7B --ms 1 16 64 2048 [--csv all.csv]`` (needs a CUDA GPU).
"""
import argparse
import itertools
import json
import os
from pathlib import Path

import torch

from qerl_kernels import ops
from qerl.files import atomic_open, write_text_atomic


def _split_options(tiles_out: int, loop: int, sms: int) -> list[int]:
    """1, and the split that brings the program count nearest 2 and 4 waves (at least 2 tiles each)."""
    out = {1}
    for waves in (2, 4):
        s = max(1, min(loop // 2, (waves * sms) // max(1, tiles_out)))
        out.add(s)
    return sorted(out)


def _tiles(kind: str, M: int) -> list[tuple]:
    """(BM, BN, BK, SWAP, warps, stages) to try. bwd tiles dX over (M, K) and loops over N (BN).
    SWAP=1 (the weight tile as the A operand of wgmma, converted from the load layout with
    STS.128 + LDSM) is the fast path; a few non-swapped mma.sync tiles stay as a comparison.
    Non-swapped tiles stay at BM <= 32: with wgmma, Triton 3.6 fails to compile them."""
    if kind == "fwd":
        if M <= 16:
            return [(16, bn, bk, 1, w, st) for bn, bk, w, st in ((64, 128, 4, 4), (64, 256, 4, 4), (128, 128, 4, 4),
                                                                  (128, 256, 4, 3), (64, 512, 4, 3), (128, 128, 8, 4),
                                                                  (256, 128, 8, 3), (128, 64, 4, 6))] + \
                   [(16, 32, 256, 0, 4, 4), (16, 128, 128, 0, 4, 4)]
        if M <= 64:
            return [(bm, bn, bk, 1, w, st) for bm in (32, 64) for bn, bk, w, st in
                    ((64, 128, 4, 4), (128, 128, 4, 4), (128, 256, 4, 3), (256, 128, 8, 3))] + [(32, 64, 256, 0, 4, 4)]
        if M <= 512:
            return [(64, 128, 128, 1, 4, 4), (128, 128, 64, 1, 8, 4), (128, 128, 128, 1, 8, 3), (64, 256, 64, 1, 8, 4)]
        # the full v2 search (NVIDIA_H200_tune_7B_32B.csv [ea84b65]) always chose 256x128x64: it and
        # one runner-up stay as the comparison for the dequantize + cuBLAS path
        return [(256, 128, 64, 1, 8, 3), (128, 256, 64, 1, 8, 3)]
    if M <= 16:
        return [(16, bn, bk, 1, 4, st) for bn, bk, st in ((64, 128, 4), (128, 128, 4), (64, 64, 5), (128, 64, 4))] + \
               [(16, 128, 64, 0, 4, 4)]
    if M <= 64:
        return [(32, 128, 64, 0, 4, 4), (64, 64, 128, 1, 4, 4), (64, 128, 128, 1, 4, 3), (32, 64, 128, 1, 4, 4)]
    if M <= 512:
        return [(128, 64, 128, 1, 8, 3), (128, 128, 128, 1, 8, 3), (64, 64, 256, 1, 4, 4)]
    return [(256, 64, 128, 1, 8, 3), (128, 128, 128, 1, 8, 3)]  # v2 search winner + runner-up


def _decode_paths(M: int, N: int, K: int, sms: int) -> list[dict]:
    """Forward decode candidates off the tensor-core tiles: the register-fragment MMA kernel
    (``MMV``: 16 x RB weight rows per warp, 8-32 activation rows per program) and the CUDA-core ``GEMV``."""
    out = []
    if K % 32 == 0:
        bms = (8,) if M <= 8 else ((8, 16) if M <= 16 else (16, 32))
        for bm, (rb, warps) in itertools.product(bms, ((1, 2), (1, 4), (1, 8), (2, 2), (2, 4))):
            bn = 16 * rb * warps  # RB 2: two blocks of 16 weight rows per warp (v6 sweep: 2-warp programs won)
            tiles_out = -(-M // bm) * -(-N // bn)
            loop = -(-K // 128)
            # small programs: several are resident per SM, so aim at 2..16 programs per SM
            splits = sorted({max(1, min(loop // 2, (w * sms) // tiles_out)) for w in (2, 4, 8, 16)})
            for split in splits:
                for pre in (1, 2):  # register prefetch depth
                    for xpre in ((1, 0) if rb == 1 else (0,)):  # activations prefetched / loaded at use
                        cfg = dict(MMV=1, BM=bm, BN=bn, BK=128, SPLIT=split, num_warps=warps, num_stages=pre,
                                   XPRE=xpre, RB=rb)
                        out.append(cfg)
                        if M > 8 and pre == 1 and xpre == 0 and (2 * K) % 128 == 0:
                            # activations copied to a row stride off the 128-byte multiple (L1 banks; v6 sweep:
                            # up to 19% on gate/up, a loss on small shapes): the tuner decides per key
                            out.append({**cfg, "XPAD": 1})
    if M <= 4:
        bm = 1 if M == 1 else (2 if M == 2 else 4)
        for bn, bk, st in ((64, 128, 1), (128, 256, 1), (64, 256, 3)):
            tiles_out = -(-N // bn)
            for split in _split_options(tiles_out, -(-K // bk), sms):
                out.append(dict(GEMV=1, BM=bm, BN=bn, BK=bk, SPLIT=split, num_warps=4, num_stages=st))
    return out


def _wgmma_paths(M: int, N: int, K: int, sms: int) -> list[dict]:
    """Forward, K % 128 == 0: the warpgroup-MMA kernel (``WGMMA``). M <= 4: a lean set (one BT = 8 tile, 2 | 3
    ring stages, 3 splits, staged ``XS`` or pre-permuted). M > 4: 1 | 2 warpgroups, BT activation
    rows per program (pre-permuted: the in-kernel gather ``XG`` won no key of the first H100 search; BT down
    to M / 2 at M 17..64), the plain loop with 2 | 3 | 4 ring stages or the pipelined one (``PIPE``: next
    step's decode under this step's wgmma, the weights ``NSW`` steps ahead), two m64 weight tiles per
    warpgroup (``MT`` 2: the activation tile, read from L2 by every program, serves twice the rows), K split
    to ~2-3 programs per SM, half and twice that, 2 and 3; M > 128: :func:`_wgmma_large` (and up to M = 512
    the above with BT 64 | 128)."""
    out = []
    if K % 128:
        return out
    if M <= 4:  # one BT = 8 tile (rows masked), one warpgroup, the activations staged in the kernel (XS: no
        # pre-pass launch) or pre-permuted: it beats the decode kernel on the small projections (H100, 7B o M = 1:
        # 9.37 vs 9.93 us, NVIDIA_H100_80GB_HBM3_tune_wgmma_small.csv [ea84b65])
        tiles = -(-N // 64)
        s0 = max(1, min(K // 256, round(3 * sms / tiles)))
        for ns, split in itertools.product((2, 3), sorted({s0, max(1, s0 // 2), min(2 * s0, K // 256)})):
            cfg = dict(WGMMA=1, WG=1, BT=8, SPLIT=split, XG=0, NS=ns)
            out += [{**cfg, "XS": 1}, cfg]
        return out
    if M > 128:  # prefill / training sizes: large tiles (no split), the activations pre-permuted or gathered
        out = _wgmma_large(M)
        if M > 512:
            return out
    bts = {min(128, -(-M // 16) * 16) if M > 8 else 8} | ({64} if M > 32 else set())
    if 16 < M <= 64:  # two activation-row tiles (run back to back: the weights' second read hits L2), smaller
        bts.add(16 if M <= 32 else 32)  # accumulators and rings -> more programs per SM
    # PIPE: correct, but 10% slower (median of the best per key) in the H100 search that tried NSW 4 | 6 | 8
    # (NVIDIA_H100_80GB_HBM3_tune_wgmma_pipe.csv [ea84b65]): one candidate stays as the comparison
    loops = [dict(NS=2), dict(NS=3), dict(NS=4), dict(NS=3, PIPE=1, NSW=6)]
    for (wg, mt), bt, loop in itertools.product(((1, 1), (2, 1), (1, 2)), sorted(bts), loops):
        if mt == 2 and (bt > 64 or loop.get("PIPE")):  # two m64 tiles per warpgroup: registers allow BT <= 64
            continue
        tiles = -(-N // (64 * wg * mt)) * -(-M // bt)
        s0 = max(1, min(K // 256, round((3 if wg * mt == 1 else 2) * sms / tiles)))
        # and 2 | 3 (and 2 s0): the program count against the wave size (3-5 programs per SM; ncu on the
        # H100 at 7B gate/up M = 64, no split: 1.49 waves, DRAM 42% busy —
        # ncu_wgmma_m64_NVIDIA_H100_80GB_HBM3.txt [ea84b65]; split 2 was still slower there)
        for split in sorted({s0, max(1, s0 // 2), min(2 * s0, K // 256), min(2, K // 256), min(3, K // 256)}):
            if mt == 2 and bt > 32 and split > 1:  # the split-K epilogue would spill registers (compile test)
                continue
            cfg = dict(WGMMA=1, WG=wg, BT=bt, SPLIT=split, XG=0, **loop, **({"MT": 2} if mt == 2 else {}))
            if cfg not in out:
                out.append(cfg)
            # XS: activations staged in the kernel instead of the pre-pass launch (plain loop; wins at M <= 16, there
            # at every split: 7B down M = 8 on tiled weights with its adapter, staged at 14 splits 23.6 us against 26.3
            # at 7 and 25.2 pre-permuted at 14 — tune_tiled_m8_xs_splits_NVIDIA_H100_80GB_HBM3.csv, 2026-11-27)
            if M <= 64 and mt == 1 and not loop.get("PIPE") and loop["NS"] <= 3 and (split == s0 or M <= 16):
                out.append({**cfg, "XS": 1})
    return out


def _wgmma_large(M: int) -> list[dict]:
    """M > 128: two warpgroups (128 weight rows) x BT = 128 | 256 activation rows, 2-4 ring stages (BT = 256:
    3 stages take 219 KiB of shared memory), pre-permuted (``XG`` 0: one extra pass over x) or gathered
    in the kernel (``XG`` 1: 4-byte copies, no pass), and the pipelined decode at BT = 128."""
    out = [dict(WGMMA=1, WG=2, BT=256, NS=ns, SPLIT=1, XG=xg) for ns in (2, 3) for xg in (0, 1)]
    out += [dict(WGMMA=1, WG=2, BT=128, NS=ns, SPLIT=1, XG=xg) for ns in (3, 4) for xg in (0, 1)]
    out.append(dict(WGMMA=1, WG=2, BT=128, NS=3, SPLIT=1, XG=0, PIPE=1, NSW=6))
    return [c for c in out if M > 256 or c["BT"] == 128]


def _stream_k_paths(M: int) -> list[dict]:
    """M 17..512, K % 128 == 0: the warpgroup-MMA kernel on the stream-K schedule (``SK`` programs per SM share the
    (tile, K step) units evenly: no part-empty last wave). Its point is larger weight tiles — 128 or 256 rows (2 | 4
    warpgroups, or 2 m64 tiles each) read one activation tile from L2 where 64-row tiles read it 2-4 times; with
    one program per tile those leave most of a wave empty (7B gate/up at 256 rows: 148 tiles on 132 SMs)."""
    out = []
    for (wg, mt, bt), ns, sk in itertools.product(((4, 1, 64), (4, 1, 128), (2, 2, 64), (2, 1, 64), (2, 1, 128),
                                                   (1, 1, 64)), (2, 3, 4), (1, 2)):
        if bt > max(64, -(-M // 64) * 64) or (bt == 128 and ns == 4):  # (BT 128 x 4 stages: out of shared memory)
            continue
        out.append(dict(WGMMA=1, WG=wg, BT=bt, NS=ns, SPLIT=1, XG=0, SK=sk, **({"MT": 2} if mt == 2 else {})))
    return out


def _decode_sk_paths(M: int, N: int, K: int, sms: int) -> list[dict]:
    """M <= 16, K % 128 == 0: the decode sizes on schedules that fill every SM whatever the tile count — the staged
    warpgroup-MMA kernel (``XS``) on the stream-K schedule at 2-7 programs per SM (the split-K grids leave 7B gate/up
    at 0.64 waves, ncu), and the warp-specialised kernel (bulk-copy producer, deeper rings) at BT = 8 | 16."""
    from qerl_kernels.nvfp4_wgmma_ws import ring_bytes

    if K % 128 or M > 16:
        return []
    bt = 8 if M <= 8 else 16
    out = [dict(WGMMA=1, WG=1, BT=bt, NS=2, SPLIT=1, XG=0, XS=1, SK=sk) for sk in range(2, 8)]
    out += [dict(WGMMA=1, WG=1, BT=bt, NS=3, SPLIT=1, XG=0, XS=1, SK=sk) for sk in (4, 7)]
    for c, mt, occ in ((1, 1, 2), (1, 1, 1), (2, 1, 1), (2, 1, 2), (4, 1, 1)):
        for ns in (4, 8):
            if ring_bytes(c, mt, bt, ns, R=128) * occ > 227 * 1024:
                continue
            base = dict(WGMMA=1, WS=1, C=c, MT=mt, BT=bt, NS=ns, OCC=occ)
            tiles = -(-N // (64 * c * mt))
            fill = max(1, min(K // 512, round(occ * sms / tiles)))
            v = {"TMA": 1} if c <= 2 else {}
            out.append({**base, **v, "SPLIT": 1, "SK": 1})
            out += [{**base, **v, "SPLIT": sp} for sp in sorted({1, fill})]
    return out


def _ws_paths(M: int, N: int, K: int, sms: int) -> list[dict]:
    """M 17..512, K % 128 == 0: the warp-specialised kernel (``WS``, :mod:`qerl_kernels.nvfp4_wgmma_ws`) — C consumer
    warpgroups of MT m64 tiles (64·C·MT weight rows per program over one activation tile of BT rows), OCC programs
    per SM, NS ring stages (within 227 KiB of shared memory per SM), on the stream-K schedule (``SK``) or split-K
    (the split that fills the SMs, and none); C = 1 | 2 also with the TMA producer (``TMA``); each step's decode
    under the previous step's wgmma (``DB``) where it compiles unserialised; C = 2 | 4 consumers splitting the K
    steps of one 64-row tile (``KS``)."""
    from qerl_kernels.nvfp4_wgmma_ws import ring_bytes

    out = []
    bts = (32,) if M <= 32 else (64,) if M <= 64 else (64, 128)
    for bt in bts:
        for c, mt, occ in ((1, 1, 2), (1, 1, 1), (1, 2, 1), (2, 1, 1), (4, 1, 1), (2, 2, 1)):
            if (c * mt > 2 or occ > 1) and bt > 64:  # (registers: 96 per consumer thread at C = 4)
                continue
            for ns in ((4, 6) if bt <= 64 else (3, 4)):
                if ring_bytes(c, mt, bt, ns, R=32) * occ > 227 * 1024:  # (with the LoRA-32 epilogue's xa tiles)
                    continue
                base = dict(WGMMA=1, WS=1, C=c, MT=mt, BT=bt, NS=ns, OCC=occ)
                tiles = -(-N // (64 * c * mt)) * -(-M // bt)
                fill = max(1, min(K // 512, round(occ * sms / tiles)))
                # TMA: bulk copies of the weights and x; DB: each step's decode under the previous step's wgmma,
                # where ptxas compiles it without serialising the wgmmas (two A operands live: C = 1 at one
                # program per SM, 248 registers — MT = 2 up to BT = 64; C = 2 at BT = 32), with TMA
                db = c == 1 and occ == 1 and (mt == 1 or bt <= 64) or c == 2 and mt == 1 and bt == 32
                plain = () if (c, occ) == (1, 1) else ({}, {"TMA": 1}) if c <= 2 else ({},)  # (1, 1): DB only
                for v in (({"TMA": 1, "DB": 1},) if db else ()) + plain:
                    out.append({**base, **v, "SPLIT": 1, "SK": 1})
                    out += [{**base, **v, "SPLIT": sp} for sp in sorted({1, fill})]
                if c > 1 and mt == 1 and ring_bytes(c, 1, bt, ns, R=32, KS=True) <= 227 * 1024:
                    # KS: the C consumers on the same 64 rows, K steps round-robin (few weight tiles: more
                    # decoders per tile, no split tickets); TMA at C = 2 (with DB at BT = 32), cp.async at C = 4
                    for v in (({"TMA": 1}, {}) + (({"TMA": 1, "DB": 1},) if bt == 32 else ())) if c == 2 else ({},):
                        out.append({**base, **v, "KS": 1, "SPLIT": 1})
    return out


def _dq_paths(M: int) -> list[dict]:
    """Dequantize windows of 8M / 32M / 64M / 128M weights (16-256 MiB of bf16 scratch) + cuBLAS."""
    return [dict(DQ=1, CHUNK=c) for c in (1 << 23, 1 << 25, 1 << 26, 1 << 27)] if M >= 64 else []


def candidates(kind: str, M: int, N: int, K: int, sms: int, paths: str = "all", current: dict | None = None) -> list[dict]:
    """Configs to time. ``paths='dq'``: only the dequantize + cuBLAS windows against ``current`` (the
    config in use now: tuned entry or heuristic), for adding the DQ path to a table that was searched
    before it existed."""
    if paths == "dq":
        return _dq_paths(M) + ([current] if current and current not in _dq_paths(M) else [])
    if paths == "wgmma":  # only the warpgroup-MMA kernel against the config in use now
        out = _wgmma_paths(M, N, K, sms) if kind == "fwd" else []
        out += _stream_k_paths(M) if kind == "fwd" and K % 128 == 0 and 16 < M <= 512 else []
        return out + ([current] if out and current and current not in out else [])
    if paths == "ws":  # only the warp-specialised kernel against the config in use now
        out = _ws_paths(M, N, K, sms) if kind == "fwd" and K % 128 == 0 and 16 < M <= 512 else []
        return out + ([current] if out and current and current not in out else [])
    if paths == "streamk":  # only the stream-K schedule against the config in use now
        out = _stream_k_paths(M) if kind == "fwd" and K % 128 == 0 and 16 < M <= 512 else []
        return out + ([current] if out and current and current not in out else [])
    if paths == "decode-sk":  # decode sizes on SM-filling schedules (stream-K, warp-specialised) against the current
        out = _decode_sk_paths(M, N, K, sms) if kind == "fwd" else []
        return out + ([current] if out and current and current not in out else [])
    if paths == "decode":  # only the decode kernels (MMV / GEMV) against the config in use now
        out = _decode_paths(M, N, K, sms) if kind == "fwd" and M <= 32 else []
        return out + ([current] if out and current and current not in out else [])
    out = _decode_paths(M, N, K, sms) if kind == "fwd" and M <= 32 else []
    out += _wgmma_paths(M, N, K, sms) if kind == "fwd" else []
    out += _stream_k_paths(M) if kind == "fwd" and K % 128 == 0 and 16 < M <= 512 else []
    for bm, bn, bk, swap, w, st in _tiles(kind, M):
        base = dict(BM=bm, BN=bn, BK=bk, SWAP=swap, num_warps=w, num_stages=st)
        loop = -(-(K if kind == "fwd" else N) // (bk if kind == "fwd" else bn))
        tiles_out = -(-M // bm) * -(-(N if kind == "fwd" else K) // (bn if kind == "fwd" else bk))
        for split in (_split_options(tiles_out, loop, sms) if M <= 512 else [1]):
            out.append({**base, "SPLIT": split})
    out += _dq_paths(M)
    h = ops.heuristic(kind, M, N, K, sms)
    if h not in out:
        out.append(h)
    return out


def _reference(kind, x, p, s, g):
    from qerl.quant import nvfp4

    w = nvfp4.dequantize(p, s, g, torch.float32)
    return (x.float() @ w.T) if kind == "fwd" else (x.float() @ w)


def _compile_key(kind: str, M: int, cfg: dict, lora: int = 0, K: int = 0, tiled: bool = False) -> tuple:
    """What decides the compiled kernel of a candidate (its constexprs and the specialisation of its
    arguments), as (kind, M to compile with, config, LoRA, stand-in K, tiled weights): N and K are divisible by 16 in
    every tuned shape, so a small stand-in shape compiles the same binary; XPAD changes the
    activations' row stride. ``lora``: also the rank-32 LoRA launch (fused into the decode kernel or
    not, which depends on M and on K > 8192: the real M and a K on the same side are kept)."""
    cfg = {k: v for k, v in cfg.items() if k != "EAGER"}  # the graph-mode config is what a candidate runs
    m = 1 if M == 1 else min(M, int(cfg.get("BM", 16)))
    if lora:
        m = M
    cfg = {**cfg, "SPLIT": min(2, int(cfg.get("SPLIT", 1)))}  # the binary only knows split or not
    return kind, max(m, 2) if cfg.get("XPAD") else m, json.dumps(cfg, sort_keys=True), int(lora), \
        8448 if lora and K > 8192 else 1024, bool(tiled)


def _compile(job: tuple) -> str | None:
    """Worker: run one candidate once on a stand-in problem (N 256), filling Triton's on-disk cache;
    the error text if it does not compile."""
    kind, M, cfg_json, lora, K, tiled = job
    from qerl.quant import nvfp4
    from qerl_kernels import layout

    os.environ["QERL_KERNEL_CONFIG"] = cfg_json
    try:
        w = nvfp4.quantize(torch.randn(256, K, device="cuda", dtype=torch.bfloat16))
        if tiled:
            w = (*layout.tile(w[0], w[1]), w[2])
        x = torch.randn(M, K if kind == "fwd" else 256, device="cuda", dtype=torch.bfloat16)
        if kind == "fwd":
            ops.nvfp4_matmul(x, *w, tiled=tiled)
            if lora:
                la = torch.randn(lora, K, device="cuda", dtype=torch.bfloat16)
                ops.nvfp4_matmul(x, *w, None, None, torch.randn(256, lora, device="cuda", dtype=torch.bfloat16),
                                 2.0, lora_a=la, tiled=tiled)
        else:
            ops.nvfp4_matmul_t(x, *w, tiled=tiled)
        torch.cuda.synchronize()
        return None
    except Exception as e:  # noqa: BLE001 - reported; the timing loop skips it again
        return repr(e)[:80]


def precompile(jobs: list[tuple], workers: int, progress: bool = True) -> int:
    """Compile every distinct candidate of ``jobs`` ((kind, M, config[, lora, K, tiled]) tuples) in ``workers``
    processes before the (serial) timing loop: Triton compiles one kernel per process at a time, and
    the decode search over the Qwen2.5 shapes has ~170 distinct kernels (minutes of one CPU core).
    Returns how many failed to compile."""
    import multiprocessing as mp

    from tqdm.auto import tqdm

    todo = sorted({_compile_key(*job) for job in jobs if not job[2].get("DQ")})
    if workers <= 1 or len(todo) < 2:
        return 0
    with mp.get_context("spawn").Pool(min(workers, len(todo))) as pool:
        errs = list(tqdm(pool.imap_unordered(_compile, todo), total=len(todo), desc="compile", disable=not progress))
    return sum(e is not None for e in errs)


def _current(paths: str, device: str, kind: str, M: int, N: int, K: int, sms: int) -> dict | None:
    """The config in use now, which the restricted searches time against: ``decode`` — the tuned entry,
    else the transferred one, else the heuristic; ``dq`` — the tuned Triton entry, else the Triton-only heuristic."""
    if paths in ("decode", "wgmma", "streamk", "ws", "decode-sk"):
        cur = ops.table_entry(device, kind, M, N, K, sms) or ops.heuristic(kind, M, N, K, sms)
        cur.pop("EAGER", None)  # the graph-mode config (keep_eager carries EAGER over)
        return cur
    if paths == "dq":
        current = ops.tuned_entry(device, kind, M, N, K)
        return current if current and not current.get("DQ") else ops.heuristic(kind, M, N, K, sms, dq=False)
    return None


def tiled_candidates(kind: str, M: int, N: int, K: int, sms: int, cands: list[dict]) -> list[dict]:
    """The candidates that run as they are on tiled weights (:func:`qerl_kernels.ops.tiled_config` keeps them:
    the plain warpgroup-MMA loop, the warp-specialised kernel, DQ, the tiles); none without whole tiles."""
    if N % 64 or K % 128:
        return []
    return [c for c in cands if ops.tiled_config(kind, c, M, N, K, sms) == c]


def tune_all(shapes, ms, progress: bool = True, csv_path: Path | None = None, kinds=("fwd", "bwd"),
             paths: str = "all", workers: int = 0, lora: int = 0, tiled: bool = False) -> Path:
    """Time every candidate of every (kind, M, N, K) in CUDA graphs (``launch_mode("graph")``) and write the
    fastest into ``qerl_kernels/tuned/<device>.json`` (:func:`keep_eager` at decode sizes). ``lora``: time the forward
    calls with a rank-``lora`` adapter on them (``lora_a`` / ``lora_b``, as the rollout engine calls every
    projection), so that the LoRA route each candidate takes (fused into the decode kernel, or the PDL primary in
    front of the MMA kernels) is part of its time. ``tiled``: every candidate timed on tiled weights
    (:mod:`qerl_kernels.layout`, as the rollout engine decodes, ``weight_layout``), only those that read the layout
    as they are (:func:`tiled_candidates`)."""
    with ops.launch_mode("graph"):
        return _tune_all(shapes, ms, progress, csv_path, kinds, paths, workers, lora, tiled)


def _rank(lora, N: int, K: int) -> int:
    """The LoRA rank a forward candidate of (N, K) is timed with: ``lora`` itself, or its entry for (N, K) when it
    is a dict (``--lora engine``: each projection at the rank the rollout engine calls it with)."""
    return int(lora.get((N, K), 0)) if isinstance(lora, dict) else int(lora)


def engine_ranks(model: str, r: int = 32) -> dict:
    """``{(N, K): rank}`` of ``model``'s projections as the rollout engine calls them with rank-``r`` adapters on all
    seven: q/k/v fused (3r) and gate/up fused (2r), each zero-padded to a power of two >= 16
    (:class:`qerl.rollout.engine.model_view.Proj`); o and down at r."""
    from qerl.models.shapes import projections
    from qerl.rollout.engine.model_view import padded_rank

    parts = {"qkv": 3, "o": 1, "gate_up": 2, "down": 1}
    return {nk: padded_rank(parts[name] * r) for name, nk in projections(model).items()}


def _tune_all(shapes, ms, progress, csv_path, kinds, paths, workers, lora=0, tiled=False) -> Path:
    from tqdm.auto import tqdm

    from qerl.quant import nvfp4
    from qerl_kernels import layout
    from qerl.bench.timing import graph_time as _graph_time

    device = torch.cuda.get_device_name()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    path = ops.table_path(device)  # the package's table, or $QERL_TUNED_DIR's where set (ops.table_dirs)
    table = json.loads(path.read_text()) if path.exists() else {}
    jobs = [(kind, M, N, K) for (N, K) in dict.fromkeys(shapes) for M in ms for kind in kinds]
    log = []
    weights: dict = {}
    def cands(kind, M, N, K):
        out = candidates(kind, M, N, K, sms, paths, _current(paths, device, kind, M, N, K, sms))
        return tiled_candidates(kind, M, N, K, sms, out) if tiled else out

    if workers > 1:
        planned = [(kind, M, c, _rank(lora, N, K) if kind == "fwd" else 0, K, tiled) for kind, M, N, K in jobs
                   for c in cands(kind, M, N, K)]
        bad = precompile(planned, workers, progress)
        print(json.dumps({"precompiled": len({_compile_key(*j) for j in planned}), "failed": bad}), flush=True)
    for kind, M, N, K in tqdm(jobs, desc="tune", disable=not progress):
        key = f"{kind}:{ops.m_bucket(M)}:{N}:{K}"
        if (N, K) not in weights:
            weights.clear()
            copies = max(2, min(8, (256 * 2 ** 20) // (N * K // 2) + 1))  # rotate past the L2
            weights[(N, K)] = [nvfp4.quantize(torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02)
                               for _ in range(copies)]
        ws = weights[(N, K)]
        x = torch.randn(M, K if kind == "fwd" else N, device="cuda", dtype=torch.bfloat16)
        ref = _reference(kind, x, *ws[0])
        base = ops.nvfp4_matmul if kind == "fwd" else ops.nvfp4_matmul_t
        op = (lambda x_, *w: base(x_, *w, tiled=True)) if tiled else base
        rank = _rank(lora, N, K)
        if rank and kind == "fwd":  # the call as the engine makes it: y = x Ŵᵀ + 2 · (x Aᵀ) Bᵀ
            la = torch.randn(rank, K, device="cuda", dtype=torch.bfloat16) * 0.02
            lb = torch.randn(N, rank, device="cuda", dtype=torch.bfloat16) * 0.02
            ref = ref + 2.0 * ((x @ la.T).float() @ lb.float().T)
            op = (lambda x_, *w, la=la, lb=lb: ops.nvfp4_matmul(x_, *w, None, None, lb, 2.0, lora_a=la, tiled=tiled))
        wq = [(*layout.tile(p, s), g) for p, s, g in ws] if tiled else ws  # (the reference: ws[0], row-major)
        dense = [nvfp4.dequantize(*w, torch.bfloat16) for w in ws[:max(2, min(4, 2 ** 28 // (N * K * 2) + 1))]]
        f_dense = (lambda w: torch.nn.functional.linear(x, w)) if kind == "fwd" else (lambda w: x @ w)
        t_cublas = _graph_time([lambda w=w: f_dense(w) for w in dense], reps=9)
        del dense
        best, best_decode = None, None  # best_decode: the fastest single-launch decode config (EAGER fallback)
        for cfg in cands(kind, M, N, K):
            os.environ["QERL_KERNEL_CONFIG"] = json.dumps(cfg)  # overrides every key of config_for's choice
            err, t = float("nan"), float("inf")
            try:
                y = op(x, *wq[0])
                err = float((y.float() - ref).norm() / ref.norm())
                if err < 1e-2:
                    t = _graph_time([lambda w=w: op(x, *w) for w in wq], reps=9)
            except Exception as e:  # a config that does not compile (e.g. out of shared memory)
                err = repr(e)[:80]
            finally:
                os.environ.pop("QERL_KERNEL_CONFIG", None)
            log.append({"device": device, "kind": kind, "M": M, "N": N, "K": K, "lora": rank if kind == "fwd" else 0,
                        "tiled": int(tiled), **cfg, "us": t * 1e6,
                        "cublas_us": t_cublas * 1e6, "speedup": t_cublas / t, "rel_err": err})
            if best is None or t < best[0]:
                best = (t, cfg)
            if (cfg.get("MMV") or cfg.get("GEMV")) and t < float("inf") and (best_decode is None or t < best_decode[0]):
                best_decode = (t, cfg)
        if best is not None and best[0] < float("inf"):
            table[key] = keep_eager(table.get(key), best[1], M, best_decode[1] if best_decode else None)
            if progress is False:
                print(f"{key}: {best[0] * 1e6:.1f} us, cuBLAS {t_cublas * 1e6:.1f} us, "
                      f"{t_cublas / best[0]:.2f}x  {best[1]}", flush=True)
        # after every key, atomically: a cut-off run keeps its work, one killed while writing the previous table
        write_text_atomic(path, json.dumps(table, indent=0, sort_keys=True))
        if csv_path is not None:
            _write_csv(log, csv_path)
    ops._tables.cache_clear()
    ops._transfer.cache_clear()
    return path


def keep_eager(prev: dict | None, best: dict, M: int, decode: dict | None = None) -> dict:
    """The table entry for a search's winner: at decode sizes (M <= 16) a warpgroup-MMA winner keeps a
    single-launch decode kernel's config for eager calls (``EAGER``, see :func:`qerl_kernels.ops.launch_mode`)
    — the previous entry's ``EAGER``, the previous entry itself when it was a decode-kernel config, else
    ``decode`` (the fastest decode config this search timed)."""
    best = {k: v for k, v in best.items() if k != "EAGER"}
    if not best.get("WGMMA") or M > 16:
        return best
    prev = prev or {}
    eager = prev.get("EAGER") or (prev if prev.get("MMV") or prev.get("GEMV") else None) or decode
    return {**best, "EAGER": dict(eager)} if eager else best


def _write_csv(rows, path: Path) -> None:
    import csv

    keys = list(dict.fromkeys(k for r in rows for k in r))
    with atomic_open(path, newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)


def main(argv=None) -> int:
    from qerl.models.shapes import MODELS_HELP, model_arg, projections

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="*", default=["7B"], type=model_arg, metavar="MODEL", help=MODELS_HELP)
    p.add_argument("--projs", nargs="*", default=None, help="subset of qkv o gate_up down")
    p.add_argument("--ms", nargs="*", type=int, default=[1, 16, 64, 2048])
    p.add_argument("--kinds", nargs="*", default=["fwd", "bwd"], choices=["fwd", "bwd"])
    p.add_argument("--csv", default=None, help="write every measurement here")
    p.add_argument("--paths", default="all", choices=["all", "dq", "decode", "wgmma", "streamk", "ws", "decode-sk"],
                   help="all: every candidate; dq: the dequantize + cuBLAS windows against the config in use now; "
                        "decode: the decode kernels (forward, M <= 32) against the config in use now; "
                        "wgmma: the warpgroup-MMA kernel (forward) against the config in use now; "
                        "streamk: its stream-K schedule (forward, M 17..512) against the config in use now; "
                        "ws: the warp-specialised kernel (forward, M 17..512) against the config in use now; "
                        "decode-sk: the decode sizes (forward, M <= 16) on the stream-K schedule and the "
                        "warp-specialised kernel against the config in use now")
    p.add_argument("--workers", type=int, default=0,
                   help="compile the candidates in this many processes first (0/1: compile while timing)")
    p.add_argument("--lora", default="0", metavar="R",
                   help="time the forward candidates with a rank-R LoRA adapter on the call (as the rollout engine "
                        "calls every projection); 0: without; 'engine': each projection at the rank the engine "
                        "calls it with for rank-32 adapters (fused q/k/v: 128, gate/up: 64, o and down: 32)")
    p.add_argument("--tiled", action="store_true",
                   help="time the candidates on weights in the tile-contiguous layout (as the rollout engine decodes, "
                        "its weight_layout), only those that read it as they are; the winner replaces the entry even "
                        "where the current one (e.g. MMV, which reads row-major only) is not among them")
    p.add_argument("--no-progress", action="store_true")
    a = p.parse_args(argv)
    if a.lora == "engine":
        lora = {nk: r for m in a.models for nk, r in engine_ranks(m).items()}
    elif a.lora.isdigit():
        lora = int(a.lora)
    else:
        p.error(f"--lora: expected a rank or 'engine', got {a.lora!r}")
    shapes = [nk for m in a.models for name, nk in projections(m).items() if a.projs is None or name in a.projs]
    path = tune_all(shapes, a.ms, progress=not a.no_progress, csv_path=Path(a.csv) if a.csv else None,
                    kinds=tuple(a.kinds), paths=a.paths, workers=a.workers, lora=lora, tiled=a.tiled)
    print(json.dumps({"tuned": str(path)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
