"""The L2 prefetch launch (qerl_kernels.l2_prefetch): its split of byte ranges over programs and instructions, the
refusals, the sm_90 build, and the engine's per-layer ranges."""
import pytest
import torch


def test_plan_splits_ranges_over_programs_and_pieces_cover_each_range_once():
    from qerl_kernels import l2_prefetch as L

    ranges = [(4096, 7 * 2 ** 20), (2 ** 30, 917504), (2 ** 31, 16)]
    args, programs = L.plan(ranges)
    per = L.PIECE * L.PER
    want = [-(-n // per) for _, n in ranges] + [0]
    assert programs == sum(want)
    assert args[:8] == (4096, 7 * 2 ** 20, 2 ** 30, 917504, 2 ** 31, 16, 0, 0)
    assert args[8:] == (want[0], want[0] + want[1], sum(want[:3]))  # each range's first program
    for _, n in ranges:
        got = L.pieces(n)
        assert sum(s for _, s in got) == n and all(s % 16 == 0 and 0 < s <= L.PIECE for _, s in got)
        assert [o for o, _ in got] == list(range(0, n, L.PIECE))
    with pytest.raises(ValueError, match="16-byte aligned"):
        L.plan([(4100, 32)])
    with pytest.raises(ValueError, match="at most 4 ranges"):
        L.plan([(0, 16)] * 5)


def test_prefetch_kernel_compiles_for_sm90_to_bulk_prefetches():
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from qerl_kernels import l2_prefetch as L

    sig = {**{f"{c}{i}": "i64" for i in range(4) for c in "an"}, "f1": "i32", "f2": "i32", "f3": "i32",
           "PIECE": "constexpr", "PER": "constexpr"}
    order = ["a0", "n0", "a1", "n1", "a2", "n2", "a3", "n3", "f1", "f2", "f3", "PIECE", "PER"]
    src = ASTSource(L._prefetch_kernel, {k: sig[k] for k in order}, {(11,): L.PIECE, (12,): L.PER})
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 1})
    assert "cp.async.bulk.prefetch.L2.global" in k.asm["ptx"]
    assert not any(op in k.asm["ptx"] for op in ("st.global", "atom."))  # writes nothing


def test_engine_prefetch_ranges_name_each_layers_weights(tmp_path):
    """``L2_PREFETCH = "o,gate_up:MB"``: per layer the o projection's packed weights and scales, and the first MB of
    the fused gate/up's with the scales of the same rows; the decode step's tokens do not change (CPU: the launch
    does nothing, the call path runs)."""
    from qerl.stages.quantize import quantize_checkpoint
    from qerl.models import load_policy
    from qerl.rollout.engine.model_view import view_model
    from qerl.rollout.engine.runner import prefetch_ranges
    from qerl.models.tiny import TinySpec, save_tiny_model

    src = save_tiny_model(tmp_path / "t", TinySpec(hidden_size=128, intermediate_size=256, seed=3))
    quantize_checkpoint(src, tmp_path / "q", progress=False)
    view = view_model(load_policy(tmp_path / "q", dtype=torch.float32), fuse_siblings=True)
    mb = 16 * 1024 / 2 ** 20  # 16 KB of gate/up
    ranges = prefetch_ranges(view, f"o,gate_up:{mb}")
    assert len(ranges) == len(view.layers)
    for layer, r in zip(view.layers, ranges):
        o, gu = layer.o, layer.gate_up
        assert r == [(o.packed.data_ptr(), o.packed.numel()), (o.scale.data_ptr(), o.scale.numel()),
                     (gu.packed.data_ptr(), 16384), (gu.scale.data_ptr(), 2048)]
    with pytest.raises(ValueError, match="unknown projection 'qkv'"):
        prefetch_ranges(view, "qkv")
