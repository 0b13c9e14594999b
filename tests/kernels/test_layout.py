"""The tile-contiguous weight layout (qerl_kernels.layout), the warpgroup-MMA kernel's ``TILED`` loop and the DQ
path on tiled weights: the reordering against an element-by-element index formula, its inverse, the refusals,
the sm_90 compile, and the dequantization bit-equal to the row-major path under the interpreter."""
import json
import os
import re
import subprocess
import sys

import pytest
import torch

from qerl_kernels import layout


def test_tile_places_every_byte_where_offsets_says_and_untile_inverts_it():
    g = torch.Generator().manual_seed(3)
    N, K = 192, 384
    packed = torch.randint(0, 256, (N, K // 2), generator=g, dtype=torch.uint8)
    scale = torch.randint(0, 256, (N, K // 16), generator=g, dtype=torch.uint8).view(torch.float8_e4m3fn)
    tp, ts = layout.tile(packed, scale)
    assert tp.shape == packed.shape and ts.shape == scale.shape and ts.dtype == torch.float8_e4m3fn
    n = torch.arange(N)[:, None]
    off = layout.offsets(n, torch.arange(K // 2)[None, :], K // 2)
    assert torch.equal(tp.reshape(-1)[off], packed)  # byte (n, c) sits at offsets(n, c)
    soff = layout.offsets(n, torch.arange(K // 16)[None, :], K // 16, layout.SSTEP)
    assert torch.equal(ts.view(torch.uint8).reshape(-1)[soff], scale.view(torch.uint8))
    # a hand-checked byte: tile 1, step 2, row 5, byte 7 -> row 69, byte 2 * 64 + 7
    assert int(tp.reshape(-1)[64 * (K // 2) + 2 * 4096 + 5 * 64 + 7]) == int(packed[69, 135])
    # a tile starts where it starts row-major; offsets is a permutation of the bytes
    assert int(off[64, 0]) == 64 * (K // 2) and torch.equal(off.reshape(-1).sort().values, torch.arange(N * K // 2))
    up, us = layout.untile(tp, ts)
    assert torch.equal(up, packed) and torch.equal(us.view(torch.uint8), scale.view(torch.uint8))


@pytest.mark.parametrize("N,K", [(100, 256), (128, 200)])
def test_tile_refuses_shapes_without_whole_tiles(N, K):
    with pytest.raises(ValueError, match=re.escape(f"N % 64 == 0 and K % 128 == 0, got N={N}, K={K}")):
        layout.tile(torch.zeros(N, K // 2, dtype=torch.uint8), torch.zeros(N, K // 16, dtype=torch.uint8))


def test_wgmma_wrapper_refuses_tiled_weights_outside_the_plain_loop():
    """``TILED`` runs the plain loop only (split-K or stream-K), on whole 64-row tiles: the wrapper refuses the
    pipelined loop and a partial tile before anything is launched (CPU tensors here)."""
    from qerl_kernels.nvfp4_wgmma import nvfp4_wgmma_matmul

    x, gs = torch.zeros(8, 128, dtype=torch.bfloat16), torch.ones(1)
    p, s = torch.zeros(64, 64, dtype=torch.uint8), torch.zeros(64, 8, dtype=torch.uint8)
    for kw in (dict(PIPE=1, NSW=4), dict(PIPE=1, NSW=4, SK=1)):
        with pytest.raises(ValueError, match="TILED weights"):
            nvfp4_wgmma_matmul(x, p, s, gs, TILED=1, **kw)
    with pytest.raises(ValueError, match="N=96"):
        nvfp4_wgmma_matmul(x, torch.zeros(96, 64, dtype=torch.uint8), torch.zeros(96, 8, dtype=torch.uint8), gs,
                           TILED=1)


@pytest.mark.parametrize("WG,MT,BT,NS,split,XS,R", [(1, 1, 8, 2, True, True, 0), (1, 1, 16, 4, True, False, 32),
                                                   (1, 1, 64, 3, False, True, 0), (2, 1, 64, 3, True, False, 0),
                                                   (1, 2, 32, 3, False, False, 0)])
def test_tiled_loop_compiles_for_sm90(WG, MT, BT, NS, split, XS, R):
    """The tiled plain loop compiles for sm_90 like the row-major one, also with 128 weight rows per program (two
    warpgroups or two m64 tiles: rows 64 on lie in the next tile): 8 · MT (+ R / 16) wgmma per step, the weights and
    scales still by ``cp.async``, no spills."""
    from inspect_ir import compile_wgmma, stack_of

    k = compile_wgmma(WG, BT, NS, split=split, bias=True, XG=False, MT=MT, R=R, XS=XS, TILED=True)
    ptx = k.asm["ptx"]
    assert len(re.findall(r"wgmma\.mma_async", ptx)) == 8 * MT + R // 16
    assert "cp.async" in ptx and stack_of(k) == 0 and ".local" not in ptx


def test_tiled_stream_k_compiles_for_sm90():
    """Stream-K on tiled weights: each (tile, K step) range reads the tile-contiguous offsets (the code differs from
    the row-major stream-K's), 8 wgmma per step, no spills."""
    from inspect_ir import compile_wgmma, stack_of

    tiled, rows = (compile_wgmma(1, 8, 3, XG=False, XS=True, SK=True, TILED=t) for t in (True, False))
    body = [k.asm["ptx"].split(".section")[0] for k in (tiled, rows)]
    assert len(re.findall(r"wgmma\.mma_async", body[0])) == 8 and stack_of(tiled) == 0 and ".local" not in body[0]
    assert body[0] != body[1]


def test_dequant_and_dq_path_read_tiled_weights_under_interpreter():
    """The DQ path on tiled weights: ``dequantize_into(..., tiled=(r0, k0))`` writes exactly the row-major result
    for the whole tensor and for row and column windows at any origin (fp32, bit for bit), ``dq_forward`` /
    ``dq_backward`` split into several windows give the row-major path's outputs, and a window outside the
    tensor is refused with its numbers."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}  # before triton is imported
    out = subprocess.run([sys.executable, "-c", """
import json, torch
from qerl.quant import nvfp4
from qerl_kernels import layout
from qerl_kernels.nvfp4_dequant import dequantize_into, dq_forward, dq_backward
g = torch.Generator().manual_seed(5)
N, K = 192, 384
p, s, gs = nvfp4.quantize(torch.randn(N, K, generator=g) * 0.1)
s8 = s.view(torch.uint8)
tp, ts = layout.tile(p, s8)
ref = nvfp4.dequantize(p, s, gs, torch.float32)
res = {}
res["whole"] = torch.equal(dequantize_into(torch.empty(N, K), tp, ts, gs, True, tiled=(0, 0)), ref)
for r0, k0, R, C in ((64, 0, 64, K), (37, 32, 50, 208), (0, 256, N, 128), (150, 368, 42, 16)):
    w = dequantize_into(torch.empty(R, C), tp, ts, gs, True, tiled=(r0, k0))
    res[f"win_{r0}_{k0}"] = torch.equal(w, ref[r0:r0 + R, k0:k0 + C])
x = torch.randn(5, K, generator=g)
d = torch.randn(5, N, generator=g)
for chunk in (0, 64 * K, 48 * 128):  # one window; three row windows / column windows
    res[f"fwd_{chunk}"] = torch.equal(dq_forward(x, tp, ts, gs, None, None, None, 1.0, chunk, True, tiled=True),
                                      dq_forward(x, p, s8, gs, None, None, None, 1.0, chunk, True))
    res[f"bwd_{chunk}"] = torch.equal(dq_backward(d, tp, ts, gs, None, None, 1.0, chunk, True, tiled=True),
                                      dq_backward(d, p, s8, gs, None, None, 1.0, chunk, True))
try:
    dequantize_into(torch.empty(64, 128), tp, ts, gs, True, tiled=(160, 0))
except ValueError as e:
    res["error"] = str(e)
print(json.dumps(res))
"""], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    res = json.loads(out.stdout.strip().splitlines()[-1])
    err = res.pop("error")
    assert all(res.values()) and len(res) == 11, res
    assert "[64, 128] window at row 160, weight 0" in err


def test_ops_on_tiled_weights_match_row_major_under_interpreter():
    """``ops.nvfp4_matmul(..., tiled=True)`` / ``nvfp4_matmul_t`` on tiled weights give the row-major calls' outputs
    bit for bit — forward with bias and LoRA (``xa`` and ``lora_a``), backward with the LoRA term, decode sizes to
    tiles, the DQ path forced with several windows — and never route to a kernel without the layout."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", """
import json, os, torch
from qerl.quant import nvfp4
from qerl_kernels import layout, ops
g = torch.Generator().manual_seed(11)
N, K, R = 128, 384, 16
p, s, gs = nvfp4.quantize(torch.randn(N, K, generator=g) * 0.1)
tp, ts = layout.tile(p, s)
ops.LORA_INKERNEL_FLOPS = ops.LORA_INKERNEL_DECODE_WEIGHTS = 0  # (row-major eager LoRA calls would take the in-kernel route, which tiled weights never do)
bias = torch.randn(N, generator=g).to(torch.bfloat16)
la = (torch.randn(R, K, generator=g) * 0.1).to(torch.bfloat16)
lb = (torch.randn(N, R, generator=g) * 0.1).to(torch.bfloat16)
res, paths = {}, set()
for forced in (None, '{"DQ": 1, "CHUNK": 12288}'):
    if forced:
        os.environ["QERL_KERNEL_CONFIG"] = forced
    for M in (1, 5, 33):
        x = torch.randn(M, K, generator=g).to(torch.bfloat16)
        dy = torch.randn(M, N, generator=g).to(torch.bfloat16)
        xa = (x @ la.T)
        dyb = torch.randn(M, R, generator=g).to(torch.bfloat16)
        pairs = {
            "fwd": (ops.nvfp4_matmul(x, p, s, gs, bias), ops.nvfp4_matmul(x, tp, ts, gs, bias, tiled=True)),
            "fwd_xa": (ops.nvfp4_matmul(x, p, s, gs, None, xa, lb, 0.5),
                       ops.nvfp4_matmul(x, tp, ts, gs, None, xa, lb, 0.5, tiled=True)),
            "fwd_la": (ops.nvfp4_matmul(x, p, s, gs, None, None, lb, 0.5, lora_a=la),
                       ops.nvfp4_matmul(x, tp, ts, gs, None, None, lb, 0.5, lora_a=la, tiled=True)),
            "bwd": (ops.nvfp4_matmul_t(dy, p, s, gs, dyb, la, 0.5),
                    ops.nvfp4_matmul_t(dy, tp, ts, gs, dyb, la, 0.5, tiled=True)),
        }
        for name, (a, b) in pairs.items():
            res[f"{forced is not None}_{M}_{name}"] = torch.equal(a, b)
        paths.add(ops.route_of("fwd", x, tp, ts, tiled=True)[0])
        paths.add(ops.route_of("bwd", dy, tp, ts, tiled=True)[0])
    os.environ.pop("QERL_KERNEL_CONFIG", None)
print(json.dumps({"res": res, "paths": sorted(paths)}))
"""], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(r["res"]) == 24 and all(r["res"].values()), r["res"]
    assert set(r["paths"]) == {"tile_fwd", "tile_bwd", "dq"}, r["paths"]


def test_tiled_config_keeps_only_paths_that_read_the_layout():
    """On tiled weights, the plain warpgroup-MMA kernel's pipelined and gathering configs and the decode kernels (MMV,
    GEMV) become the untuned rule's plain warpgroup-MMA config (forward, M <= 128, GPU), DQ above that or a tile; the
    plain loop (split-K or stream-K), the warp-specialised kernel (any producer or schedule), DQ and tiles stay as
    they are."""
    from qerl_kernels import ops

    N, K, sms = 4608, 3584, 132
    plain = dict(WGMMA=1, WG=1, BT=8, NS=2, SPLIT=6, XG=0, XS=1)
    ws = dict(WGMMA=1, WS=1, C=2, BT=64, NS=4, TMA=1)
    for cfg in (plain, {**plain, "SK": 2}, ws, {**ws, "SK": 1}, {**ws, "KS": 1, "DB": 1}, dict(DQ=1, CHUNK=0),
                dict(BM=16, BN=64, BK=64, SWAP=0, SPLIT=2, num_warps=4, num_stages=3)):
        for M in (8, 256):
            assert ops.tiled_config("fwd", cfg, M, N, K, sms) == cfg
    for cfg in ({**plain, "PIPE": 1, "NSW": 6}, {**plain, "XG": 1},
                dict(MMV=1, BM=8, BN=64, BK=128, SPLIT=4), dict(GEMV=1, BM=1, BN=32, BK=64, SPLIT=1)):
        got = ops.tiled_config("fwd", cfg, 8, N, K, sms)
        assert got == ops.wgmma_heuristic(8, N, K, sms) and not (got.get("WS") or got.get("SK") or got.get("PIPE"))
        tile = ops.tiled_config("fwd", cfg, 8, N, K, sms, interpret=True)
        assert "BM" in tile and not (tile.get("WGMMA") or tile.get("MMV") or tile.get("GEMV"))
        assert ops.tiled_config("fwd", cfg, 256, N, K, sms)["DQ"] == 1  # above 128 rows
    assert "BM" in ops.tiled_config("fwd", dict(MMV=1, BM=8, SPLIT=2), 8, N, K, sms, interpret=True)


def test_ops_refuse_tiled_weights_without_whole_tiles():
    from qerl_kernels import ops
    from qerl_kernels.ops import KernelInputError

    x, gs = torch.zeros(4, 256, dtype=torch.bfloat16), torch.ones(1)
    p, s = torch.zeros(96, 128, dtype=torch.uint8), torch.zeros(96, 16, dtype=torch.uint8)
    with pytest.raises(KernelInputError, match="N % 64 == 0, K % 128 == 0 .* got N=96, K=256"):
        ops.nvfp4_matmul(x, p, s, gs, tiled=True)
    with pytest.raises(KernelInputError, match="nvfp4_matmul_t: tiled weights"):
        ops.nvfp4_matmul_t(torch.zeros(4, 96, dtype=torch.bfloat16), p, s, gs, tiled=True)


def test_tiled_keeps_only_where_the_routed_config_survives(monkeypatch):
    """``ops.tiled_keeps`` (the engine's ``weight_layout="auto"``): a projection is tiled only where its forward's
    routed config reads the layout as tuned — plain warpgroup-MMA and warp-specialised configs yes, the decode
    kernels no (tiled_config would swap them for an untuned rule) — and never without whole tiles."""
    from qerl_kernels import ops

    cfgs = {"plain": dict(WGMMA=1, WG=1, BT=8, NS=2, SPLIT=6, XG=0, XS=1, EAGER=dict(MMV=1)),
            "ws": dict(WGMMA=1, WS=1, C=2, BT=64, NS=4, TMA=1), "mmv": dict(MMV=1, BM=8, BN=64, BK=128, SPLIT=4),
            "gemv": dict(GEMV=1, BM=1, BN=32, BK=64, SPLIT=1)}
    which = ["plain"]
    monkeypatch.setattr(ops, "config_for", lambda kind, M, N, K, device: dict(cfgs[which[0]]))
    cpu = torch.device("cpu")
    for name, want in (("plain", True), ("ws", True), ("mmv", False), ("gemv", False)):
        which[0] = name
        assert ops.tiled_keeps(8, 4608, 3584, cpu) is want, name
    which[0] = "plain"
    assert not ops.tiled_keeps(8, 4608 + 32, 3584, cpu) and not ops.tiled_keeps(8, 4608, 3584 + 64, cpu)
