"""Correctness check of the NVFP4 kernels against the pure-torch reference (qerl.ops.linear).

``python -m qerl.bench.kernels_check [--quick] [--only-forced KEY | --part routed|forced|dequant|tiled] [--json OUT]`` runs forward and
backward (with and without bias / LoRA) on odd shapes and every M bucket — and the same calls on weights in the
tile-contiguous layout (``tiled``) — on CUDA if present, else under ``TRITON_INTERPRET=1`` on CPU (small shapes).
Exits non-zero on any failure.

Tolerance (relative Frobenius error vs the reference computed in fp32 from the same bf16
dequantized weight): forward/backward 5e-3 on CUDA (bf16 MMA inputs are exact, fp32 accumulation
order differs), 1e-2 under the interpreter (its fp32 -> bf16 casts truncate).
"""
import argparse
import json
import sys

import torch

from qerl.files import atomic_open


def _ref_fwd(x, packed, scale, gs, bias, xa, lb, s):
    from qerl.quant.nvfp4 import dequantize

    w = dequantize(packed, scale, gs, torch.float32)  # rounds like bf16 below
    w = w.to(torch.bfloat16).float()
    y = x.float() @ w.T
    if bias is not None:
        y = y + bias.float()
    if xa is not None:
        y = y + s * (xa.float() @ lb.float().T)
    return y


def _ref_bwd(dy, packed, scale, gs, dyb, la, s):
    from qerl.quant.nvfp4 import dequantize

    w = dequantize(packed, scale, gs, torch.float32).to(torch.bfloat16).float()
    dx = dy.float() @ w
    if dyb is not None:
        dx = dx + s * (dyb.float() @ la.float())
    return dx


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30))


# Forced tile configs (QERL_KERNEL_CONFIG) so that every code path is checked, not only the ones the
# heuristic or tuned table pick: split reduction, swapped operands (wgmma), masked K tails, the
# register-fragment decode kernel (MMV; K % 128 != 0 tail on (100, 352); RB 2: two blocks of 16 weight
# rows per warp sharing the activation fragments, a partial second block on N = 130 / 100) and the CUDA-core GEMV.
FORCED = {
    "fwd": [dict(BM=16, BN=64, BK=256, SWAP=0, SPLIT=3, num_warps=4, num_stages=4),
            dict(BM=16, BN=64, BK=128, SWAP=1, SPLIT=2, num_warps=4, num_stages=4),
            dict(BM=64, BN=128, BK=128, SWAP=1, SPLIT=1, num_warps=4, num_stages=4),
            dict(BM=128, BN=128, BK=64, SWAP=1, SPLIT=1, num_warps=8, num_stages=3),
            dict(MMV=1, BM=8, BN=64, BK=128, SPLIT=1, num_warps=4, num_stages=1),
            dict(MMV=1, BM=8, BN=32, BK=128, SPLIT=3, num_warps=2, num_stages=1, XPRE=0),
            dict(MMV=1, BM=16, BN=128, BK=128, SPLIT=2, num_warps=8, num_stages=2),
            dict(MMV=1, BM=64, BN=64, BK=128, SPLIT=2, num_warps=4, num_stages=1, XPRE=0),
            dict(MMV=1, BM=32, BN=128, BK=128, SPLIT=1, num_warps=8, num_stages=2, XPRE=0),
            dict(MMV=1, BM=8, BN=128, BK=128, SPLIT=1, num_warps=4, num_stages=2, RB=2),
            dict(MMV=1, BM=16, BN=32, BK=128, SPLIT=2, num_warps=2, num_stages=2, XPRE=0, XPAD=1),
            dict(MMV=1, BM=16, BN=64, BK=128, SPLIT=3, num_warps=2, num_stages=1, XPRE=0, RB=2),
            dict(MMV=1, BM=32, BN=256, BK=128, SPLIT=2, num_warps=8, num_stages=1, XPRE=0, RB=2),
            dict(GEMV=1, BM=4, BN=64, BK=128, SPLIT=2, num_warps=4, num_stages=1),
            dict(GEMV=1, BM=1, BN=128, BK=256, SPLIT=1, num_warps=4, num_stages=3),
            dict(DQ=1, CHUNK=4096), dict(DQ=1, CHUNK=0),
            # warpgroup MMA (K % 128 == 0 shapes; the others step down): pre-permuted / gathered activations,
            # two warpgroups, two m64 tiles per warpgroup, the pipelined loop; LoRA in its epilogue
            dict(WGMMA=1, WG=1, BT=32, NS=3, SPLIT=2, XG=0), dict(WGMMA=1, WG=2, BT=16, NS=4, SPLIT=3, XG=1),
            dict(WGMMA=1, WG=1, BT=64, NS=3, SPLIT=1, XG=0, MT=2),
            dict(WGMMA=1, WG=1, BT=64, NS=3, SPLIT=2, XG=0, PIPE=1, NSW=6),
            dict(WGMMA=1, WG=1, BT=16, NS=3, SPLIT=2, XG=0, XS=1), dict(WGMMA=1, WG=2, BT=32, NS=2, SPLIT=1, XG=0, XS=1),
            dict(WGMMA=1, WG=1, BT=8, NS=2, SPLIT=3, XG=0, XS=1),  # the M <= 8 tile
            # the stream-K schedule: 256 / 128 / 64 weight rows, partial tiles summed by the last share
            dict(WGMMA=1, WG=4, BT=64, NS=3, SPLIT=1, XG=0, SK=1), dict(WGMMA=1, WG=2, BT=64, NS=2, SPLIT=1, XG=0,
                                                                          MT=2, SK=2),
            dict(WGMMA=1, WG=1, BT=32, NS=3, SPLIT=1, XG=0, SK=2), dict(WGMMA=1, WG=4, BT=128, NS=2, SPLIT=1, XG=0,
                                                                           SK=1)],
    "bwd": [dict(BM=16, BN=128, BK=64, SWAP=0, SPLIT=3, num_warps=4, num_stages=4),
            dict(BM=64, BN=64, BK=128, SWAP=1, SPLIT=1, num_warps=4, num_stages=4),
            dict(BM=128, BN=64, BK=128, SWAP=1, SPLIT=2, num_warps=8, num_stages=3),
            dict(DQ=1, CHUNK=2048), dict(DQ=1, CHUNK=0)],
}


def run_dequant(device: str, shapes) -> list[dict]:
    """The dequantization kernel against :func:`qerl.quant.nvfp4.dequantize`, bit for bit (bf16, fp16;
    whole tensors and an interior row x column window). Under the interpreter bf16 goes through the
    fp32 window (its casts truncate), so every dtype is exact there too."""
    import os

    from qerl.quant import nvfp4
    from qerl_kernels.nvfp4_dequant import _dequant

    interp = os.environ.get("TRITON_INTERPRET", "0") == "1"
    rows = []
    g = torch.Generator().manual_seed(1)
    for (N, K) in shapes:
        packed, scale, gs = (t.to(device) for t in nvfp4.quantize(torch.randn(N, K, generator=g) * 0.02))
        for dt in (torch.bfloat16, torch.float16):
            ref = nvfp4.dequantize(packed, scale, gs, dt)
            full = _dequant(torch.empty(N, K, device=device, dtype=dt), packed, scale.view(torch.uint8), gs, interp)
            n0, n1, k0, k1 = N // 3, N - N // 4, 16 * (K // 48), K - 16 * (K // 64)
            win = _dequant(torch.empty(n1 - n0, k1 - k0, device=device, dtype=dt), packed[n0:n1, k0 // 2:k1 // 2],
                           scale.view(torch.uint8)[n0:n1, k0 // 16:k1 // 16], gs, interp)
            ok = torch.equal(full.view(torch.int16), ref.view(torch.int16)) and \
                torch.equal(win.view(torch.int16), ref[n0:n1, k0:k1].view(torch.int16))
            rows.append({"check": "dequant_bitexact", "N": N, "K": K, "dtype": str(dt).split(".")[-1],
                         "fwd_rel_err": _rel(full, ref), "bwd_rel_err": _rel(win, ref[n0:n1, k0:k1]), "ok": ok})
    return rows


def run_forced(device: str, shapes, ms, tol: float, only: str | None = None) -> list[dict]:
    """Each forced config on each shape / M, forward and backward (with bias and rank-8 LoRA);
    ``only``: just the configs with that key (e.g. ``WGMMA``)."""
    import os

    rows = []
    for kind in ("fwd", "bwd"):
        for cfg in (c for c in FORCED[kind] if only is None or c.get(only)):
            os.environ["QERL_KERNEL_CONFIG"] = json.dumps(cfg)
            print(f"forced {kind} {cfg}", file=sys.stderr, flush=True)  # progress (and where a hang would be)
            try:
                for r in run(device, shapes, ms, tol, kinds=(kind,)):
                    rows.append({**r, "config": cfg})
            finally:
                os.environ.pop("QERL_KERNEL_CONFIG", None)
    return rows


def _routes(x, dy, packed, scale, device: str) -> dict:
    """The path each kind ran and where its config came from (tuned / transfer:NxK / heuristic)."""
    from qerl_kernels import ops

    M, N, K = x.shape[0], packed.shape[0], packed.shape[1] * 2
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    sms = torch.cuda.get_device_properties(0).multi_processor_count if device == "cuda" else 132
    return {f"{kind}_path": ops.route_of(kind, t, packed, scale)[0] + " (" + ops.config_source(name, kind, M, N, K, sms)
            + ")"
            for kind, t in (("fwd", x), ("bwd", dy))}


def run(device: str, shapes, ms, tol: float, kinds=("fwd", "bwd")) -> list[dict]:
    from qerl.quant import nvfp4
    from qerl_kernels import ops
    from qerl_kernels.ops import nvfp4_matmul, nvfp4_matmul_t

    rows = []
    g = torch.Generator().manual_seed(0)
    for (N, K) in shapes:
        w = torch.randn(N, K, generator=g) * 0.02
        packed, scale, gs = (t.to(device) for t in nvfp4.quantize(w))
        bias = (torch.randn(N, generator=g) * 0.1).to(device, torch.bfloat16)
        for M in ms:
            # 32: two k16 MMAs in the decode epilogue; 128 / 64: the engine's fused q/k/v and gate/up ranks (the PDL
            # primary in rank chunks of 32, ops.xa_rank_chunk)
            for lora_r in ((0, 8, 32, 128) if M <= 16 else (0, 8, 64)):
                x = torch.randn(M, K, generator=g).to(device, torch.bfloat16)
                dy = torch.randn(M, N, generator=g).to(device, torch.bfloat16)
                xa = lb = dyb = la = None
                if lora_r:
                    xa = torch.randn(M, lora_r, generator=g).to(device, torch.bfloat16)
                    lb = (torch.randn(N, lora_r, generator=g) * 0.1).to(device, torch.bfloat16)
                    dyb = torch.randn(M, lora_r, generator=g).to(device, torch.bfloat16)
                    la = (torch.randn(lora_r, K, generator=g) * 0.1).to(device, torch.bfloat16)
                fe = be = 0.0
                ok = True
                if "fwd" in kinds:
                    y = nvfp4_matmul(x, packed, scale, gs, bias, xa, lb, 0.5)
                    fe = _rel(y, _ref_fwd(x, packed, scale, gs, bias, xa, lb, 0.5))
                    ok = ok and fe < tol and bool(torch.isfinite(y).all())
                    for route in (("auto", "pdl", "inkernel") if lora_r else ()):  # x · lora_aᵀ computed by
                        # the op: as ops.lora_route picks, the PDL launch pair forced wherever it can run, and the
                        # Triton tile computing it in its own launch (ops.lora_inkernel with both bounds lifted:
                        # every M, a BM = 16 tile at M <= 16)
                        ops.LORA_LAUNCH = "auto" if route == "inkernel" else route
                        bounds = ops.LORA_INKERNEL_FLOPS, ops.LORA_INKERNEL_DECODE_WEIGHTS
                        if route == "inkernel":
                            ops.LORA_INKERNEL_FLOPS = ops.LORA_INKERNEL_DECODE_WEIGHTS = float("inf")
                        try:
                            y = nvfp4_matmul(x, packed, scale, gs, bias, None, lb, 0.5, lora_a=la)
                        finally:
                            ops.LORA_LAUNCH = "auto"
                            ops.LORA_INKERNEL_FLOPS, ops.LORA_INKERNEL_DECODE_WEIGHTS = bounds
                        fe = max(fe, _rel(y, _ref_fwd(x, packed, scale, gs, bias, x @ la.T, lb, 0.5)))
                        ok = ok and fe < tol and bool(torch.isfinite(y).all())
                if "bwd" in kinds:
                    dx = nvfp4_matmul_t(dy, packed, scale, gs, dyb, la, 0.5)
                    be = _rel(dx, _ref_bwd(dy, packed, scale, gs, dyb, la, 0.5))
                    ok = ok and be < tol and bool(torch.isfinite(dx).all())
                rows.append({"M": M, "N": N, "K": K, "lora_r": lora_r, "fwd_rel_err": fe, "bwd_rel_err": be, "ok": ok,
                             **_routes(x, dy, packed, scale, device)})
            if M in (ms[0], ms[-1]):  # fp16 activations (the decode kernel must not read them as bf16)
                x = torch.randn(M, K, generator=g).to(device, torch.float16)
                dy = torch.randn(M, N, generator=g).to(device, torch.float16)
                fe = be = 0.0
                if "fwd" in kinds:
                    fe = _rel(nvfp4_matmul(x, packed, scale, gs), _ref_fwd(x, packed, scale, gs, None, None, None, 0.0))
                if "bwd" in kinds:
                    be = _rel(nvfp4_matmul_t(dy, packed, scale, gs), _ref_bwd(dy, packed, scale, gs, None, None, 0.0))
                rows.append({"M": M, "N": N, "K": K, "lora_r": 0, "dtype": "fp16", "fwd_rel_err": fe,
                             "bwd_rel_err": be, "ok": fe < tol and be < tol})
    return rows


# Forced warp-specialised configs on tiled weights (both producers; split-K, stream-K, K over the consumers, the
# double-buffered consumer, two m64 tiles per consumer): N = 320 leaves the last 128- / 256-row program part empty.
TILED_FORCED = [dict(WGMMA=1, WS=1, C=2, MT=1, BT=64, NS=4, SPLIT=2),
                dict(WGMMA=1, WS=1, C=2, MT=1, BT=64, NS=4, SPLIT=1, TMA=1),
                dict(WGMMA=1, WS=1, C=1, MT=1, BT=128, NS=3, SK=1, TMA=1),
                dict(WGMMA=1, WS=1, C=2, MT=1, BT=64, NS=6, SPLIT=2, KS=1, TMA=1),
                dict(WGMMA=1, WS=1, C=1, MT=1, BT=64, NS=6, SPLIT=1, DB=1, TMA=1),
                dict(WGMMA=1, WS=1, C=4, MT=1, BT=64, NS=4, SPLIT=1, KS=1),
                dict(WGMMA=1, WS=1, C=1, MT=2, BT=64, NS=4, SPLIT=3, TMA=1),
                dict(WGMMA=1, WG=1, BT=8, NS=3, SK=2, XG=0, XS=1),  # the plain loop's stream-K
                dict(WGMMA=1, WG=2, BT=16, NS=3, SK=1, XG=0)]


def run_tiled(device: str, shapes, ms, tol: float, forced: bool = False) -> list[dict]:
    """The routed calls on weights in the tile-contiguous layout (``tiled=True``, :mod:`qerl_kernels.layout`; the
    shapes with whole 64-row tiles and 128-wide K steps): forward with bias, with ``xa`` and with ``lora_a``, and the
    backward with its LoRA term, each against the row-major reference (``layout`` column ``tiled``). ``forced``:
    also the forward of each :data:`TILED_FORCED` config (GPU)."""
    import os

    from qerl.quant import nvfp4
    from qerl_kernels import layout
    from qerl_kernels.ops import nvfp4_matmul, nvfp4_matmul_t

    rows = []
    g = torch.Generator().manual_seed(1)
    for (N, K) in shapes:
        if N % 64 or K % 128:
            continue
        packed, scale, gs = (t.to(device) for t in nvfp4.quantize(torch.randn(N, K, generator=g) * 0.02))
        tp, ts = layout.tile(packed, scale)
        bias = (torch.randn(N, generator=g) * 0.1).to(device, torch.bfloat16)
        R = 32
        lb = (torch.randn(N, R, generator=g) * 0.1).to(device, torch.bfloat16)
        la = (torch.randn(R, K, generator=g) * 0.1).to(device, torch.bfloat16)
        for M in ms:
            x = torch.randn(M, K, generator=g).to(device, torch.bfloat16)
            dy = torch.randn(M, N, generator=g).to(device, torch.bfloat16)
            xa = torch.randn(M, R, generator=g).to(device, torch.bfloat16)
            dyb = torch.randn(M, R, generator=g).to(device, torch.bfloat16)
            fe = max(_rel(nvfp4_matmul(x, tp, ts, gs, bias, tiled=True),
                          _ref_fwd(x, packed, scale, gs, bias, None, None, 0.0)),
                     _rel(nvfp4_matmul(x, tp, ts, gs, None, xa, lb, 0.5, tiled=True),
                          _ref_fwd(x, packed, scale, gs, None, xa, lb, 0.5)),
                     _rel(nvfp4_matmul(x, tp, ts, gs, None, None, lb, 0.5, lora_a=la, tiled=True),
                          _ref_fwd(x, packed, scale, gs, None, x @ la.T, lb, 0.5)))
            be = _rel(nvfp4_matmul_t(dy, tp, ts, gs, dyb, la, 0.5, tiled=True),
                      _ref_bwd(dy, packed, scale, gs, dyb, la, 0.5))
            rows.append({"M": M, "N": N, "K": K, "lora_r": R, "layout": "tiled", "fwd_rel_err": fe, "bwd_rel_err": be,
                         "ok": fe < tol and be < tol})
            for cfg in (TILED_FORCED if forced else ()):
                os.environ["QERL_KERNEL_CONFIG"] = json.dumps(cfg)
                try:
                    fe = max(_rel(nvfp4_matmul(x, tp, ts, gs, bias, tiled=True),
                                  _ref_fwd(x, packed, scale, gs, bias, None, None, 0.0)),
                             _rel(nvfp4_matmul(x, tp, ts, gs, None, xa, lb, 0.5, tiled=True),
                                  _ref_fwd(x, packed, scale, gs, None, xa, lb, 0.5)))
                finally:
                    os.environ.pop("QERL_KERNEL_CONFIG", None)
                rows.append({"M": M, "N": N, "K": K, "lora_r": R, "layout": "tiled", "config": cfg, "fwd_rel_err": fe,
                             "bwd_rel_err": 0.0, "ok": fe < tol})
    return rows


def _shape(text: str) -> tuple[int, int]:
    try:
        n, k = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise SystemExit(f"--shapes: {text!r} is not NxK (e.g. 6144x4096)") from None
    return n, k


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m qerl.bench.kernels_check", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="two small shapes instead of four (the routed part)")
    p.add_argument("--json", default=None, help="also write every checked row here")
    p.add_argument("--only-forced", default=None, metavar="KEY",
                   help="only the forced configs with this key (e.g. WGMMA), on the forced shapes")
    p.add_argument("--shapes", nargs="+", default=None, metavar="NxK",
                   help="the routed part on these weight shapes (N x K, e.g. 6144x4096: shapes without tuned entries "
                        "run borrowed configs, qerl_kernels.ops.transferred_entry) instead of its four")
    p.add_argument("--mode", default="eager", choices=["eager", "graph"],
                   help="the configs of calls launched one by one (eager, the default) or of CUDA-graph capture (graph: "
                        "the rollout engine's) for the routed part (qerl_kernels.ops.launch_mode)")
    p.add_argument("--part", default="all", choices=["all", "routed", "forced", "dequant", "tiled"],
                   help="one part of the full check (routed configs / forced configs / dequantization / the routed "
                        "calls on tiled weights), so that a device call with a time limit can run it in pieces; the "
                        "full check is their union")
    a = p.parse_args(argv)
    if torch.cuda.is_available() and a.only_forced:
        rows = run_forced("cuda", [(130, 272), (100, 352), (130, 512), (3584, 3584), (520, 18944)], [1, 3, 17, 100],
                          5e-3, only=a.only_forced)
    elif torch.cuda.is_available():
        shapes = [(48, 80), (130, 272), (3584, 3584), (512, 18944)] if not a.quick else [(48, 80), (130, 272)]
        if a.shapes:
            shapes = [_shape(s) for s in a.shapes]
        ms = [1, 2, 3, 8, 16, 17, 33, 64, 100, 256, 513, 2048]
        rows = []
        if a.part in ("all", "routed"):
            from qerl_kernels import ops

            with ops.launch_mode(a.mode):
                rows += run("cuda", shapes, ms, 5e-3)
        if a.part in ("all", "forced"):
            rows += run_forced("cuda", [(130, 272), (100, 352), (130, 512), (3584, 3584)], [1, 3, 17, 100], 5e-3)
        if a.part in ("all", "dequant"):
            rows += run_dequant("cuda", shapes)
        if a.part in ("all", "tiled"):
            rows += run_tiled("cuda", [(128, 256), (3584, 3584), (512, 18944), (4608, 3584)], ms, 5e-3)
            rows += run_tiled("cuda", [(320, 1024), (3584, 3584)], [17, 64, 256], 5e-3, forced=True)
    else:
        rows = run("cpu", [(48, 80), (40, 32)], [1, 5, 17], 1e-2) + run_dequant("cpu", [(48, 80), (40, 32)])
        rows += run_tiled("cpu", [(128, 256)], [1, 17], 1e-2)
    bad = [r for r in rows if not r["ok"]]
    if a.json:
        with atomic_open(a.json) as f:
            json.dump({"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu-interpreter",
                       "rows": rows}, f, indent=1)
    print(json.dumps({"checked": len(rows), "tiled": sum(r.get("layout") == "tiled" for r in rows), "failed": len(bad),
                      "max_fwd": max(r["fwd_rel_err"] for r in rows),
                      "max_bwd": max(r["bwd_rel_err"] for r in rows), "bad": bad[:5]}))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
