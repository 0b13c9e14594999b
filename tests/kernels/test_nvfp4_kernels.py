"""The Triton NVFP4 kernels on CPU under TRITON_INTERPRET=1 (a subprocess: the interpreter must be
enabled before triton is imported), input validation, and the opt-in seam wiring."""
import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")


def _interp(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)


def test_selfcheck_under_interpreter():
    out = _interp("import sys; from qerl.bench.kernels_check import main; sys.exit(main([]))")
    assert out.returncode == 0, out.stdout + out.stderr
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["checked"] >= 12 and res["failed"] == 0 and res["tiled"] == 2  # (+ the calls on tiled weights)


@pytest.mark.parametrize("cfg", [{"SPLIT": 3, "BK": 16, "BN": 16}, {"SPLIT": 2, "BK": 32, "BN": 16, "SWAP": 1},
                                 # the MMV decode config falls back to the CUDA-core GEMV (its interpreter twin)
                                 {"MMV": 1, "BM": 16, "BN": 64, "BK": 128, "SPLIT": 2, "num_warps": 4, "XPRE": 0},
                                 {"GEMV": 1, "BM": 4, "BN": 16, "BK": 32, "SPLIT": 2},
                                 # dequantize windows (16 rows / 16 columns each here) + matmul
                                 {"DQ": 1, "CHUNK": 256}])
def test_split_swap_and_odd_shapes_under_interpreter(cfg):
    """Split reduction (tickets, last program reduces), swapped operands and masked K tails."""
    code = f"""
import json, os, torch
os.environ['QERL_KERNEL_CONFIG'] = json.dumps({cfg!r})
from qerl.quant import nvfp4
from qerl.ops.linear import reference_forward, reference_backward_input
from qerl_kernels.ops import nvfp4_matmul, nvfp4_matmul_t
g = torch.Generator().manual_seed(1)
errs = []
for N, K, M in [(24, 48, 3), (17, 96, 1), (40, 16, 9), (33, 80, 20)]:
    p, s, gs = nvfp4.quantize(torch.randn(N, K, generator=g) * 0.1)
    x = torch.randn(2, M, K, generator=g).bfloat16()
    dy = torch.randn(2, M, N, generator=g).bfloat16()
    y, yr = nvfp4_matmul(x, p, s, gs).float(), reference_forward(x, p, s, gs, None).float()
    d, dr = nvfp4_matmul_t(dy, p, s, gs).float(), reference_backward_input(dy, p, s, gs).float()
    assert y.shape == yr.shape and d.shape == dr.shape
    errs += [float((y - yr).norm() / yr.norm()), float((d - dr).norm() / dr.norm())]
from qerl_kernels.ops import _locks
assert int(_locks(torch.device('cpu')).abs().sum()) == 0  # every ticket returned to zero
print(json.dumps(errs))
"""
    out = _interp(code)
    assert out.returncode == 0, out.stdout + out.stderr
    assert max(json.loads(out.stdout.strip().splitlines()[-1])) < 2e-2


def test_split_reduction_rounds_give_the_same_sum_under_interpreter():
    """RED (split-K partials loaded per round before they are added, nvfp4_matmul.split_red) leaves the sum as it
    was: the same partials added in the same order, those past SPLIT as -0.0 — bit-equal outputs, forward and
    backward tiles, SPLIT not a multiple of RED."""
    code = """
import json, os, torch
from qerl.quant import nvfp4
from qerl_kernels.ops import nvfp4_matmul, nvfp4_matmul_t, _locks
g = torch.Generator().manual_seed(3)
out = {}
for N, K, M in [(40, 160, 3), (33, 96, 18)]:
    p, s, gs = nvfp4.quantize(torch.randn(N, K, generator=g) * 0.1)
    x = torch.randn(M, K, generator=g).bfloat16()
    dy = torch.randn(M, N, generator=g).bfloat16()
    for red in (1, 2, 4, 8):
        os.environ['QERL_KERNEL_CONFIG'] = json.dumps({"SPLIT": 5, "BK": 16, "BN": 16, "RED": red})
        out.setdefault((N, red), []).extend([nvfp4_matmul(x, p, s, gs), nvfp4_matmul_t(dy, p, s, gs)])
same = all(torch.equal(a, b) for (N, red), ys in out.items() for a, b in zip(ys, out[(N, 1)]))
print(json.dumps({"same": same, "locks": int(_locks(torch.device('cpu')).abs().sum())}))
"""
    out = _interp(code)
    assert out.returncode == 0, out.stdout + out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"same": True, "locks": 0}


def test_split_reduction_rounds_rule():
    from qerl_kernels.nvfp4_matmul import split_red

    # the decode tiles (64 weight rows x BT activation rows, one warpgroup): only where the registers stay
    assert [split_red(64, bt, 4) for bt in (8, 16, 32, 64, 128)] == [8, 1, 1, 1, 1]
    assert split_red(128, 64, 4) == 1  # the bwd tile [128, 64] keeps its registers (168 -> 246 with 2)
    assert split_red(16, 64, 4) == 1 and split_red(128, 8, 8) == 8


def test_split_reduction_rounds_keep_the_decode_kernels_registers():
    """The routed RED of the warpgroup-MMA decode tile (BT = 8) compiles for sm_90 with the registers of RED = 1
    (within one allocation unit of 8), no spills, and its reduction issues its partials' loads back to back."""
    import re

    from inspect_ir import compile_wgmma, registers_of, sass_of, stack_of
    from qerl_kernels.nvfp4_matmul import split_red

    bt = 8
    red = split_red(64, bt, 4)
    kw = dict(split=True, XG=False, XS=True, TILED=True, EW=True, TRIG=True)
    base, k = compile_wgmma(1, bt, 2, RED=1, **kw), compile_wgmma(1, bt, 2, RED=red, **kw)
    assert red == 8 and stack_of(k) == 0 and -(-registers_of(k) // 8) == -(-registers_of(base) // 8)
    sass = [ln for ln in sass_of(k).splitlines() if re.search(r"/\*[0-9a-f]{4}\*/", ln)]
    after = " ".join(sass[next(i for i, ln in enumerate(sass) if "ATOMG" in ln):])
    assert "LDG " * (red * bt // 2) in " ".join(re.findall(r"\b(LDG|FADD)", after)) + " "  # RED partials in a row


def test_input_validation():
    from qerl.quant import nvfp4
    from qerl_kernels.ops import KernelInputError, nvfp4_matmul, nvfp4_matmul_t

    p, s, gs = nvfp4.quantize(torch.randn(32, 64))
    x = torch.randn(4, 64).bfloat16()
    with pytest.raises(KernelInputError, match="bf16 or fp16"):
        nvfp4_matmul(x.float(), p, s, gs)
    with pytest.raises(KernelInputError, match="last dim of the input is 48, expected 64"):
        nvfp4_matmul(torch.randn(4, 48).bfloat16(), p, s, gs)
    with pytest.raises(KernelInputError, match="uint8"):
        nvfp4_matmul(x, p.to(torch.int16), s, gs)
    with pytest.raises(KernelInputError, match="scale must be float8_e4m3fn"):
        nvfp4_matmul(x, p, s[:, :2], gs)
    with pytest.raises(KernelInputError, match="contiguous"):
        nvfp4_matmul(x, p.t().contiguous().t(), s, gs)
    with pytest.raises(KernelInputError, match="float32"):
        nvfp4_matmul(x, p, s, gs.double())
    with pytest.raises(KernelInputError, match="lora_b goes with xa or lora_a"):
        nvfp4_matmul(x, p, s, gs, xa=torch.randn(4, 8).bfloat16())
    la, lb = torch.randn(8, 64).bfloat16(), torch.randn(32, 8).bfloat16()
    with pytest.raises(KernelInputError, match="is not x · lora_aᵀ"):  # (both: xa must be x · lora_aᵀ's shape)
        nvfp4_matmul(x, p, s, gs, xa=torch.randn(4, 4).bfloat16(), lora_b=lb, lora_a=la)
    with pytest.raises(KernelInputError, match=r"lora_a must be a float \[R, K=64\]"):
        nvfp4_matmul(x, p, s, gs, lora_b=lb, lora_a=la[:, :32])
    with pytest.raises(KernelInputError, match="does not match N=32, R=8"):
        nvfp4_matmul(x, p, s, gs, lora_b=lb[:, :4], lora_a=la)
    with pytest.raises(KernelInputError, match="expected 32"):
        nvfp4_matmul_t(torch.randn(4, 64).bfloat16(), p, s, gs)


def test_heuristic_configs_fill_the_gpu():
    from qerl_kernels import ops
    from qerl_kernels.ops import heuristic, m_bucket

    assert [m_bucket(m) for m in (1, 3, 16, 17, 9000)] == [1, 4, 16, 32, 8192]
    # decode sizes: the warpgroup-MMA kernel, activations staged by the kernel (no pre-pass), K split over programs;
    # for eager calls the single-launch register-fragment kernel (EAGER)
    cfg = heuristic("fwd", 1, 3584, 3584, 132)
    assert cfg["WGMMA"] == 1 and cfg["BT"] == 8 and cfg["XS"] == 1 and cfg["SPLIT"] > 1
    assert cfg["EAGER"]["MMV"] == 1 and cfg["EAGER"]["BM"] == 8 and cfg["EAGER"]["SPLIT"] > 1
    assert heuristic("fwd", 16, 3584, 3584, 132)["EAGER"]["BM"] == 16
    assert heuristic("fwd", 16, 3584, 3584, 132, wgmma=False)["MMV"] == 1  # (fp16, interpreter: no Gluon)
    # a tiny shape (0.5B q/k/v: 18 row tiles) splits K to fill the SMs, at most K / 256 ways
    assert heuristic("fwd", 8, 1152, 896, 132)["SPLIT"] == 3
    ops.HEURISTIC = "v1"  # the older rule: MMV at M <= 16, the pre-pass and BT 32 / 64 at M 17..128
    try:
        assert heuristic("fwd", 1, 3584, 3584, 132)["MMV"] == 1
        assert heuristic("fwd", 64, 3584, 3584, 132)["BT"] == 64 and "XS" not in heuristic("fwd", 64, 3584, 3584, 132)
    finally:
        ops.HEURISTIC = "v2"
    assert "MMV" not in heuristic("fwd", 16, 3584, 3600, 132)  # K % 32 != 0: tensor-core tiles
    cfg = heuristic("bwd", 1, 3584, 3584, 132)
    assert cfg["BM"] == 16 and cfg["SPLIT"] > 1
    cfg = heuristic("fwd", 64, 3584, 3584, 132)  # M 17..64, K % 128 == 0, < 128 row tiles: staged in the kernel
    assert cfg["WGMMA"] == 1 and cfg["BT"] == 32 and cfg["XS"] == 1 and cfg["SPLIT"] > 1 and "EAGER" not in cfg
    cfg = heuristic("fwd", 32, 37888, 3584, 132)  # many row tiles: the pre-pass, no split
    assert cfg["WGMMA"] == 1 and cfg["BT"] == 16 and "XS" not in cfg and cfg["SPLIT"] == 1
    assert heuristic("fwd", 128, 3584, 3584, 132)["BT"] == 64
    assert "WGMMA" not in heuristic("fwd", 64, 3584, 3600, 132)  # K % 128 != 0: tensor-core tiles
    assert heuristic("fwd", 64, 3584, 3584, 132, wgmma=False)["BM"] == 64  # tile up to DQ_ROWS
    assert heuristic("fwd", 4096, 3584, 3584, 132) == {"DQ": 1, "CHUNK": ops.DQ_CHUNK}  # above: dequantize + cuBLAS
    assert heuristic("bwd", 65, 3584, 3584, 132)["DQ"] == 1


def test_seam_opt_in(monkeypatch):
    from qerl.ops import linear

    monkeypatch.setattr(linear, "_BACKENDS", [])
    monkeypatch.setenv("QERL_KERNELS", "triton")
    x = torch.randn(2, 64).bfloat16()
    p = torch.zeros(8, 32, dtype=torch.uint8)
    assert linear.select_backend(x, p) is None  # CPU without the interpreter: reference
    assert [b.name for b in linear._BACKENDS] == ["triton-nvfp4"]


def test_seam_default_uses_the_kernels(monkeypatch):
    """Default (QERL_KERNELS unset = auto): the kernels for every forward and backward they support
    (the reference measured 1.5-50x slower on the H200); off = reference; bad values raise."""
    from qerl.ops import linear

    monkeypatch.setattr(linear, "_BACKENDS", [])
    monkeypatch.delenv("QERL_KERNELS", raising=False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # makes supports() true on CPU; no kernel runs here
    p = torch.zeros(8, 32, dtype=torch.uint8)
    small, large = torch.randn(2, 3, 64).bfloat16(), torch.randn(4096, 64).bfloat16()
    b = linear.select_backend(small, p)
    assert b is not None and b.name == "triton-nvfp4" and linear.select_backend(large, p) is b
    assert b.backward_input is not linear.reference_backward_input
    assert linear.select_backend(small.float(), p) is None  # fp32 activations: reference
    monkeypatch.setattr(linear, "_BACKENDS", [])
    monkeypatch.setenv("QERL_KERNELS", "off")
    assert linear.select_backend(small, p) is None and linear._BACKENDS == []
    monkeypatch.setenv("QERL_KERNELS", "fast")
    with pytest.raises(ValueError, match="QERL_KERNELS"):
        linear.select_backend(small, p)


def test_sm90_code_inspection_without_a_gpu():
    """The kernels compile for Hopper on a CPU machine: packed-weight loads are software-pipelined
    (cp.async), swapped large tiles use wgmma, decode tiles mma.sync, and the main loop's static
    cost stays near the packed-word dequantization's (~5 SASS instructions per weight, was ~25
    with per-element decoding) — a static regression guard, not a timing."""
    from inspect_ir import inspect

    big = inspect(128, 128, 64, 8, 3, swap=1)
    assert big["cp_async"] > 0 and big["wgmma"] > 0
    dec = inspect(16, 64, 256, 4, 4, 3)
    assert dec["cp_async"] > 0 and dec["mma_sync"] > 0
    assert dec["loop_sass_per_weight"] < 8 and dec["loop_top_ops"].get("HMUL2", 0) > 0
    bwd = inspect(128, 64, 128, 8, 3, swap=1, kind="bwd")
    assert bwd["wgmma"] > 0
    # the register-fragment decode kernel: 128-bit weight loads, 8 inline mma.sync per K step, no shared
    # memory, under 4 instructions per weight for 8 activation rows
    mmv = inspect(8, 64, 128, 4, 1, kind="mmv")
    assert mmv["k_per_loop"] == 128 and mmv["mma_sync"] == 8 and mmv["shared_bytes"] == 0 and mmv["wgmma"] == 0
    assert mmv["global_loads"].get("ld.global.nc.v4.u32", 0) >= 6  # 2 weight rows + 4 activation words
    assert mmv["loop_sass_per_weight"] < 4.0 and mmv["loop_top_ops"].get("HMMA", 0) == 8
    assert 0 < mmv["registers"] <= 64  # room for 32+ resident warps per SM


def test_sm90_two_row_blocks_without_a_gpu(monkeypatch):
    """RB = 2 shares the activation fragments between two blocks of 16 weight rows: twice the MMAs per
    step, fewer instructions per weight than RB = 1 at 16 activation rows."""
    from inspect_ir import inspect

    monkeypatch.setenv("QERL_INSPECT_XPRE", "0")
    one = inspect(16, 64, 128, 4, 1, kind="mmv")
    monkeypatch.setenv("QERL_INSPECT_RB", "2")
    two = inspect(16, 128, 128, 4, 1, kind="mmv")
    assert two["mma_sync"] == 2 * one["mma_sync"] and two["shared_bytes"] == 0
    assert two["loop_sass_per_weight"] < one["loop_sass_per_weight"]


def test_resident_programs_per_sm():
    """Hopper residency from registers / shared memory / warps (the numbers the v8 timeline measured: 56
    registers, 2 warps -> 18 programs per SM; 102 -> 9)."""
    from inspect_ir import resident_programs

    assert resident_programs(56, 0, 2) == 18 and resident_programs(64, 4096, 2) == 16
    assert resident_programs(102, 4, 2) == 9 and resident_programs(32, 0, 1) == 32
    assert resident_programs(128, 0, 4) == 4 and resident_programs(40, 100_000, 4) == 2


def test_fused_lora_keeps_the_decode_kernels_residency(monkeypatch):
    """The fused LoRA producers live in the decode kernel, so their registers and shared memory apply to
    every tile of the launch: on the tuned M = 1 config of the large projections (BM 8, BN 32, 2 warps,
    activations loaded at use) the fused kernel must keep >= 16 of the base kernel's 18 programs per SM (a
    register-fragment producer with 102 registers halved it and cost +32..54%), the PDL variant all 18."""
    from inspect_ir import inspect

    monkeypatch.setenv("QERL_INSPECT_XPRE", "0")
    base = inspect(8, 32, 128, 2, 1, kind="mmv")["resident_programs_per_sm"]
    monkeypatch.setenv("QERL_INSPECT_FUSED", "1")
    fused = inspect(8, 32, 128, 2, 1, kind="mmv")["resident_programs_per_sm"]
    monkeypatch.setenv("QERL_INSPECT_FUSED", "0")
    monkeypatch.setenv("QERL_INSPECT_PDL", "1")
    pdl = inspect(8, 32, 128, 2, 1, kind="mmv")["resident_programs_per_sm"]
    assert base == 18 and fused >= 16 and pdl == base


def test_sm90_pdl_lora_pair_without_a_gpu(monkeypatch):
    """The PDL LoRA pair compiles for sm_90: the decode kernel waiting for xa (griddepcontrol.wait in its
    epilogue) keeps no shared memory and the base kernel's registers (its occupancy); the primary
    (qerl_kernels.lora_xa) has its own; the trace stamps compile in."""
    from inspect_ir import compile_sm90, inspect

    monkeypatch.setenv("QERL_INSPECT_XPRE", "0")
    base = inspect(8, 32, 128, 2, 1, kind="mmv")
    monkeypatch.setenv("QERL_INSPECT_PDL", "1")
    pdl = compile_sm90("mmv", 8, 32, 128, 2, 1)
    assert pdl.metadata.shared == 0 and "griddepcontrol.wait" in pdl.asm["ptx"]
    assert inspect(8, 32, 128, 2, 1, kind="mmv")["registers"] <= base["registers"]
    xa = compile_sm90("loraxa", 8, 32, 128, 4, 1)
    assert "griddepcontrol.launch_dependents" in xa.asm["ptx"] and xa.metadata.shared > 0
    monkeypatch.setenv("QERL_INSPECT_TRACE", "1")
    assert "%globaltimer" in compile_sm90("loraxa", 8, 32, 128, 4, 1).asm["ptx"]


def test_tuned_table_falls_back_to_the_nearest_bucket(monkeypatch):
    from qerl_kernels import ops

    table = {"fwd:1:64:128": {"BM": 16, "SPLIT": 2}, "fwd:2048:64:128": {"BM": 128, "SPLIT": 1}}
    monkeypatch.setattr(ops, "_tuned", lambda name: table)
    assert ops.tuned_entry("X", "fwd", 1, 64, 128)["SPLIT"] == 2
    assert ops.tuned_entry("X", "fwd", 4, 64, 128)["BM"] == 16  # bucket 4: nearest tuned is 1
    assert ops.tuned_entry("X", "fwd", 4000, 64, 128)["BM"] == 128
    assert ops.tuned_entry("X", "bwd", 4, 64, 128) is None  # other kind: heuristic
    assert ops.tuned_entry("X", "fwd", 4, 64, 256) is None  # other shape
    # a decode-kernel entry is not borrowed above M = 32 (a table tuned only at decode sizes), nor a
    # dequantize + cuBLAS entry below M = 64
    table.update({"fwd:32:64:256": {"MMV": 1, "BM": 32}, "fwd:2048:64:256": {"DQ": 1},
                  "fwd:16:32:32": {"GEMV": 1}, "fwd:128:32:32": {"DQ": 1}})
    assert ops.tuned_entry("X", "fwd", 20, 64, 256)["MMV"] == 1
    assert ops.tuned_entry("X", "fwd", 64, 64, 256)["DQ"] == 1  # nearest that suits: 2048, not 32
    assert ops.tuned_entry("X", "fwd", 8192, 64, 256)["DQ"] == 1
    assert ops.tuned_entry("X", "fwd", 4, 32, 32)["GEMV"] == 1
    assert ops.tuned_entry("X", "fwd", 48, 32, 32) is None  # GEMV too small an M, DQ too large one: heuristic
    # warpgroup MMA: small tiles up to M = 256, large ones (BT >= 128) for any M above 16
    table.update({"fwd:64:96:256": {"WGMMA": 1, "BT": 64}, "fwd:2048:128:256": {"WGMMA": 1, "BT": 256}})
    assert ops.tuned_entry("X", "fwd", 200, 96, 256)["BT"] == 64
    assert ops.tuned_entry("X", "fwd", 600, 96, 256) is None
    assert ops.tuned_entry("X", "fwd", 8192, 128, 256)["BT"] == 256
    assert ops.tuned_entry("X", "fwd", 12, 128, 256) is None


def test_untuned_shape_borrows_the_nearest_tuned_shapes_config(monkeypatch):
    """A shape without entries takes, forward at M > 16, the config of the tuned shape nearest in log N + log K at the
    same M bucket, its split rescaled to the same program count; its own entries, decode sizes, the backward, ragged
    shapes, far shapes at M >= 512 and TRANSFER = False keep the old rules."""
    from qerl_kernels import ops

    table = {
        "fwd:64:4608:3584": {"WGMMA": 1, "WS": 1, "C": 2, "KS": 1, "MT": 1, "BT": 64, "NS": 6, "SPLIT": 1},
        "fwd:64:3584:18944": {"WGMMA": 1, "WS": 1, "C": 1, "MT": 1, "BT": 64, "NS": 6, "SPLIT": 2},
        "fwd:64:1152:896": {"WGMMA": 1, "WG": 1, "BT": 32, "NS": 3, "SPLIT": 3, "XS": 1},
        "fwd:256:3584:3584": {"WGMMA": 1, "WS": 1, "C": 2, "MT": 1, "BT": 128, "NS": 4, "SPLIT": 1, "SK": 1},
        "fwd:256:37888:3584": {"WGMMA": 1, "WS": 1, "C": 2, "MT": 1, "BT": 128, "NS": 4, "SPLIT": 1},
        "fwd:512:37888:3584": {"WGMMA": 1, "WS": 1, "C": 2, "MT": 1, "BT": 128, "NS": 4, "SPLIT": 1},
        "fwd:8:4608:3584": {"WGMMA": 1, "WG": 1, "BT": 8, "SPLIT": 7, "EAGER": {"MMV": 1}},
        "bwd:64:4608:3584": {"BM": 64, "BN": 64, "BK": 128, "SWAP": 1, "SPLIT": 9, "num_warps": 4, "num_stages": 3},
        "fwd:2048:4608:3584": {"DQ": 1, "CHUNK": 1 << 25},
    }
    monkeypatch.setattr(ops, "_tuned", lambda name: table)
    ops._transfer.cache_clear()
    monkeypatch.setattr(ops, "TRANSFER", True)
    try:
        # Llama-3.1-8B q/k/v (6144 x 4096): nearest is 4608 x 3584; KS tiles are 64 rows: 72 -> 96 tiles, split 1 stays
        cfg = ops.transferred_entry("X", "fwd", 64, 6144, 4096)
        assert cfg["WS"] == 1 and cfg["KS"] == 1 and cfg["SPLIT"] == 1
        assert ops.transfer_source("X", "fwd", 64, 6144, 4096) == (4608, 3584)
        assert ops.config_source("X", "fwd", 64, 6144, 4096) == "transfer:4608x3584"
        assert ops.config_source("X", "fwd", 64, 4608, 3584) == "tuned"
        # down-like (4096 x 14336): nearest is 3584 x 18944, its 56 tiles of 64 rows at split 2 -> 64 tiles, split 2
        down = ops.transferred_entry("X", "fwd", 40, 4096, 14336)
        assert down["C"] == 1 and down["SPLIT"] == round(2 * 56 / 64)
        # a small shape borrows the small one's config; 18 tiles -> 32: split 3 -> 2
        small = ops.transferred_entry("X", "fwd", 64, 2048, 1024)
        assert small["BT"] == 32 and small["SPLIT"] == 2
        # split bounded by the reduction: at least two 128-wide K steps per program
        assert ops.transferred_entry("X", "fwd", 64, 128, 512)["SPLIT"] == 2  # 18 tiles -> 2 would ask for 27
        # more split than tuned only while the tiles fill less than two waves: 16384 x 2048 borrowing 37888 x 3584's
        # split 1 (296 -> 128 row tiles of 128) takes 2 at M = 256 (x 2 token tiles of 128: 256 < 2 x 132 programs),
        # 1 at M = 512 (512 programs)
        ws = table["fwd:256:37888:3584"]
        assert ops.rescaled_split(dict(ws), 37888, 16384, 2048, 256, 132)["SPLIT"] == 2
        assert ops.rescaled_split(dict(ws), 37888, 16384, 2048, 512, 132)["SPLIT"] == 1
        assert ops.transferred_entry("X", "fwd", 256, 16384, 2048)["SPLIT"] == 2
        # stream-K keeps its schedule; DQ its windows; the decode entry's EAGER never travels
        assert ops.transferred_entry("X", "fwd", 256, 4096, 4096)["SK"] == 1
        assert ops.transferred_entry("X", "fwd", 2048, 4096, 4096) == {"DQ": 1, "CHUNK": 1 << 25}
        # from M = 256 on (where the heuristic dequantizes), only weights of >= 12 M elements: Gemma-2-2B's o
        # projection (2304 x 2048) borrows at M = 64, not at 256
        table["fwd:256:2560:2048"] = {"WGMMA": 1, "WS": 1, "C": 1, "MT": 1, "BT": 128, "NS": 4, "SPLIT": 1}
        assert ops.transferred_entry("X", "fwd", 64, 2304, 2048) is not None
        assert ops.transferred_entry("X", "fwd", 256, 2304, 2048) is None
        # from M = 512 on, only from a shape within 2x (d <= 1): 28672 x 4096 borrows, 16384 x 2048 does not
        assert ops.transferred_entry("X", "fwd", 512, 28672, 4096)["WS"] == 1
        assert ops.transferred_entry("X", "fwd", 512, 16384, 2048) is None
        # not transferred: the backward, decode sizes (the heuristic's decode configs), ragged shapes, buckets no
        # shape has, off
        assert ops.transferred_entry("X", "bwd", 64, 6144, 4096) is None
        assert ops.transferred_entry("X", "fwd", 8, 6144, 4096) is None
        assert ops.transferred_entry("X", "fwd", 64, 6144, 4000) is None
        assert ops.transferred_entry("X", "fwd", 64, 6100, 4096) is None
        assert ops.transferred_entry("X", "fwd", 128, 6144, 4096) is None
        assert ops.config_source("X", "fwd", 128, 6144, 4096) == "heuristic"
        # a shape's own entries come first, even from another bucket (tuned_entry's nearest bucket)
        assert ops.table_entry("X", "fwd", 2048, 4608, 3584)["DQ"] == 1
        assert ops.table_entry("X", "fwd", 32, 3584, 18944)["SPLIT"] == 2
        # config_for (what every call resolves through) takes it, and adds the eager one-launch config as for a
        # tuned entry (a 2.1 GFLOP call: at most EAGER_ONE_LAUNCH_FLOPS)
        monkeypatch.setattr(ops, "_device_name", lambda index: "X")
        monkeypatch.setattr(ops, "_sm_count", lambda index: 132)
        resolved = ops.config_for("fwd", 64, 6144, 4096, torch.device("cuda", 0))
        assert resolved["WS"] == 1 and resolved["EAGER"]["XS"] == 1
        assert ops.config_for("bwd", 64, 6144, 4096, torch.device("cuda", 0)) == ops.heuristic("bwd", 64, 6144,
                                                                                              4096, 132)
        monkeypatch.setattr(ops, "TRANSFER", False)
        assert ops.transferred_entry("X", "fwd", 64, 6144, 4096) is None
        assert "WS" not in ops.config_for("fwd", 64, 6144, 4096, torch.device("cuda", 0))
        assert ops.table_entry("X", "fwd", 64, 6144, 4096) is None
    finally:
        ops._transfer.cache_clear()


def test_lora_route_picks_the_measured_launch():
    """Where x · lora_aᵀ comes from (reports/kernels/README.md, LoRA): fused producers at M <= 8 and at
    M <= 16 with K <= 8192, the PDL launch pair at M = 9..16 with larger K (register-prefetch decode kernel
    only) and in front of the warpgroup-MMA kernel up to M = 64, x @ lora_a.T for tiles, DQ and the
    backward; forcing modes for experiments."""
    from qerl_kernels.ops import lora_route

    mmv, tile = {"MMV": 1}, {"BM": 64}
    assert lora_route("fwd", mmv, 1, 27648) == "fused"
    assert lora_route("fwd", mmv, 16, 8192) == "fused"
    assert lora_route("fwd", mmv, 16, 13824) == "pdl"
    assert lora_route("fwd", mmv, 32, 5120) == "matmul"
    assert lora_route("fwd", tile, 4, 5120) == "matmul"
    assert lora_route("bwd", mmv, 1, 5120) == "matmul"
    assert lora_route("fwd", mmv, 4, 5120, "pdl") == "pdl"
    assert lora_route("fwd", mmv, 16, 13824, "fused") == "matmul"
    wg = {"WGMMA": 1, "BT": 16}  # decode sizes on the warpgroup-MMA kernel (tuned keys): its epilogue waits on PDL
    assert lora_route("fwd", wg, 16, 3584) == "pdl" and lora_route("fwd", wg, 9, 27648) == "pdl"
    assert lora_route("fwd", wg, 16, 3584, "fused") == "matmul"
    assert lora_route("fwd", wg, 64, 3584) == "pdl" and lora_route("fwd", wg, 65, 3584) == "matmul"
    assert lora_route("bwd", wg, 16, 3584) == "matmul"
    # a rank the PDL primary cannot take (more than 16 rank chunks, too large for one program): the matmul
    assert lora_route("fwd", wg, 50, 3584, r=512) == "pdl" and lora_route("fwd", wg, 50, 3584, r=256) == "pdl"
    assert lora_route("fwd", wg, 50, 3584, r=1024) == "matmul" and lora_route("fwd", mmv, 16, 13824, r=1024) == "matmul"


def test_pdl_primary_shares_and_pipeline(monkeypatch):
    """Before the warpgroup-MMA kernel the PDL primary runs few K shares of ~``XA_CHUNKS`` 128-wide chunks each (2 at
    the 7B hidden size, 11 at its intermediate size, one for short K, at most ``XA_PROGRAMS``; 4 chunks each before
    a short kernel), its chunk loop 3 deep;
    before the register-fragment kernel its earlier shape; ``ops.XA_STAGES`` forces a depth; ranks above 32 go in
    chunks of 32 while there are ticket slots for them."""
    from qerl_kernels import ops

    monkeypatch.setattr(ops, "XA_STAGES", 0)
    assert ops._xa_stages(3584) == 3 and ops._xa_stages(18944) == 3
    assert [ops.xa_shares(k) for k in (128, 1792, 3584, 5120, 18944, 27648)] == [1, 1, 2, 3, 11, 16]
    # before a short kernel (at most 48 Mi weights: the 7B q/k/v and o): 4 chunks per share
    assert [ops.xa_shares(3584, N=n) for n in (4608, 3584, 37888)] == [7, 7, 2]
    assert ops.xa_shares(18944, N=3584) == 11 and ops.xa_shares(5120, N=7168) == 10
    # before the register-fragment decode kernel (not measured again): one share per chunk, 3 deep above K = 8192
    assert ops.xa_shares(3584, mmv=True) == 28 and ops.xa_shares(18944, mmv=True) == 64
    assert ops._xa_stages(3584, mmv=True) == 1 and ops._xa_stages(18944, mmv=True) == 3
    monkeypatch.setattr(ops, "XA_PROGRAMS", 4)
    assert ops.xa_shares(27648) == 4
    monkeypatch.setattr(ops, "XA_STAGES", 2)
    assert ops._xa_stages(3584) == 2 and ops._xa_stages(27648) == 2
    assert [ops.xa_rank_chunk(r) for r in (16, 32, 48, 64, 128, 512, 1024)] == [0, 0, 0, 32, 32, 32, 0]


def test_committed_tables_use_compilable_tiles():
    """Every committed tuned table (H200, H100): non-swapped tiles with BM > 32 do not compile (wgmma B
    operand), none may be committed; the register-fragment decode kernel (MMV) has 16 x RB (1 | 2) weight
    rows per warp, 8..64 activation rows and 128-wide K steps; warpgroup-MMA entries (WGMMA) are forward,
    M 1..256, with their own keys only (``SK``: stream-K on the plain loop) and rings that fit in shared memory;
    warp-specialised entries (WS) are forward, M 17..512, with rings (and LoRA-32 epilogue tiles) that fit and a
    register split that exists; both GPUs' tables exist."""
    import json
    from pathlib import Path

    import qerl_kernels.nvfp4_wgmma_ws as ws_mod
    import qerl_kernels.ops as ops

    paths = sorted((Path(ops.__file__).parent / "tuned").glob("*.json"))
    assert {p.stem for p in paths} >= {"NVIDIA_H200", "NVIDIA_H100_80GB_HBM3"}
    for path in paths:
        table = json.loads(path.read_text())
        tiles = [c for c in table.values() if not c.get("MMV") and not c.get("GEMV") and not c.get("DQ")
                 and not c.get("WGMMA")]
        wsk = {k: c for k, c in table.items() if c.get("WS")}  # warp-specialised: forward, M 17..512
        assert all(set(c) <= {"WGMMA", "WS", "C", "MT", "BT", "NS", "OCC", "SPLIT", "SK", "TMA", "DB", "KS"}
                   and not (c.get("KS") and (c.get("SK") or c["C"] == 1 or c["SPLIT"] > 1))
                   and k.startswith("fwd:") and (not c.get("DB") or c.get("TMA") and (c["C"], c["OCC"]) == (1, 1)
                                                 and (c["MT"] == 1 or c["BT"] <= 64) or (c["C"], c["BT"]) == (2, 32))
                   and 17 <= int(k.split(":")[1]) <= 512 and c["C"] in (1, 2, 4) and c["MT"] in (1, 2)
                   and c["BT"] in (32, 64, 128) and ws_mod.ring_bytes(c["C"], c["MT"], c["BT"], c["NS"], R=32,
                                                                     KS=bool(c.get("KS"))) * c["OCC"] <= 227 * 1024 and ws_mod.register_split(c["C"], c["OCC"]) for k, c in wsk.items()), path
        wg = {k: c for k, c in table.items() if c.get("WGMMA") and not c.get("WS")}  # warpgroup MMA: fwd, M 1..256
        assert all(set(c) <= {"WGMMA", "WG", "BT", "NS", "SPLIT", "XG", "PIPE", "NSW", "MT", "XS", "SK", "EAGER"}
                   and k.startswith("fwd:")
                   and 1 <= int(k.split(":")[1]) <= 256 and c["BT"] % 8 == 0 and c["BT"] <= 256
                   and c["WG"] in ((1, 2, 4) if c.get("SK") else (1, 2)) and c.get("MT", 1) in (1, 2)
                   and c.get("SK", 0) in (0, 1, 2) and not (c.get("SK") and c.get("PIPE")) and c["NS"] >= 2
                   for k, c in wg.items()), path  # (SK: the stream-K schedule, plain loop only)
        # NS * (activation tile + weight/scale slots) within the 227 KiB of shared memory an sm_90 program may use
        assert all(c["NS"] * c["BT"] * 256 + max(c["NS"], c.get("NSW", 0)) * 72 * 64 * c["WG"] * c.get("MT", 1)
                   <= 227 * 1024 for c in wg.values()), path
        assert all(set(c) == {"DQ", "CHUNK"} and c["CHUNK"] >= 0 for c in table.values() if c.get("DQ")), path
        # decode sizes on WGMMA keep the single-launch decode kernel for eager calls (ops.launch_mode)
        assert all((c.get("EAGER") or {}).get("MMV") or (c.get("EAGER") or {}).get("GEMV")
                   for k, c in wg.items() if int(k.split(":")[1]) <= 16), path
        assert not any("EAGER" in c for k, c in table.items() if int(k.split(":")[1]) > 16 or not c.get("WGMMA"))
        mmv_eager = [c["EAGER"] for c in wg.values() if c.get("EAGER", {}).get("MMV")]
        mmv = [c for c in table.values() if c.get("MMV")] + mmv_eager
        assert tiles and all(c["SWAP"] or c["BM"] <= 32 for c in tiles), path
        assert all({"BM", "BN", "BK", "SPLIT", "SWAP", "num_warps", "num_stages"} <= set(c) for c in tiles), path
        assert mmv and all(c["BM"] in (8, 16, 32, 64) and c["BN"] == 16 * c.get("RB", 1) * c["num_warps"]
                           and c["BK"] == 128 and c.get("RB", 1) in (1, 2) for c in mmv), path
        assert all(k.split(":")[0] in ("fwd", "bwd") and int(k.split(":")[1]) in ops.M_BUCKETS for k in table), path


def test_forced_config_replaces_the_tuned_one(monkeypatch):
    """A complete QERL_KERNEL_CONFIG (as the tuner and selfcheck pass) must not inherit keys of the
    tuned entry (an MMV=1 from the table turned forced tensor-core tiles into MMV launches)."""
    import json

    import qerl_kernels.ops as ops

    monkeypatch.setattr(ops, "_device_name", lambda i: "NVIDIA H200")
    monkeypatch.setattr(ops, "_sm_count", lambda i: 132)
    dev = torch.device("cuda", 0)
    tuned = ops.config_for("fwd", 1, 3584, 3584, dev)  # the committed table: WGMMA, the decode kernel for eager calls
    assert tuned.get("WGMMA") == 1 and tuned["EAGER"].get("MMV") == 1
    forced = dict(BM=64, BN=128, BK=128, SWAP=1, SPLIT=1, num_warps=4, num_stages=4)
    monkeypatch.setenv("QERL_KERNEL_CONFIG", json.dumps(forced))
    assert ops.config_for("fwd", 1, 3584, 3584, dev) == forced
    monkeypatch.setenv("QERL_KERNEL_CONFIG", json.dumps({"SPLIT": 2}))  # partial: merged
    assert ops.config_for("fwd", 1, 3584, 3584, dev)["SPLIT"] == 2


def test_unrunnable_paths_step_down():
    """MMV 2 -> MMV 1 when K % 256 != 0 or the scale rows are not 4-byte aligned; MMV -> GEMV under the
    interpreter or with K % 32 != 0; GEMV -> a tensor-core tile with packed rows that are not 4-byte
    aligned (a storage offset)."""
    from qerl_kernels.ops import _runnable

    x = torch.zeros(3, 64, dtype=torch.bfloat16)
    p = torch.zeros(16, 32, dtype=torch.uint8)
    s = torch.zeros(16, 4, dtype=torch.uint8)
    mmv = dict(MMV=1, BM=8, BN=64, BK=128, SPLIT=3, num_warps=4, num_stages=2, XPRE=0)
    assert _runnable("fwd", mmv, 3, 64, x, p, s, True)["GEMV"] == 1
    assert _runnable("fwd", mmv, 3, 64, x, p, s, True)["SPLIT"] == 3
    assert _runnable("fwd", mmv, 3, 128, x.new_zeros(3, 128), p, s, False)["MMV"] == 1  # runnable as asked
    assert _runnable("fwd", mmv, 3, 128, torch.zeros(3, 128, dtype=torch.float16), p, s, False)["GEMV"] == 1
    odd = torch.zeros(16 * 32 + 1, dtype=torch.uint8)[1:].view(16, 32)  # data_ptr % 4 == 1
    tile = _runnable("fwd", mmv, 3, 64, x, odd, s, True)
    assert "GEMV" not in tile and "MMV" not in tile and tile["BM"] == 16
    assert _runnable("bwd", dict(BM=16, SPLIT=1), 3, 64, x, p, s, False) == dict(BM=16, SPLIT=1)
    # the warpgroup-MMA kernel: bf16, K % 128 == 0, no interpreter (Gluon), else the path below it
    wg = dict(WGMMA=1, WG=1, BT=32, NS=3, SPLIT=2, XG=1)
    x128, p128, s128 = x.new_zeros(20, 128), torch.zeros(16, 64, dtype=torch.uint8), torch.zeros(16, 8, dtype=torch.uint8)
    assert _runnable("fwd", wg, 20, 128, x128, p128, s128, False) == wg
    for args in ((20, 128, x128, p128, s128, True), (20, 128, x128.half(), p128, s128, False),
                 (20, 64, x.new_zeros(20, 64), p, s, False)):
        down = _runnable("fwd", wg, *args)
        assert "WGMMA" not in down and down.get("BM") in (16, 32), down


def test_dequant_kernel_windows_under_interpreter():
    """The DQ path's dequantization: bit-exact with qerl.quant.nvfp4.dequantize (fp32 out; fp16 too,
    whose cast the interpreter rounds correctly), written into a strided window of a larger buffer
    without touching its neighbours; a column window of the packed/scale tensors; clear shape errors."""
    code = """
import json, torch
from qerl.quant import nvfp4
from qerl_kernels.nvfp4_dequant import dequantize_into
g = torch.Generator().manual_seed(3)
p, s, gs = nvfp4.quantize(torch.randn(37, 96, generator=g) * 0.1)
s8 = s.view(torch.uint8)
res = {}
for dt in (torch.float32, torch.float16):
    ref = nvfp4.dequantize(p, s, gs, dt)
    buf = torch.full((40, 130), 7.0, dtype=dt)
    dequantize_into(buf[2:39, 5:101], p, s8, gs, interpret=True)
    inside = torch.equal(buf[2:39, 5:101], ref)
    buf[2:39, 5:101] = 7.0
    res[str(dt)] = [inside, bool((buf == 7.0).all())]
win = dequantize_into(torch.empty(37, 48), p[:, 16:40], s8[:, 2:5], gs, interpret=True)
res["col_window"] = torch.equal(win, nvfp4.dequantize(p, s, gs, torch.float32)[:, 32:80])
try:
    dequantize_into(torch.empty(37, 48), p, s8, gs, interpret=True)
except ValueError as e:
    res["error"] = str(e)
print(json.dumps(res))
"""
    out = _interp(code)
    assert out.returncode == 0, out.stdout + out.stderr
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["torch.float32"] == [True, True] and res["torch.float16"] == [True, True]
    assert res["col_window"] is True
    assert "out (37, 48), packed (37, 48)" in res["error"]


def test_lora_a_computes_xa_like_the_explicit_path():
    """``lora_a`` (x · lora_aᵀ inside the op; fused into the decode launch on a GPU) gives the same
    output as passing ``xa = x @ lora_a.T`` (under the interpreter both run the same kernels). The decode kernels'
    route: the in-kernel route for small weights (``LORA_INKERNEL_DECODE_WEIGHTS``) keeps ``x · lora_aᵀ`` in fp32 and
    has its own test below."""
    r = _interp("""
import torch
from qerl.quant import nvfp4
from qerl_kernels import ops
from qerl_kernels.ops import nvfp4_matmul
ops.LORA_INKERNEL_DECODE_WEIGHTS = 0
g = torch.Generator().manual_seed(5)
N, K = 40, 96
p, s, gs = nvfp4.quantize(torch.randn(N, K, generator=g) * 0.05)
for M, R in ((1, 8), (5, 32)):  # rank padded to 16 / a full two-MMA rank
    x = torch.randn(M, K, generator=g).bfloat16()
    la = (torch.randn(R, K, generator=g) * 0.1).bfloat16()
    lb = (torch.randn(N, R, generator=g) * 0.1).bfloat16()
    fused = nvfp4_matmul(x, p, s, gs, None, None, lb, 0.5, lora_a=la)
    assert torch.equal(fused, nvfp4_matmul(x, p, s, gs, None, x @ la.T, lb, 0.5))
    assert not torch.equal(fused, nvfp4_matmul(x, p, s, gs))
print("OK")
""")
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr[-2000:]


def test_tile_computes_lora_xa_in_its_own_launch_under_interpreter():
    """The "inkernel" LoRA route (``LXA``): one tile launch computes ``x · lora_aᵀ`` over its K share and adds its
    share of ``s · xa · Bᵀ`` before the split reduction — as close to the fp32 definition as the two-launch route
    (``x @ lora_a.T`` first), with split-K over 2 / 3 programs, both operand orders, bias, rank 8 (padded to 16) /
    32, and a masked K tail; every ticket back at zero."""
    r = _interp("""
import json, os, torch
from qerl.quant import nvfp4
from qerl_kernels import ops
from qerl_kernels.ops import nvfp4_matmul
g = torch.Generator().manual_seed(5)
out = []
for cfg in ({}, {"BM": 16, "BN": 16, "BK": 32, "SPLIT": 3, "SWAP": 1, "num_warps": 4, "num_stages": 1},
            {"BM": 32, "BN": 16, "BK": 16, "SPLIT": 2, "SWAP": 0, "num_warps": 4, "num_stages": 1}):
    os.environ["QERL_KERNEL_CONFIG"] = json.dumps(cfg)
    for N, K, M, R, bias in ((40, 96, 20, 8, False), (33, 80, 37, 32, True)):
        p, s, gs = nvfp4.quantize(torch.randn(N, K, generator=g) * 0.05)
        x = torch.randn(M, K, generator=g).bfloat16()
        la = (torch.randn(R, K, generator=g) * 0.1).bfloat16()
        lb = (torch.randn(N, R, generator=g) * 0.1).bfloat16()
        b = (torch.randn(N, generator=g) * 0.1).bfloat16() if bias else None
        w = nvfp4.dequantize(p, s, gs, torch.float32)
        want = x.float() @ w.T + 0.5 * (x.float() @ la.float().T) @ lb.float().T + (b.float() if bias else 0)
        ops.LORA_LAUNCH = "matmul"
        two = nvfp4_matmul(x, p, s, gs, b, None, lb, 0.5, lora_a=la).float()
        ops.LORA_LAUNCH = "inkernel"
        route = ops._resolved("fwd", x, p, s, gs, N, (b, None, ops._pad_rank(lb, 1)), max(16, R), True, la)[2]
        one = nvfp4_matmul(x, p, s, gs, b, None, lb, 0.5, lora_a=la).float()
        ops.LORA_LAUNCH = "auto"
        base = nvfp4_matmul(x, p, s, gs, b).float()
        out.append((route, float((one - want).norm() / want.norm()), float((two - want).norm() / want.norm()),
                    float((base - want).norm() / want.norm())))
assert int(ops._locks(torch.device("cpu")).abs().sum()) == 0
print(json.dumps(out))
""")
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    rows = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(rows) == 6 and all(route == "inkernel" for route, *_ in rows)
    for _, one, two, base in rows:
        assert one < 6e-3 and one <= 1.25 * two and base > 0.1  # (the LoRA term is a large part of the output)


def test_training_forward_equals_the_no_grad_pass_bit_for_bit():
    """The training op (``nvfp4_lora_train``: keeps ``xa`` for its backward) and the no-grad LoRA call
    (``nvfp4_lora_linear``: the old-log-prob pass, evaluation) give the same forward bit for bit on the kernels,
    whichever route the call takes: in-kernel ``x · lora_aᵀ`` (a small eager call), ``x @ lora_a.T`` first (the
    bound at 0) and the decode sizes. ``nvfp4_matmul`` given both ``xa`` and ``lora_a`` equals the call with
    ``lora_a`` alone; an ``xa`` of another shape is refused."""
    out = _interp("""
import json, torch
from qerl.ops import nvfp4_lora_linear, nvfp4_lora_train
from qerl.quant import nvfp4
from qerl_kernels import ops
g = torch.Generator().manual_seed(5)
N, K, R = 96, 256, 16
p, s, gs = nvfp4.quantize(torch.randn(N, K, generator=g) * 0.1)
a = (torch.randn(R, K, generator=g) * 0.1).to(torch.bfloat16)
b = (torch.randn(N, R, generator=g) * 0.1).to(torch.bfloat16)
res = {}
w = nvfp4.dequantize(p, s, gs, torch.float32)
for bound, small in ((ops.LORA_INKERNEL_FLOPS, 0), (0.0, 0), (ops.LORA_INKERNEL_FLOPS, N * K)):
    ops.LORA_INKERNEL_FLOPS, ops.LORA_INKERNEL_DECODE_WEIGHTS = bound, small
    for M in (5, 40):
        x = torch.randn(M, K, generator=g).to(torch.bfloat16)
        with torch.no_grad():
            quiet = nvfp4_lora_linear(x, p, s, gs, None, a, b, 0.5)
        xr = x.clone().requires_grad_(True)
        y = nvfp4_lora_train(xr, p, s, gs, None, a, b, 0.5)
        both = ops.nvfp4_matmul(x, p, s, gs, None, x @ a.T, b, 0.5, lora_a=a)
        one = ops.nvfp4_matmul(x, p, s, gs, None, None, b, 0.5, lora_a=a)
        route = ops._resolved("fwd", x, p, s, gs, N, (None, None, b), R, True, a, False)[2]
        want = x.float() @ w.T + 0.5 * (x.float() @ a.float().T) @ b.float().T
        res[f"{bound > 0}_{small > 0}_{M}"] = [route, torch.equal(y.detach(), quiet), torch.equal(both, one),
                                               bool(y.requires_grad), float((one.float() - want).norm() / want.norm())]
try:
    ops.nvfp4_matmul(x, p, s, gs, None, (x @ a.T)[:3], b, 0.5, lora_a=a)
except ops.KernelInputError as e:
    res["error"] = str(e)
print(json.dumps(res))
""")
    assert out.returncode == 0, out.stdout + out.stderr
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert "is not x · lora_aᵀ" in res.pop("error")
    assert res["True_False_40"][0] == "inkernel" and res["False_False_40"][0] == "matmul", res
    assert res["True_True_5"][0] == "inkernel" and res["True_False_5"][0] != "inkernel", res  # (M <= 16: the knob)
    assert all(same and both and grad and err < 6e-3 for _, same, both, grad, err in res.values()), res


def test_inkernel_lora_rule_takes_only_small_eager_tile_calls(monkeypatch):
    """``lora_inkernel``: under 4.3 GFLOP by default; forced ("inkernel") on a tile only; "auto" under the bound for eager
    calls at M > 16, with the untuned tile where the config is another path; never at M <= 16 or in CUDA graphs."""
    from qerl_kernels import ops

    tile, wg = {"BM": 64, "BN": 128, "BK": 128, "SWAP": 1, "SPLIT": 1}, {"WGMMA": 1, "BT": 64}
    assert ops.LORA_INKERNEL_FLOPS == 4.3e9  # (the H100 A/B's bound, reports/host)
    assert ops.lora_inkernel(wg, 128, 4608, 3584, "auto", True, 132) is not None  # 4.23 GFLOP: 7B qkv M = 128
    assert ops.lora_inkernel(wg, 512, 896, 4864, "auto", True, 132) is None  # 4.46 GFLOP: 0.5B down M = 512
    monkeypatch.setattr(ops, "LORA_INKERNEL_FLOPS", 0.0)
    assert ops.lora_inkernel(wg, 128, 4608, 3584, "auto", True, 132) is None
    assert ops.lora_inkernel(tile, 128, 4608, 3584, "inkernel", False, 132) == tile
    assert ops.lora_inkernel(wg, 128, 4608, 3584, "inkernel", True, 132) is None
    monkeypatch.setattr(ops, "LORA_INKERNEL_FLOPS", 2e9)
    got = ops.lora_inkernel(wg, 64, 4608, 3584, "auto", True, 132)  # 2.1 GFLOP: over
    assert got is None
    got = ops.lora_inkernel(wg, 32, 4608, 3584, "auto", True, 132)
    assert got == ops.heuristic("fwd", 32, 4608, 3584, 132, dq=False, wgmma=False) and ops.path_of("fwd", got) == "tile_fwd"
    assert ops.lora_inkernel(wg, 32, 4608, 3584, "auto", False, 132) is None  # graph mode / the launch chain
    assert ops.lora_inkernel(tile, 16, 4608, 3584, "inkernel", True, 132) is None  # the decode kernels' own route
    assert ops.lora_inkernel(wg, 32, 4608, 3584, "pdl", True, 132) is None
    assert ops.LORA_INKERNEL_DECODE_WEIGHTS == 2.4e7  # the default: 7B q/k/v (1.65e7) in, 7B down (6.8e7) out
    assert ops.lora_inkernel(wg, 8, 3584, 18944, "auto", True, 132) is None
    monkeypatch.setattr(ops, "LORA_INKERNEL_DECODE_WEIGHTS", 0)  # off: M <= 16 keeps the decode kernel's route
    assert ops.lora_inkernel(wg, 8, 4608, 3584, "auto", True, 132) is None
    monkeypatch.setattr(ops, "LORA_INKERNEL_DECODE_WEIGHTS", 4608 * 3584)  # M <= 16: a BM = 16 tile, by weight size
    got = ops.lora_inkernel(wg, 8, 4608, 3584, "auto", True, 132)
    assert got == {"BM": 16, "BN": 128, "BK": 128, "SWAP": 1, "num_warps": 4, "num_stages": 4, "SPLIT": 7}  # 2·132 programs over 36 tiles
    assert ops.path_of("fwd", got) == "tile_fwd"
    assert ops.lora_inkernel(wg, 8, 4608, 3712, "auto", True, 132) is None  # (a larger weight)
    assert ops.lora_inkernel(wg, 8, 4608, 3584, "auto", False, 132) is None  # (graph mode)


def test_fused_lora_seam_backend_under_interpreter():
    """``qerl.ops.nvfp4_lora_linear`` without autograd goes to the kernels' ``forward_lora`` (base +
    LoRA in one op: the decode configs step down to the GEMV twin here, which takes ``x · Aᵀ`` from one
    matmul) and agrees with PEFT's reference computation (fp32 adapters) within bf16 rounding."""
    out = _interp("""
import json, torch
from qerl.quant import nvfp4
from qerl.ops import linear
from qerl.ops.linear import nvfp4_lora_linear, reference_lora_forward, select_backend
g = torch.Generator().manual_seed(5)
p, s, gs = nvfp4.quantize(torch.randn(40, 64, generator=g) * 0.1)
x = torch.randn(3, 64, generator=g).bfloat16()
a, b = torch.randn(32, 64, generator=g) * 0.1, torch.randn(40, 32, generator=g) * 0.1
be = select_backend(x, p)
calls = []
real = be.forward_lora
be_spy = linear.Backend(be.name, be.supports, be.forward, be.backward_input,
                        lambda *t: calls.append(1) or real(*t))
linear._BACKENDS.insert(0, be_spy)
with torch.no_grad():
    y = nvfp4_lora_linear(x, p, s, gs, None, a.bfloat16(), b.bfloat16(), 2.0)
ref = reference_lora_forward(x, p, s, gs, None, a, b, 2.0)
print(json.dumps({"backend": be.name, "calls": len(calls),
                  "rel": float((y.float() - ref.float()).norm() / ref.float().norm())}))
""")
    assert out.returncode == 0, out.stdout + out.stderr
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["backend"] == "triton-nvfp4" and res["calls"] == 1
    assert res["rel"] < 1e-2, res


def test_lora_xa_primary_row_blocks_under_interpreter():
    """The PDL primary (qerl_kernels.lora_xa, launched plainly here: PDL 0) in 16-row blocks along its
    second grid dimension: xa [16 B, R] equals x @ lora_a.T (rows >= M zero) for M up to 64 (the
    warpgroup-MMA kernel's PDL range), with K tails and several programs per block, also with the chunk loop
    pipelined (STAGES 3: five chunks per program), with the ranks in chunks (``RB``: R 128 / 64 in chunks of 32 /
    16, one program per chunk and K share), and through ``ops._pdl_primary`` (the buffers, grid and knobs both PDL
    routes launch it with, rank chunks from R = 64); every block's ticket is back at zero. fp32 operands: the interpreter's bf16 tl.dot is broken (platform.md); the kernel is
    dtype-generic and the GPU runs it in bf16 (tools/wgmma_check.py)."""
    r = _interp("""
import json, torch
from qerl_kernels.lora_xa import _lora_xa_kernel
g = torch.Generator().manual_seed(7)
res = []
for M, K, R, XP, ST, RB in ((40, 384, 32, 2, 1, 0), (64, 200, 16, 3, 1, 0), (7, 256, 16, 1, 1, 0),
                            (40, 640, 32, 2, 3, 0), (8, 384, 128, 3, 1, 32), (20, 200, 64, 2, 1, 16)):
    x = torch.randn(M, K, generator=g)
    la = torch.randn(R, K, generator=g) * 0.1
    B = -(-M // 16)
    xa = torch.full((16 * B, R), 7.0)
    xap = torch.full((B * XP * 16 * R,), float("nan"))  # every partial column is written before it is summed
    lock = torch.zeros(16, dtype=torch.int32)
    _lora_xa_kernel[(XP * (R // RB if RB else 1), B)](x, la, xa, xap, lock, lock, M, K, x.stride(0), XP, R=R, KB=64,
                                                      QB=4, PDL=0, STAGES=ST, RB=RB)
    want = x @ la.T
    err = float((xa[:M] - want).norm() / want.norm())
    res.append([M, err, bool((xa[M:] == 0).all()), int(lock.abs().sum())])
from qerl_kernels import ops  # as ops launches it (KB 128, its QB and K shares, the depth of _xa_stages)
ops.XA_PDL_AT = 0  # griddepcontrol has no interpreter twin
for M, K, R, N in ((40, 384, 32, 0), (5, 9000, 32, 0), (64, 256, 32, 0), (8, 512, 128, 0), (17, 384, 64, 0),
                   (8, 1024, 32, 64)):  # (N: before a short kernel, 4 chunks per share: 2 shares)
    x = torch.randn(M, K, generator=g)
    la = torch.randn(R, K, generator=g) * 0.1
    locks = torch.zeros(ops._LOCK_SLOTS, dtype=torch.int32)
    xa = ops._pdl_primary(x, la, M, K, R, locks, N=N)
    want = x @ la.T
    tail_ok = bool((xa[M:] == 0).all()) and xa.shape[0] == 16 * -(-M // 16)
    res.append([M, float((xa[:M] - want).norm() / want.norm()), tail_ok, int(locks.abs().sum())])
print(json.dumps(res))
""")
    assert r.returncode == 0, r.stderr[-2000:]
    for M, err, zero_tail, tickets in json.loads(r.stdout.strip().splitlines()[-1]):
        assert err < 1e-5 and zero_tail and tickets == 0, (M, err, zero_tail, tickets)


def test_launch_mode_picks_the_eager_or_graph_config(monkeypatch):
    """The committed H200 table at M = 16 (7B o): the warpgroup-MMA config under launch_mode("graph") (how
    the benchmark and the tuner time), the single-launch decode kernel (EAGER) for eager calls, the
    default; at M = 64 a tuned config with the activation pre-pass runs eagerly as the one-launch XS config; the mode
    is restored after the block, a bad mode is refused; above ``EAGER_XS_ROWS`` the entries are the same in both
    modes."""
    import qerl_kernels.ops as ops

    monkeypatch.setattr(ops, "_device_name", lambda i: "NVIDIA H200")
    monkeypatch.setattr(ops, "_sm_count", lambda i: 132)
    dev = torch.device("cuda", 0)
    assert ops._MODE[0] == "eager"
    eager = ops._for_launch_mode(ops.config_for("fwd", 16, 3584, 3584, dev))
    eager64 = ops._for_launch_mode(ops.config_for("fwd", 64, 3584, 3584, dev))
    with ops.launch_mode("graph"):
        graph = ops._for_launch_mode(ops.config_for("fwd", 16, 3584, 3584, dev))
        graph64 = ops._for_launch_mode(ops.config_for("fwd", 64, 3584, 3584, dev))
        big = ops._for_launch_mode(ops.config_for("fwd", 256, 3584, 3584, dev))
    assert eager.get("MMV") and "WGMMA" not in eager and graph.get("WGMMA") and "EAGER" not in graph
    assert graph64.get("WGMMA") and not graph64.get("XS") and "EAGER" not in graph64
    assert eager64 == ops.wgmma_heuristic(64, 3584, 3584, 132) and eager64.get("XS")
    with ops.launch_mode("graph"):  # 7B gate/up: 592 row tiles, the tuned config in both modes (staging is slower)
        gate_up = ops._for_launch_mode(ops.config_for("fwd", 64, 37888, 3584, dev))
    assert ops._for_launch_mode(ops.config_for("fwd", 64, 37888, 3584, dev)) == gate_up
    assert ops._MODE[0] == "eager" and ops._for_launch_mode(ops.config_for("fwd", 256, 3584, 3584, dev)) == big
    with pytest.raises(ValueError, match="mode must be one of"):
        with ops.launch_mode("graphs"):
            pass


def test_small_eager_calls_take_one_launch(monkeypatch):
    """An eager call of at most ``EAGER_ONE_LAUNCH_FLOPS`` whose config takes several launches (DQ; the warp-
    specialised kernel with its pre-pass) runs one launch instead: forward the plain warpgroup-MMA loop with staged
    activations (a Triton tile where K % 128 != 0), backward a Triton tile. CUDA-graph mode keeps the tables' config,
    larger calls keep it in both modes, and 0 turns the rule off."""
    import qerl_kernels.ops as ops

    monkeypatch.setattr(ops, "_device_name", lambda i: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(ops, "_sm_count", lambda i: 132)
    dev = torch.device("cuda", 0)

    def eager(kind, M, N, K):
        return ops._for_launch_mode(ops.config_for(kind, M, N, K, dev))

    def graph(kind, M, N, K):
        with ops.launch_mode("graph"):
            return ops._for_launch_mode(ops.config_for(kind, M, N, K, dev))

    # 0.5B q/k/v at M = 512 (0.95 GFLOP): DQ in graph mode both ways
    assert graph("fwd", 512, 1152, 896).get("DQ") and graph("bwd", 512, 1152, 896).get("DQ")
    # 18 row tiles x 16 token tiles = 288 programs for 132 SMs: no K split
    assert eager("fwd", 512, 1152, 896) == dict(WGMMA=1, WG=1, BT=32, NS=3, SPLIT=1, XG=0, XS=1)
    bwd = eager("bwd", 512, 1152, 896)  # 4 x 7 tiles of [128, 128] over dX: the N loop split in 9 (18 / 2)
    assert bwd == {**ops.heuristic("bwd", 512, 1152, 896, 132, dq=False), "SPLIT": 9}
    assert ops.path_of("bwd", bwd) == "tile_bwd" and eager("bwd", 128, 1152, 896)["SPLIT"] > 1
    # K % 128 != 0: the forward tile
    assert ops.path_of("fwd", eager("fwd", 512, 1152, 960)) == "tile_fwd" and graph("fwd", 512, 1152, 960).get("DQ")
    # 7B q/k/v at M = 128 (4.2 GFLOP): the H100 table's warp-specialised config (activation pre-pass + kernel)
    assert graph("fwd", 128, 4608, 3584).get("WS")
    one = eager("fwd", 128, 4608, 3584)
    assert one == dict(WGMMA=1, WG=1, BT=32, NS=3, SPLIT=1, XG=0, XS=1)  # 72 x 4 = 288 programs
    # above the bound the tables decide in both modes (eager DQ runs one window: CHUNK 0)
    assert graph("fwd", 256, 4608, 3584).get("WS") and eager("fwd", 256, 4608, 3584) == graph("fwd", 256, 4608, 3584)
    assert eager("fwd", 4096, 1152, 896) == {**graph("fwd", 4096, 1152, 896), "CHUNK": 0}
    # the earlier eager rule first (7B q/k/v M = 64, 72 row tiles: the untuned rule's staged config)
    assert eager("fwd", 64, 4608, 3584) == ops.wgmma_heuristic(64, 4608, 3584, 132) == dict(
        WGMMA=1, WG=1, BT=32, NS=2, SPLIT=2, XG=0, XS=1)
    monkeypatch.setenv("QERL_KERNEL_CONFIG", '{"CHUNK": 1048576}')  # a forced (partial) config is kept
    assert eager("fwd", 512, 1152, 896) == dict(DQ=1, CHUNK=1048576)
    monkeypatch.delenv("QERL_KERNEL_CONFIG")
    monkeypatch.setattr(ops, "EAGER_ONE_LAUNCH_FLOPS", 0)
    assert eager("fwd", 512, 1152, 896).get("DQ") and eager("fwd", 128, 4608, 3584).get("WS")


def test_benchmark_precompiles_both_launch_modes(monkeypatch):
    """precompile_jobs: a decode-size key tuned to WGMMA yields its graph config and its EAGER one."""
    import qerl_kernels.ops as ops
    from qerl.bench.kernels import precompile_jobs

    monkeypatch.setattr(ops, "_device_name", lambda i: "NVIDIA H200")
    monkeypatch.setattr(ops, "_sm_count", lambda i: 132)
    jobs = [j for j in precompile_jobs(["7B"], [16], torch.device("cuda", 0)) if j[0] == "fwd" and j[4] == 3584]
    assert any(j[2].get("WGMMA") for j in jobs) and any(j[2].get("MMV") for j in jobs)
    assert not any("EAGER" in j[2] for j in jobs)


def test_route_of_names_the_path_and_why_faster_ones_were_passed_over(monkeypatch):
    """Dispatch as small named pieces: ``route_of`` gives the path a call launches, its config and the reason
    each faster path cannot run (here, under the interpreter: no PTX, no Gluon)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from qerl_kernels import ops

    x, p, s = torch.zeros(4, 256, dtype=torch.bfloat16), torch.zeros(64, 128, dtype=torch.uint8), \
        torch.zeros(64, 16, dtype=torch.uint8)
    assert ops.why_not("tile_fwd", "fwd", 256, x, p, s, True) is None
    assert "interpreter" in ops.why_not("mmv", "fwd", 256, x, p, s, True)
    assert "multiple of 128" in ops.why_not("wgmma", "fwd", 96, x, p, s, False)
    assert "forward only" in ops.why_not("wgmma", "bwd", 256, x, p, s, False)
    assert "bf16" in ops.why_not("mmv", "fwd", 256, x.half(), p, s, False)
    monkeypatch.setenv("QERL_KERNEL_CONFIG", '{"MMV": 1, "BM": 8, "BN": 64, "BK": 128, "SPLIT": 1}')
    path, cfg, notes = ops.route_of("fwd", x, p, s)
    assert path == "gemv" and cfg["GEMV"] == 1 and notes == [
        "mmv: the register-fragment kernel is PTX (no interpreter twin)"]
    monkeypatch.delenv("QERL_KERNEL_CONFIG")
    assert ops.route_of("bwd", torch.zeros(4, 64, dtype=torch.bfloat16), p, s)[0] == "tile_bwd"
