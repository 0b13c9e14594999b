"""The decode step's launch chain (``qerl_kernels.launch.chain``) as the launchers issue it, with Triton's launch
recorded instead of run (CPU tensors): which launches become programmatic dependents, which wait before reading and
what each kernel is told. The GPU judges are ``python -m qerl.bench.engine_check`` (the rollout with the chain on
and off bit for bit) and ``qerl bench rollout --pdl-chain on|off``."""

import pytest
import torch

pytest.importorskip("triton")

from qerl_kernels import launch, ops  # noqa: E402


def _cfg(xs: bool) -> dict:
    return {"WGMMA": 1, "BT": 8, "NS": 2 if xs else 3, "SPLIT": 2, "WG": 1, "XG": 0, **({"XS": 1} if xs else {})}


def _kw(calls, name):
    return next(kw for n, _, _, kw in calls if n == name)


def test_outside_the_chain_nothing_changes(recorded, projection_call):
    ops._launch_wgmma(projection_call(_cfg(xs=True), lora=True))
    assert [n for n, *_ in recorded] == ["_lora_xa_kernel", "_nvfp4_wgmma_kernel"]
    xa, k = _kw(recorded, "_lora_xa_kernel"), _kw(recorded, "_nvfp4_wgmma_kernel")
    assert "launch_pdl" not in xa
    assert k["PDL"] and k["launch_pdl"] and not (k["EW"] or k["TRIG"])


def test_lora_projection_ends_the_chain_at_its_primary_and_releases_its_successor(recorded, projection_call):
    with launch.chain():
        ops._launch_wgmma(projection_call(_cfg(xs=False), lora=True))
    assert [n for n, *_ in recorded] == ["_permute_kernel", "_lora_xa_kernel", "_nvfp4_wgmma_kernel"]
    p, xa, k = (_kw(recorded, n) for n in ("_permute_kernel", "_lora_xa_kernel", "_nvfp4_wgmma_kernel"))
    assert p["WAIT"] and p["launch_pdl"]  # the pre-pass: chained
    assert "launch_pdl" not in xa  # the primary: an ordinary launch (the kernel overlaps it, as outside the chain)
    assert k["PDL"] and k["launch_pdl"] and not k["EW"] and k["TRIG"]


def test_projection_without_lora_chains_its_pre_pass_and_streams_weights_before_its_wait(recorded, projection_call):
    with launch.chain():
        ops._launch_wgmma(projection_call(_cfg(xs=False), lora=False))
    assert [n for n, *_ in recorded] == ["_permute_kernel", "_nvfp4_wgmma_kernel"]
    p, k = _kw(recorded, "_permute_kernel"), _kw(recorded, "_nvfp4_wgmma_kernel")
    assert p["WAIT"] and p["PDL"] and p["launch_pdl"]
    assert k["EW"] and k["TRIG"] and k["launch_pdl"] and not k["PDL"]


def test_chain_nests_and_restores():
    assert not launch.chained()
    with launch.chain():
        assert launch.chained()
        with launch.chain(False):
            assert not launch.chained()
        assert launch.chained()
    assert not launch.chained()


def test_norm_launches_join_the_chain_on_cuda_only(monkeypatch):
    from qerl_kernels import norm

    calls = []
    monkeypatch.setattr(launch, "run", lambda kernel, grid, args, kw: calls.append(kw))
    x, w = torch.zeros(2, 8), torch.ones(8)
    with launch.chain():
        norm.rms_norm(x, w, 1e-6)
        norm.silu_mul(x, x)
    assert [kw["PDL"] for kw in calls] == [False, False] and all("launch_pdl" not in kw for kw in calls)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))
    calls.clear()
    with launch.chain():
        norm.rms_norm(x, w, 1e-6, d=x)
        norm.silu_mul(x, x)
    assert [kw["PDL"] for kw in calls] == [True, True] and all(kw["launch_pdl"] for kw in calls)


def test_warp_specialised_projection_chains_its_pre_pass_and_releases_its_successor(recorded, projection_call):
    """A `WS` config (M = 64): the pre-pass chained (it waits for the grid before it) and still the kernel's PDL
    primary (`XWAIT`), the kernel released early; no early weights (`EW` is the plain kernel's)."""
    cfg = {"WGMMA": 1, "WS": 1, "C": 2, "MT": 1, "BT": 64, "NS": 4, "SPLIT": 2}
    c = projection_call(cfg, lora=False, M=64, N=256, K=512)
    with launch.chain():
        ops._launch_wgmma(c)
    assert [n for n, *_ in recorded] == ["_permute_kernel", "_nvfp4_ws_kernel"]
    p, k = _kw(recorded, "_permute_kernel"), _kw(recorded, "_nvfp4_ws_kernel")
    assert p["WAIT"] and p["PDL"] and p["launch_pdl"]
    assert k["XWAIT"] and k["TRIG"] and k["launch_pdl"]
    recorded.clear()
    ops._launch_wgmma(c)  # outside the chain: as before
    p, k = _kw(recorded, "_permute_kernel"), _kw(recorded, "_nvfp4_ws_kernel")
    assert not p["WAIT"] and p["PDL"] and "launch_pdl" not in p and k["XWAIT"] and not k["TRIG"]
