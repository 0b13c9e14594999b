"""CPU checks of the warpgroup-MMA kernel (``qerl_kernels.nvfp4_wgmma``), which only runs on a Hopper GPU:

* the reduction-order permutations are bijections, and the activation permutation kernel (Triton,
  run here in the interpreter) applies exactly ``perm_128``;
* the weight-operand assembly of ``_a_operand`` — word decode, join / reshape / permute — replayed in
  NumPy with the same tensor operations gives, at logical k, the dequantized weight at physical
  ``π(k)`` (both decode orders), so ``A · xpᵀ == Ŵ · xᵀ``;
* the kernel compiles for sm_90 (``gl.convert_layout(..., assert_trivial=True)`` holds: the decoded
  tile is the wgmma register operand without data movement) with 8 wgmma per 128-wide step, no
  register spills, for one and two warpgroups, in-kernel gather or not, split-K and bias.
(The GPU judge — a layout probe and the dequantized reference on Qwen2.5 shapes — is
the retired ``scripts/wgmma_sweep.py`` (git show ea84b65:scripts/wgmma_sweep.py); its findings in qerl_kernels/README.md.)"""
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

from qerl.quant import nvfp4

wg = pytest.importorskip("qerl_kernels.nvfp4_wgmma")


def _bf16(bits):
    return (np.asarray(bits, np.uint32) << 16).view(np.float32).astype(np.float64)


def _word_pairs(q, s):  # the kernel's PTX, in NumPy: pairs (3 - i, 7 - i) of e2m1 · 2^-126 · s
    out = []
    for i in range(4):
        t = (((q << (4 * i)) & 0x70007000) >> 6) | ((q << (4 * i)) & 0x80008000)
        out.append((_bf16(t & 0xFFFF) * _bf16(s & 0xFFFF), _bf16((t >> 16) & 0xFFFF) * _bf16(s >> 16)))
    return out


def _byte_pairs(q, s):  # per byte b: (low nibble, high nibble) = physical k (2b, 2b + 1)
    out = []
    for b in range(4):
        byte = (q >> (8 * b)) & 0xFF
        lo = ((byte & 7) << 6 | (byte & 8) << 12)
        hi = (((byte >> 4) & 7) << 6 | ((byte >> 4) & 8) << 12)
        out.append((_bf16(lo) * _bf16(s & 0xFFFF), _bf16(hi) * _bf16(s >> 16)))
    return out


def _a_operand(packed_step, scale_step, xg, xs=False):
    """NumPy replay of ``_a_operand`` for one 128-wide step: packed [RW, 64] uint8, scales [RW, 8] uint8
    -> decoded [RW, 128] (fp64) in logical k order, built with the kernel's tensor operations."""
    rw = packed_step.shape[0]
    q = np.ascontiguousarray(packed_step).view(np.uint32).reshape(rw, 16).astype(np.int64)  # [row, 4c + v]
    s = torch.from_numpy(np.ascontiguousarray(scale_step)).view(torch.float8_e4m3fn).float().numpy() * 2.0 ** 119
    s16 = np.array([int(torch.tensor(v).to(torch.bfloat16).view(torch.int16)) & 0xFFFF for v in s.ravel()]).reshape(s.shape)
    s2 = (s16 | (s16 << 16)).reshape(rw, 4, 2)
    s2 = np.stack([s2, s2], axis=-1).reshape(rw, 16)  # gl.join(s2, s2).reshape
    dec = _byte_pairs if xg else _word_pairs
    pairs = [[[None] * 16 for _ in range(rw)] for _ in range(4)]
    for r in range(rw):
        for w in range(16):
            for i, pr in enumerate(dec(int(q[r, w]), int(s2[r, w]))):
                pairs[i][r][w] = pr
    p = [np.array(pi) for pi in pairs]  # 4 x [rw, 16, 2(e)]
    if xs:  # XS: the pairs joined in reverse
        p = p[::-1]
    t = np.stack([np.stack([p[0], p[1]], axis=2), np.stack([p[2], p[3]], axis=2)], axis=3)  # [r, q, h, jl, e]
    t = t.reshape(rw, 4, 4, 2, 2, 2).transpose(0, 2, 4, 3, 1, 5)  # [r, v, jl, h, c, e]
    return t.reshape(rw, 128)


@pytest.mark.parametrize("xg", [0, 1, 2])
def test_weight_operand_assembly_matches_the_permuted_reference(xg):
    """xg 0: word pairs (the pre-permuted path), 1: byte pairs (in-kernel gather), 2: word pairs joined in
    reverse (XS: activations staged in the kernel)."""
    torch.manual_seed(0)
    w = torch.randn(32, 256) * 0.1
    packed, scale, gs = nvfp4.quantize(w)
    ref = nvfp4.dequantize(packed, scale, torch.ones_like(gs), torch.float64).numpy() * 2.0 ** -7  # e2m1 · scale · 2^-7
    pi = np.array(wg.perm_128(xg))
    pk, sc = packed.numpy(), scale.view(torch.uint8).numpy()
    for step in range(2):
        a = _a_operand(pk[:, 64 * step:64 * step + 64], sc[:, 8 * step:8 * step + 8], xg == 1, xs=xg == 2)
        np.testing.assert_array_equal(a, ref[:, 128 * step + pi])


def test_permutations_and_the_permute_kernel():
    for xg in (0, 1, 2):
        assert sorted(wg.perm_128(xg)) == list(range(128))
    # XS: the in-kernel staging's reshape + permute of one tile row is perm_128(2)
    phys = torch.arange(128)
    staged = phys.reshape(4, 4, 2, 2, 2).permute(1, 3, 4, 0, 2).reshape(128)  # [c, v, e, j1, h] -> [v, j1, h, c, e]
    assert staged.tolist() == wg.perm_128(2)
    code = """
import torch
from qerl_kernels.nvfp4_wgmma import perm_128, permute_activations
x = torch.randn(3, 384).bfloat16()
want = x.view(3, 3, 128)[:, :, torch.tensor(perm_128())].reshape(3, 384)
assert torch.equal(permute_activations(x), want)
print("ok")
"""
    env = {**os.environ, "TRITON_INTERPRET": "1"}  # the interpreter must be on before triton is imported
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout + out.stderr


@pytest.mark.parametrize("WG,BT,NS,split,bias,XG,NSW,MT", [(1, 64, 3, False, False, False, 0, 1),
                                                           (1, 32, 3, True, True, True, 0, 1),
                                                           (2, 16, 4, True, False, True, 0, 1),
                                                           (2, 64, 3, False, True, False, 0, 1),
                                                           (1, 64, 3, True, True, False, 6, 1),
                                                           (1, 8, 3, False, False, False, 8, 1),
                                                           (1, 64, 3, False, True, False, 0, 2),
                                                           (1, 32, 4, True, False, False, 0, 2)])
def test_compiles_for_sm90_with_the_operand_in_registers(WG, BT, NS, split, bias, XG, NSW, MT):
    """NSW > 0: the pipelined loop (next step's decode under this step's wgmma, weights NSW steps ahead);
    MT = 2: two m64 weight tiles per warpgroup on one activation tile."""
    from inspect_ir import compile_wgmma, registers_of, stack_of

    k = compile_wgmma(WG, BT, NS, split=split, bias=bias, XG=XG, PIPE=NSW > 0, NSW=NSW, MT=MT)
    ptx = k.asm["ptx"]
    assert len(re.findall(r"wgmma\.mma_async", ptx)) == 8 * MT  # one step: 8 x k16 per m64 tile, A from registers
    assert stack_of(k) == 0  # no register spills
    assert re.search(r"wgmma\.mma_async\.sync\.aligned\.m64n%d k16".replace(" ", "") % BT, ptx)
    assert ".local" not in ptx  # no register spills to local memory
    assert registers_of(k) <= 255


@pytest.mark.parametrize("BT,R", [(64, 32), (32, 16)])
def test_lora_epilogue_compiles_as_one_more_wgmma(BT, R):
    """LoRA up-projection in the epilogue: lora_b rows as the register operand, xa from shared memory —
    R / 16 more k16 wgmma after the 8 of the main step, no spills (split-K and bias on)."""
    from inspect_ir import compile_wgmma, stack_of

    k = compile_wgmma(1, BT, 3, split=True, bias=True, XG=False, R=R)
    assert len(re.findall(r"wgmma\.mma_async", k.asm["ptx"])) == 8 + R // 16
    assert stack_of(k) == 0


@pytest.mark.parametrize("WG,BT,NS,split,R,PDL", [(1, 16, 3, True, 0, False), (1, 8, 2, True, 32, True),
                                                 (1, 64, 3, False, 32, False), (2, 32, 3, True, 16, True)])
def test_staged_activations_compile_for_sm90(WG, BT, NS, split, R, PDL):
    """XS (activations staged through registers into the operand tile, no pre-pass): compiles for sm_90 with
    the decoded weights still the register operand, 8 (+ R / 16 LoRA) wgmma per step, no spills, the
    griddepcontrol wait with PDL; the staging keeps a ring of tiles as loaded plus one operand tile."""
    from inspect_ir import compile_wgmma, stack_of

    k = compile_wgmma(WG, BT, NS, split=split, bias=True, XG=False, R=R, PDL=PDL, XS=True)
    ptx = k.asm["ptx"]
    assert len(re.findall(r"wgmma\.mma_async", ptx)) == 8 + R // 16
    assert stack_of(k) == 0 and ".local" not in ptx
    assert ("griddepcontrol.wait" in ptx) == PDL
    ring = NS * (BT * 256 + 72 * 64 * WG)  # activation tiles as loaded + weights and scales
    assert k.metadata.shared >= ring + BT * 256


def test_staged_activations_exclude_the_gather_and_the_pipelined_loop():
    """XS stages the activations in the plain loop only: with XG or PIPE the wrapper refuses, naming both,
    before anything is launched (CPU tensors here)."""
    x, p, sc, gs = torch.zeros(4, 128, dtype=torch.bfloat16), torch.zeros(64, 64, dtype=torch.uint8), \
        torch.zeros(64, 8, dtype=torch.uint8), torch.ones(1)
    for bad in (dict(XG=1), dict(PIPE=1, NSW=6)):
        with pytest.raises(ValueError, match="XS .* excludes XG and PIPE"):
            wg.nvfp4_wgmma_matmul(x, p, sc, gs, XS=1, **bad)


@pytest.mark.parametrize("tiles,k_steps,P", [(148, 28, 132), (592, 28, 264), (72, 28, 132), (3, 40, 132), (1, 3, 5),
                                             (40, 216, 132), (7, 7, 7), (130, 1, 132)])
def test_stream_k_schedule_covers_every_unit_once_and_the_reducer_finds_every_share(tiles, k_steps, P):
    """The stream-K schedule (`SK`): the programs' segments cover each (tile, K step) unit exactly once; whole tiles
    go straight out; a program writes at most two partial tiles (slots 2p, 2p + 1, never shared); and for every
    split tile the slots the kernel's last arriver sums — programs `owner(first unit) … owner(last unit)`, slot
    `2q + (q's range starts before the tile)` — are exactly the shares' slots (`stream_k_plan` is the reference)."""
    from qerl_kernels.nvfp4_wgmma import stream_k_owner, stream_k_plan

    P = min(P, tiles * k_steps)  # (the launcher never starts more programs than units)
    U = tiles * k_steps
    plan = stream_k_plan(tiles, k_steps, P)
    seen = [0] * U
    shares: dict[int, set] = {}
    for p, segs in enumerate(plan):
        slots = [s for *_, s in segs if s >= 0]
        assert len(slots) == len(set(slots)) <= 2 and all(s // 2 == p for s in slots)
        for tile, k0, k1, slot in segs:
            assert 0 <= k0 < k1 <= k_steps
            for k in range(k0, k1):
                seen[tile * k_steps + k] += 1
            if slot >= 0:
                shares.setdefault(tile, set()).add(slot)
    assert seen == [1] * U
    for tile, slots in shares.items():
        q0, q1 = stream_k_owner(tile * k_steps, P, U), stream_k_owner(tile * k_steps + k_steps - 1, P, U)
        assert {2 * q + int(q * U // P < tile * k_steps) for q in range(q0, q1 + 1)} == slots
        assert len(slots) >= 2  # a share of one is a whole tile


@pytest.mark.parametrize("WG,BT,MT", [(4, 64, 1), (4, 128, 1), (2, 64, 2), (1, 64, 1)])
def test_stream_k_compiles_for_sm90_without_spills(WG, BT, MT):
    """`SK`: the segment loop around the plain main loop, the partial tiles and the in-order reduction compile for
    sm_90 with the weight operand in registers and no spills, also at 4 warpgroups (256 weight rows: the activation
    tile read from L2 once per 256 rows instead of per 64)."""
    from inspect_ir import compile_wgmma, registers_of, stack_of

    k = compile_wgmma(WG, BT, 3, split=False, bias=True, XG=False, MT=MT, SK=True)
    ptx = k.asm["ptx"]
    assert len(re.findall(r"wgmma\.mma_async", ptx)) == 8 * MT
    assert stack_of(k) == 0 and ".local" not in ptx
    assert registers_of(k) <= (128 if WG == 4 else 255)


def _order(ptx: str) -> list[str]:
    """The kernel's chain-relevant instructions in PTX order: ``W`` griddepcontrol.wait, ``L`` launch_dependents,
    ``a`` a 16-byte activation / weight ``cp.async``, ``s`` a 4-byte scale ``cp.async``."""
    out = []
    for line in ptx.splitlines():
        t = ("W" if "griddepcontrol.wait" in line else "L" if "launch_dependents" in line else
             "a" if "cp.async.cg" in line else
             "s" if "cp.async.ca" in line else None)
        if t:
            out.append(t)
    return out


@pytest.mark.parametrize("XS,PDL", [(True, False), (False, False), (True, True)])
def test_launch_chain_issues_weights_before_the_wait_and_activations_after(XS, PDL):
    """The launch chain's early weights (`EW`, qerl_kernels.launch.chain): the prologue's weight and scale copies come
    before the wait for the previous grid (`griddepcontrol.wait`) and the activation copies after it; `TRIG` releases
    the next launch first thing. Tiled weights, M = 8 configs (one / two prologue steps, as the 7B table's q/k/v and
    gate/up); with `PDL` (the LoRA primary's dependent, not `EW`) the only wait is the epilogue's."""
    from inspect_ir import compile_wgmma, stack_of

    NS = 2 if XS else 3
    k = compile_wgmma(1, 8, NS, split=True, XG=False, R=32 if PDL else 0, PDL=PDL, XS=XS, TILED=True, EW=not PDL,
                      TRIG=True)
    ptx = k.asm["ptx"]
    order = _order(ptx)
    assert stack_of(k) == 0 and ".local" not in ptx
    assert order[0] == "L"
    wait = order.index("W")
    if PDL:
        assert order.count("W") == 1 and "a" not in order[wait:]  # the epilogue's wait, after every copy
        return
    before = order[:wait]
    # the prologue steps' weights (4 KB a step: two 16-byte copies per thread) and scales (512 B: one 4-byte copy)
    assert before.count("a") == 2 * (NS - 1) and before.count("s") == NS - 1
    assert order.index("a", wait) > wait  # the first step's activations: after the wait
    # (a second wait in the code: the programs with no K steps, which still wait before writing)
