"""GPU: the warpgroup-MMA route (``qerl_kernels.nvfp4_wgmma``) through the public op, as models call it —
odd M (activation-row masking), bias, LoRA (``lora_a`` and explicit ``xa``), split-K with the shared
tickets (called three times: they must come back to zero), an N that is not a multiple of 64, and CUDA-graph
capture and replay with new inputs — against the dequantized fp32 reference; then forced configs: decode
sizes M <= 16 (BT 8 | 16, split, LoRA through the PDL primary ``lora_xa``) and every large-tile candidate
of the tuner (M > 128: BT 128 | 256, gathered or pre-permuted activations, pipelined) and the warp-specialised
kernel's DB / KS / split / stream-K variants, with bias and LoRA; LoRA ranks 128 / 256 / 1,024 on the
warp-specialised kernel (a shallower ring, or the LoRA term outside it), eager and in CUDA graphs; the tuned
routes of 7B / 14B q/k/v at M = 1 … 1,024 with the engine's fused-adapter ranks 128 / 256.

``python tools/wgmma_check.py [OUT.json]`` — one line per case; exit status 1 if any case fails.
"""
import json
import os
import sys

import torch

from qerl.quant import nvfp4
from qerl_kernels import ops


def main(out=None) -> int:
    dev = "cuda"
    rows, bad = [], 0
    g = torch.Generator(device=dev).manual_seed(0)
    for N, K in ((3584, 3584), (4608, 3584), (520, 18944), (5120, 13824)):
        p, s, gs = nvfp4.quantize(torch.randn(N, K, device=dev, generator=g) * 0.02)
        wref = nvfp4.dequantize(p, s, gs, torch.float32)
        bias = (torch.randn(N, device=dev, generator=g) * 0.1).bfloat16()
        la = (torch.randn(32, K, device=dev, generator=g) * 0.02).bfloat16()
        lb = (torch.randn(N, 32, device=dev, generator=g) * 0.02).bfloat16()
        for M in (17, 33, 50, 64, 100, 128):
            x = torch.randn(M, K, device=dev, generator=g).bfloat16()
            cfg = ops._resolved("fwd", x, p, s, gs, N, (None, None, None), 0, False, None)[1]
            base = x.float() @ wref.T
            xa = (x @ la.T)
            cases = {"plain": (lambda: ops.nvfp4_matmul(x, p, s, gs), base),
                     "bias": (lambda: ops.nvfp4_matmul(x, p, s, gs, bias), base + bias.float()),
                     "lora_a": (lambda: ops.nvfp4_matmul(x, p, s, gs, bias, None, lb, 2.0, lora_a=la),
                                base + bias.float() + 2.0 * (xa.float() @ lb.float().T)),
                     "xa": (lambda: ops.nvfp4_matmul(x, p, s, gs, None, xa, lb, 0.5),
                            base + 0.5 * (xa.float() @ lb.float().T))}
            for name, (fn, want) in cases.items():
                errs = [float((fn().float() - want).norm() / want.norm()) for _ in range(3)]
                ok = max(errs) < 5e-3
                bad += not ok
                rows.append({"N": N, "K": K, "M": M, "case": name, "wgmma": bool(cfg.get("WGMMA")),
                             "split": cfg.get("SPLIT"), "max_rel_err": max(errs), "ok": ok})
                print(torch.cuda.get_device_name(), N, K, M, name, "WGMMA" if cfg.get("WGMMA") else cfg,
                      f"split {cfg.get('SPLIT')}", f"rel_err {max(errs):.2e}", "ok" if ok else "FAIL", flush=True)
        assert int(ops._locks(torch.device(dev)).abs().sum()) == 0, "split tickets not back at zero"
    # forced configs: decode sizes (BT 8 | 16, LoRA through the PDL primary) and the large tiles (M > 128)
    from qerl.bench.kernels_tune import _wgmma_large

    forced = [(M, dict(WGMMA=1, WG=wg, BT=bt, NS=4, SPLIT=sp, XG=0)) for M, bt in ((1, 8), (5, 8), (16, 16), (11, 16))
              for wg, sp in ((1, 1), (1, 4), (2, 2))]
    forced += [(M, dict(WGMMA=1, WG=wg, BT=bt, NS=ns, SPLIT=sp, XG=0, XS=1))  # activations staged in the kernel
               for M, bt in ((1, 8), (16, 16), (50, 64)) for wg, ns, sp in ((1, 3, 1), (1, 2, 4), (2, 3, 2))]
    forced += [(M, c) for M in (200, 1000, 2048) for c in _wgmma_large(M)]
    # the warp-specialised kernel's variants: DB (decode under the previous wgmma), KS (K steps split over the
    # consumers of one 64-row tile), with split-K / stream-K, TMA and cp.async producers
    ws = dict(WGMMA=1, WS=1, MT=1)
    forced += [(M, {**ws, **c}) for M, bt in ((33, 64), (64, 64), (100, 128), (200, 128)) for c in (
        dict(C=1, BT=bt, NS=4, OCC=1, TMA=1, DB=1, SPLIT=1), dict(C=1, BT=bt, NS=4, OCC=1, TMA=1, DB=1, SPLIT=3),
        dict(C=1, BT=bt, NS=3, OCC=1, TMA=1, DB=1, SPLIT=1, SK=1), dict(C=2, BT=bt, NS=4, OCC=1, TMA=1, KS=1, SPLIT=1),
        dict(C=2, BT=bt, NS=4, OCC=1, KS=1, SPLIT=2), dict(C=4, BT=64, NS=4, OCC=1, KS=1, SPLIT=1))]
    forced += [(M, {**ws, **c}) for M in (17, 32) for c in (
        dict(C=2, BT=32, NS=6, OCC=1, TMA=1, DB=1, SPLIT=1, SK=1), dict(C=2, BT=32, NS=6, OCC=1, TMA=1, DB=1, KS=1,
                                                                       SPLIT=2),
        dict(C=1, MT=2, BT=32, NS=4, OCC=1, TMA=1, DB=1, SPLIT=1))]
    for N, K in ((3584, 3584), (520, 18944)):
        p, s, gs = nvfp4.quantize(torch.randn(N, K, device=dev, generator=g) * 0.02)
        wref = nvfp4.dequantize(p, s, gs, torch.float32)
        bias = (torch.randn(N, device=dev, generator=g) * 0.1).bfloat16()
        la = (torch.randn(32, K, device=dev, generator=g) * 0.02).bfloat16()
        lb = (torch.randn(N, 32, device=dev, generator=g) * 0.02).bfloat16()
        for M, cfg in forced:
            if N == 520 and M > 1000:
                continue
            x = torch.randn(M, K, device=dev, generator=g).bfloat16()
            want = x.float() @ wref.T + bias.float() + 0.75 * ((x @ la.T).float() @ lb.float().T)
            os.environ["QERL_KERNEL_CONFIG"] = json.dumps(cfg)
            try:
                route = ops.lora_route("fwd", cfg, M, K)
                errs = [float((ops.nvfp4_matmul(x, p, s, gs, bias, None, lb, 0.75, lora_a=la).float() - want).norm()
                              / want.norm()) for _ in range(3)]
                plain = x.float() @ wref.T
                errs.append(float((ops.nvfp4_matmul(x, p, s, gs).float() - plain).norm() / plain.norm()))
            finally:
                os.environ.pop("QERL_KERNEL_CONFIG")
            ok = max(errs) < 5e-3
            bad += not ok
            rows.append({"N": N, "K": K, "M": M, "case": "forced", "config": cfg, "lora_route": route,
                         "max_rel_err": max(errs), "ok": ok})
            print(N, K, M, cfg, route, f"rel_err {max(errs):.2e}", "ok" if ok else "FAIL", flush=True)
        torch.cuda.synchronize()
        assert int(ops._locks(torch.device(dev)).abs().sum()) == 0, "split tickets not back at zero"
    # CUDA graph: capture at M = 40, replay with new activations
    N, K = 3584, 3584
    p, s, gs = nvfp4.quantize(torch.randn(N, K, device=dev, generator=g) * 0.02)
    x = torch.randn(40, K, device=dev, generator=g).bfloat16()
    ops.nvfp4_matmul(x, p, s, gs)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = ops.nvfp4_matmul(x, p, s, gs)
    x.copy_(torch.randn(40, K, device=dev, generator=g).bfloat16())
    graph.replay()
    want = x.float() @ nvfp4.dequantize(p, s, gs, torch.float32).T
    gerr = float((y.float() - want).norm() / want.norm())
    bad += not gerr < 5e-3
    print("cuda graph replay M=40 rel_err", f"{gerr:.2e}", flush=True)
    # CUDA graphs of the PDL pair (lora_xa + the WGMMA kernel; M = 50: four 16-row blocks of xa; the WS kernel with
    # DB and with KS at M = 64), replayed with new activations
    la = (torch.randn(32, K, device=dev, generator=g) * 0.02).bfloat16()
    lb = (torch.randn(N, 32, device=dev, generator=g) * 0.02).bfloat16()
    perr = {}
    for M, cfg in ((16, dict(WGMMA=1, WG=1, BT=16, NS=4, SPLIT=4, XG=0)),
                   (50, dict(WGMMA=1, WG=1, BT=64, NS=4, SPLIT=4, XG=0)),
                   ("64 DB", dict(WGMMA=1, WS=1, C=1, MT=1, BT=64, NS=4, OCC=1, TMA=1, DB=1, SPLIT=2)),
                   ("64 KS", dict(WGMMA=1, WS=1, C=2, MT=1, BT=64, NS=6, OCC=1, TMA=1, KS=1, SPLIT=2))):
        xm = torch.randn(int(str(M).split()[0]), K, device=dev, generator=g).bfloat16()
        os.environ["QERL_KERNEL_CONFIG"] = json.dumps(cfg)
        try:
            ops.nvfp4_matmul(xm, p, s, gs, None, None, lb, 2.0, lora_a=la)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                ym = ops.nvfp4_matmul(xm, p, s, gs, None, None, lb, 2.0, lora_a=la)
        finally:
            os.environ.pop("QERL_KERNEL_CONFIG")
        xm.copy_(torch.randn(xm.shape[0], K, device=dev, generator=g).bfloat16())
        graph.replay()
        want = xm.float() @ nvfp4.dequantize(p, s, gs, torch.float32).T + 2.0 * ((xm @ la.T).float() @ lb.float().T)
        perr[M] = float((ym.float() - want).norm() / want.norm())
        bad += not perr[M] < 5e-3
        print(f"cuda graph replay PDL M={M} rel_err", f"{perr[M]:.2e}", flush=True)
    # LoRA ranks past the tuned rank 32 (the engine's fused q/k/v: 3r rounded up to a power of two): the WS ring
    # shallower where the epilogue's xa tiles need the room, the LoRA term after the kernel where no ring fits
    # (ops.ws_stages); eager, then replayed from a CUDA graph with new activations
    N, K = 1024, 3584
    p, s, gs = nvfp4.quantize(torch.randn(N, K, device=dev, generator=g) * 0.02)
    wref = nvfp4.dequantize(p, s, gs, torch.float32)
    for R in (128, 256, 1024):
        la = (torch.randn(R, K, device=dev, generator=g) * 0.02).bfloat16()
        lb = (torch.randn(N, R, device=dev, generator=g) * 0.02).bfloat16()
        for M, cfg in ((50, dict(C=1, BT=64, NS=6, OCC=1, TMA=1, DB=1, SPLIT=1)),
                       (128, dict(C=2, BT=128, NS=4, OCC=1, TMA=1, SPLIT=1)),
                       (200, dict(C=2, BT=128, NS=4, OCC=1, TMA=1, SPLIT=1, SK=1))):
            cfg = {**ws, **cfg}
            x = torch.randn(M, K, device=dev, generator=g).bfloat16()
            os.environ["QERL_KERNEL_CONFIG"] = json.dumps(cfg)
            try:
                y = ops.nvfp4_matmul(x, p, s, gs, None, None, lb, 0.5, lora_a=la)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    yg = ops.nvfp4_matmul(x, p, s, gs, None, None, lb, 0.5, lora_a=la)
            finally:
                os.environ.pop("QERL_KERNEL_CONFIG")
            want = x.float() @ wref.T + 0.5 * ((x @ la.T).float() @ lb.float().T)
            errs = [float((y.float() - want).norm() / want.norm())]
            x.copy_(torch.randn(M, K, device=dev, generator=g).bfloat16())
            graph.replay()
            want = x.float() @ wref.T + 0.5 * ((x @ la.T).float() @ lb.float().T)
            errs.append(float((yg.float() - want).norm() / want.norm()))
            ns, outside = ops.ws_stages(cfg, R)
            ok = max(errs) < 5e-3
            bad += not ok
            rows.append({"N": N, "K": K, "M": M, "case": f"lora rank {R}", "config": cfg, "stages": ns,
                         "lora_outside": outside, "max_rel_err": max(errs), "ok": ok})
            print(N, K, M, f"R={R}", cfg, f"NS {cfg['NS']} -> {ns}", "outside" if outside else "fused",
                  f"rel_err {max(errs):.2e}", "ok" if ok else "FAIL", flush=True)
    # the tuned routes as the engine calls them (no forced config): 7B / 14B q/k/v with the fused adapters' ranks
    # of LoRA 32 / 64 (R = 128 / 256), decode to prefill sizes
    for N, K in ((4608, 3584), (7168, 5120)):
        p, s, gs = nvfp4.quantize(torch.randn(N, K, device=dev, generator=g) * 0.02)
        wref = nvfp4.dequantize(p, s, gs, torch.float32)
        for R in (128, 256):
            la = (torch.randn(R, K, device=dev, generator=g) * 0.02).bfloat16()
            lb = (torch.randn(N, R, device=dev, generator=g) * 0.02).bfloat16()
            for M in (1, 8, 16, 64, 128, 256, 1024):
                x = torch.randn(M, K, device=dev, generator=g).bfloat16()
                cfg = ops._resolved("fwd", x, p, s, gs, N, (None, None, None), 0, False, None)[1]
                want = x.float() @ wref.T + 0.5 * ((x @ la.T).float() @ lb.float().T)
                err = float((ops.nvfp4_matmul(x, p, s, gs, None, None, lb, 0.5, lora_a=la).float() - want).norm()
                            / want.norm())
                ok = err < 5e-3
                bad += not ok
                rows.append({"N": N, "K": K, "M": M, "case": f"tuned route, lora rank {R}", "config": cfg,
                             "max_rel_err": err, "ok": ok})
                print(N, K, M, f"R={R} tuned", ops.path_of("fwd", cfg), f"rel_err {err:.2e}", "ok" if ok else "FAIL",
                      flush=True)
    res = {"device": torch.cuda.get_device_name(), "rows": rows, "graph_rel_err": gerr, "graph_pdl_rel_err": perr,
           "failed": bad}
    if out:
        with open(out, "w") as f:
            json.dump(res, f, indent=1, default=dict)  # (configs are read-only mappings)
    print(json.dumps({"checked": len(rows) + 1 + len(perr), "failed": bad}))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else None))
