"""The host side of an eager NVFP4 call (``qerl_kernels.ops``): what it computes once per scope instead of per call,
the shared scratch of eager calls, the environment reads. Launches are recorded, not run (CPU tensors); the results
of the kernels are checked under the interpreter by ``test_nvfp4_kernels.py`` and on the GPU by ``qerl bench host``
(bit-equal to Triton's own launches) and ``python -m qerl.bench.kernels_check``."""

import pytest
import torch

pytest.importorskip("triton")

from qerl_kernels import launch, ops  # noqa: E402


def _same_launches(a, b):
    """Two recordings launch the same kernels with the same grids, keywords and non-tensor arguments."""
    assert [(n, g, kw) for n, g, _, kw in a] == [(n, g, kw) for n, g, _, kw in b]
    for (_, _, x, _), (_, _, y, _) in zip(a, b):
        assert [v for v in x if not isinstance(v, torch.Tensor)] == [v for v in y if not isinstance(v, torch.Tensor)]


WGMMA = [{"WGMMA": 1, "BT": 8, "NS": 2, "SPLIT": 2, "WG": 1, "XG": 0, "XS": 1},
         {"WGMMA": 1, "BT": 64, "NS": 3, "SPLIT": 1, "WG": 2, "XG": 0, "MT": 2},
         {"WGMMA": 1, "BT": 16, "NS": 3, "SPLIT": 4, "WG": 1, "XG": 1},
         {"WGMMA": 1, "BT": 8, "NS": 2, "SK": 1, "WG": 1, "XG": 0, "XS": 1}]  # stream-K


@pytest.mark.parametrize("cfg", WGMMA)
@pytest.mark.parametrize("lora,bias,chained", [(False, False, False), (True, False, False), (False, True, True),
                                               (True, True, True)])
def test_warpgroup_launch_in_a_scope_equals_the_one_without(recorded, projection_call, monkeypatch, cfg, lora, bias,
                                                            chained):
    """Inside a call's scope :func:`nvfp4_wgmma_matmul` takes its grid and keywords from the scope's memo; they are
    those it computes outside a scope, on the first call of the scope and on the next."""
    from qerl_kernels import nvfp4_wgmma

    monkeypatch.setattr(nvfp4_wgmma, "_sms", lambda device: 132)  # (stream-K sizes its grid by the SMs)
    with launch.chain(chained):
        ops._launch_wgmma(projection_call(cfg, lora, bias=bias))
        outside = recorded[:]
        for _ in range(2):
            recorded.clear()
            prev = launch.scope(("test_host_path", str(cfg), lora, bias, chained))
            try:
                ops._launch_wgmma(projection_call(cfg, lora, bias=bias))
            finally:
                launch.restore(prev)
            _same_launches(recorded, outside)
    launch.clear()


def test_warpgroup_argument_checks_hold_in_a_scope():
    from qerl_kernels import nvfp4_wgmma as wg

    x, p, sc, gs = torch.zeros(4, 128, dtype=torch.bfloat16), torch.zeros(64, 64, dtype=torch.uint8), \
        torch.zeros(64, 8, dtype=torch.uint8), torch.ones(1)
    prev = launch.scope(("test_host_path", "checks"))
    try:
        with pytest.raises(ValueError, match="XS .* excludes XG and PIPE"):
            wg.nvfp4_wgmma_matmul(x, p, sc, gs, XS=1, XG=1)
    finally:
        launch.restore(prev)
        launch.clear()


@pytest.mark.parametrize("xpad", [0, 1])
def test_mmv_sizes_come_from_the_scope_and_match_the_tensors(recorded, projection_call, xpad):
    """The register-fragment launch passes (M, N, K, row strides) from the scope's memo: those of the tensors it
    launches with, the padded copy's stride where the activations are copied to a padded row stride."""
    cfg = {"MMV": 1, "BM": 8, "BN": 64, "BK": 128, "SPLIT": 2, "num_stages": 1, "XPAD": xpad}
    c = projection_call(cfg, lora=False, M=4, tiled=False)
    prev = launch.scope(("test_host_path", "mmv", xpad))
    try:
        out = ops._launch_mmv(c)
        out2 = ops._launch_mmv(c)
    finally:
        launch.restore(prev)
        launch.clear()
    for (_, _, args, _), o in zip(recorded, (out, out2)):
        x = args[0]
        M, N, K, sx, so, sp, ss = args[13:20]
        assert (M, N, K) == (4, 128, 256) and so == o.stride(0) == 128
        assert sx == x.stride(0) == (256 + 8 if xpad else 256)
        assert (sp, ss) == (args[1].stride(0), args[2].stride(0)) == (128, 16)


def test_eager_partials_share_a_workspace_that_grows_and_keeps_what_it_outgrew():
    dev = torch.device("cpu")
    ops._PARTS.clear()
    a = ops._partials(dev, 1000)
    assert a.numel() >= 1000 and a.dtype == torch.float32
    assert ops._partials(dev, 10) is a  # reused: no allocation per call
    assert ops._partials(dev, 5, "xap") is not a  # another role: another buffer (both used by one launch)
    big = ops._partials(dev, a.numel() + 1)
    assert big is not a and big.numel() > a.numel() and ops._PARTS[("part", dev)][1] is a  # the old one kept
    assert ops._partials(dev, ops.PART_MAX + 1).numel() == ops.PART_MAX + 1  # above the cap: its own
    assert ops._partials(dev, ops.PART_MAX + 1) is not ops._partials(dev, ops.PART_MAX + 1)
    with ops.launch_mode("graph"):  # a capture: a fresh tensor, never the workspace
        assert all(ops._partials(dev, 10) is not t for t in ops._PARTS[("part", dev)])
    ops._PARTS.clear()


def test_environment_reads_follow_os_environ(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert ops._interpreting()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not ops._interpreting()
    monkeypatch.delenv("TRITON_INTERPRET")
    assert not ops._interpreting()
    monkeypatch.setenv("QERL_KERNEL_CONFIG", '{"SPLIT": 2}')
    assert ops._env(b"QERL_KERNEL_CONFIG") in (b'{"SPLIT": 2}', '{"SPLIT": 2}')
    monkeypatch.delenv("QERL_KERNEL_CONFIG")
    assert ops._env(b"QERL_KERNEL_CONFIG") is None


def test_a_resolved_call_keeps_its_scope_and_another_call_gets_another(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    x8, x16 = torch.randn(8, 256, dtype=torch.bfloat16), torch.randn(16, 256, dtype=torch.bfloat16)
    p, s, g = torch.zeros(128, 128, dtype=torch.uint8), torch.zeros(128, 16, dtype=torch.uint8), torch.ones(1)
    a = ops._resolved("fwd", x8, p, s, g, 128, (None, None, None), 0, True, None)
    assert ops._resolved("fwd", x8.clone(), p, s, g, 128, (None, None, None), 0, True, None)[0] == a[0]
    assert ops._resolved("fwd", x16, p, s, g, 128, (None, None, None), 0, True, None)[0] != a[0]
    monkeypatch.setenv("QERL_KERNEL_CONFIG", '{"SPLIT": 2}')  # a forced config is part of the key
    assert ops._resolved("fwd", x8, p, s, g, 128, (None, None, None), 0, True, None)[0] != a[0]


def test_whole_window_dequantize_repeats_from_the_scope_memo_under_interpreter():
    """The dequantize + cuBLAS route with one window (eager calls): its dequantize launch takes checks, grid and
    strides from the scope's memo from the second call on. Each call, forward and backward, row-major and tiled
    weights, equals the torch reference; the tickets stay at zero."""
    import json
    import os
    import subprocess
    import sys

    code = """
import json, os, torch
os.environ['QERL_KERNEL_CONFIG'] = json.dumps({"DQ": 1, "CHUNK": 0})
from qerl.quant import nvfp4
from qerl.ops.linear import reference_forward, reference_backward_input
from qerl_kernels import layout, launch
from qerl_kernels.ops import nvfp4_matmul, nvfp4_matmul_t
g = torch.Generator().manual_seed(3)
N, K = 128, 256
p, s, gs = nvfp4.quantize(torch.randn(N, K, generator=g) * 0.1)
pt, st = layout.tile(p, s)
errs, memo = [], []
for i in range(3):
    x = torch.randn(5, K, generator=g).bfloat16()
    dy = torch.randn(5, N, generator=g).bfloat16()
    yr, dr = reference_forward(x, p, s, gs, None).float(), reference_backward_input(dy, p, s, gs).float()
    for y in (nvfp4_matmul(x, p, s, gs), nvfp4_matmul(x, pt, st, gs, tiled=True)):
        errs.append(float((y.float() - yr).abs().max()))
    for d in (nvfp4_matmul_t(dy, p, s, gs), nvfp4_matmul_t(dy, pt, st, gs, tiled=True)):
        errs.append(float((d.float() - dr).abs().max()))
    memo.append(sum(k[1].__module__.endswith("nvfp4_dequant") for k in launch._MEMO))
print(json.dumps([errs, memo]))
"""
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "TRITON_INTERPRET": "1"},
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    errs, memo = json.loads(out.stdout.strip().splitlines()[-1])
    assert max(errs) < 2e-2
    assert memo == [4, 4, 4]  # one memo per scope (fwd / bwd x row-major / tiled), made on the first call
