"""The tile-config search's candidate lists (``qerl.bench.kernels_tune``): pure logic, no GPU."""
import json

import pytest

pytest.importorskip("triton")

from qerl.bench import kernels_tune as tune  # noqa: E402


def test_decode_search_has_only_decode_kernels_and_the_current_config():
    current = {"BM": 16, "BN": 128, "BK": 128, "SWAP": 1, "SPLIT": 1, "num_warps": 4, "num_stages": 4}
    out = tune.candidates("fwd", 16, 5120, 5120, sms=132, paths="decode", current=current)
    assert out[-1] == current and current not in out[:-1]
    decode = out[:-1]
    assert decode and all(c.get("MMV") == 1 or c.get("GEMV") == 1 for c in decode)
    mmv = [c for c in decode if c.get("MMV")]
    assert {c["RB"] for c in mmv} == {1, 2}
    assert all(c["BN"] == 16 * c["RB"] * c["num_warps"] for c in mmv)
    # XPAD (padded activation rows) is searched beside the plain twin, from M > 8 only
    pads = [c for c in mmv if c.get("XPAD")]
    assert pads and all({k: v for k, v in c.items() if k != "XPAD"} in mmv for c in pads)
    assert not any(c.get("XPAD") for c in tune.candidates("fwd", 8, 5120, 5120, sms=132, paths="decode",
                                                          current=current))


def test_decode_search_is_empty_where_no_decode_kernel_applies():
    assert tune.candidates("fwd", 64, 5120, 5120, sms=132, paths="decode", current={"DQ": 1}) == []
    assert tune.candidates("bwd", 16, 5120, 5120, sms=132, paths="decode", current={"DQ": 1}) == []
    # the current config is not duplicated when it is one of the candidates
    first = tune.candidates("fwd", 1, 3584, 3584, sms=132, paths="decode", current=None)[0]
    again = tune.candidates("fwd", 1, 3584, 3584, sms=132, paths="decode", current=first)
    assert again.count(first) == 1


def test_compile_keys_merge_candidates_that_share_a_binary():
    base = {"MMV": 1, "BM": 16, "BN": 64, "BK": 128, "num_warps": 4, "num_stages": 1, "XPRE": 0, "RB": 1}
    keys = {tune._compile_key("fwd", 16, {**base, "SPLIT": s}) for s in (2, 5, 9)}
    assert len(keys) == 1  # SPLIT > 1 values share the USE_SPLIT binary
    assert tune._compile_key("fwd", 16, {**base, "SPLIT": 1}) not in keys
    # XPAD compiles with a padded activation stride (another specialisation), so with M >= 2 rows
    kind, m, _, lora, k, tiled = tune._compile_key("fwd", 16, {**base, "SPLIT": 1, "XPAD": 1})
    assert (kind, m, lora, k, tiled) == ("fwd", 16, 0, 1024, False)
    # the LoRA launch keeps the real M and the side of K = 8192 (they decide fused or not)
    assert tune._compile_key("fwd", 12, {**base, "SPLIT": 1}, 1, 13824)[1:] == (12, json.dumps(
        {**base, "SPLIT": 1}, sort_keys=True), 1, 8448, False)
    assert tune._compile_key("fwd", 12, {**base, "SPLIT": 1}, 1, 5120)[-2] == 1024
    # tiled weights compile another binary (TILED)
    assert tune._compile_key("fwd", 12, {**base, "SPLIT": 1}, 1, 5120, True)[-1] is True
    plan = [("fwd", 16, {**base, "SPLIT": s}) for s in (2, 5)] + [("fwd", 128, {"DQ": 1, "CHUNK": 1 << 25})]
    assert tune.precompile(plan, workers=1) == 0  # one process: nothing to do ahead of the timing loop


def test_restricted_searches_time_against_the_config_in_use(monkeypatch):
    from qerl_kernels import ops

    table = {"fwd:16:64:256": {"MMV": 1, "BM": 16, "SPLIT": 3}, "fwd:2048:64:256": {"DQ": 1, "CHUNK": 1 << 25}}
    monkeypatch.setattr(ops, "_tuned", lambda name: table)
    assert tune._current("decode", "X", "fwd", 16, 64, 256, 132) == table["fwd:16:64:256"]
    untuned = ops.heuristic("fwd", 1, 64, 512, 132)  # the graph-mode config of an untuned shape (EAGER aside)
    assert tune._current("decode", "X", "fwd", 1, 64, 512, 132) == {k: v for k, v in untuned.items() if k != "EAGER"}
    # dq: a tuned DQ entry is what is searched, so the comparison is the Triton-only heuristic
    assert tune._current("dq", "X", "fwd", 2048, 64, 256, 132) == ops.heuristic("fwd", 2048, 64, 256, 132, dq=False)
    assert tune._current("all", "X", "fwd", 16, 64, 256, 132) is None


def test_wgmma_search_space():
    """The warpgroup-MMA candidates: none at K % 128 != 0; M <= 4 one BT = 8 tile, staged (XS) or not, one
    warpgroup, 2 | 3 stages; decode sizes (M 8 / 16) with BT = 8 / 16;
    M 17..64 also with half the activation rows per program; 2-4 ring stages; split-K choices within K / 256
    steps and no split with two m64 tiles above BT = 32 (registers); above M = 128 the two-warpgroup large
    tiles (BT 256 only above M = 256) and up to M = 512 the small ones too; no duplicates."""
    from qerl.bench import kernels_tune as tune

    assert tune._wgmma_paths(64, 4608, 3600, 132) == [] and tune._wgmma_paths(1, 4608, 3600, 132) == []
    for M in (1, 2, 4):
        small = tune._wgmma_paths(M, 4608, 3584, 132)
        assert {c["BT"] for c in small} == {8} and {c["NS"] for c in small} == {2, 3}
        assert all(c["WG"] == 1 and "MT" not in c and "PIPE" not in c for c in small)
        assert {c.get("XS", 0) for c in small} == {0, 1} and len({json.dumps(c, sort_keys=True) for c in small}) == len(small)
        assert all(1 <= c["SPLIT"] <= 3584 // 256 for c in small)
    for M, want_bt in ((8, {8}), (16, {16}), (32, {16, 32}), (64, {32, 64}), (128, {64, 128})):
        out = tune._wgmma_paths(M, 4608, 3584, 132)
        assert {c["BT"] for c in out} == want_bt, M
        assert {c["NS"] for c in out} == {2, 3, 4} and all(c["WGMMA"] == 1 and c["XG"] == 0 for c in out)
        assert all(1 <= c["SPLIT"] <= 3584 // 256 for c in out)
        assert not any(c.get("MT") == 2 and c["BT"] > 32 and c["SPLIT"] > 1 for c in out)
        assert len({json.dumps(c, sort_keys=True) for c in out}) == len(out)
    assert len({c["SPLIT"] for c in tune._wgmma_paths(64, 37888, 3584, 132)}) >= 2  # 1, 2, 3 where no split is "best"
    large = tune._wgmma_paths(2048, 4608, 3584, 132)
    assert large == tune._wgmma_large(2048) and {c["BT"] for c in large} == {128, 256}
    assert all(c["WG"] == 2 and c["SPLIT"] == 1 for c in large) and {c["XG"] for c in large} == {0, 1}
    mid = tune._wgmma_paths(256, 4608, 3584, 132)
    assert {c["BT"] for c in mid} == {64, 128}  # BT 256 only above M = 256
    assert any(c["WG"] == 2 and c["NS"] == 2 for c in tune._wgmma_paths(512, 4608, 3584, 132))


def test_keep_eager_carries_the_single_launch_config():
    """A warpgroup-MMA winner at M <= 16 keeps the previous decode-kernel config (or its EAGER) for eager
    calls; other winners and sizes do not carry one."""
    mmv = dict(MMV=1, BM=16, BN=64, BK=128, SPLIT=4, num_warps=4, num_stages=1)
    wgc = dict(WGMMA=1, WG=1, BT=16, NS=3, SPLIT=5, XG=0)
    assert tune.keep_eager(mmv, wgc, 16) == {**wgc, "EAGER": mmv}
    assert tune.keep_eager({**wgc, "EAGER": mmv}, {**wgc, "NS": 2}, 9) == {**wgc, "NS": 2, "EAGER": mmv}
    assert tune.keep_eager({**wgc, "EAGER": mmv}, mmv, 16) == mmv  # the decode kernel won: no EAGER needed
    assert tune.keep_eager(mmv, wgc, 32) == wgc and tune.keep_eager(None, wgc, 16) == wgc
    assert tune.keep_eager(dict(BM=16, SPLIT=1), wgc, 16) == wgc  # a tile entry is no single-launch decode config
    assert tune.keep_eager(None, wgc, 8, decode=mmv) == {**wgc, "EAGER": mmv}  # a new key: the search's best decode


def test_lora_option_reaches_the_search(monkeypatch):
    """``--lora R``: the search times the forward candidates with a rank-R adapter on the call (the rollout's
    call); the flag reaches :func:`tune_all`, and the ahead-of-time compile jobs carry the rank and K (the LoRA
    launch compiles its own kernels)."""
    seen = {}
    monkeypatch.setattr(tune, "tune_all", lambda shapes, ms, **kw: seen.update(kw, shapes=shapes, ms=ms) or "t.json")
    assert tune.main(["--models", "7B", "--projs", "o", "--ms", "8", "--kinds", "fwd", "--lora", "32",
                      "--paths", "decode"]) == 0
    assert seen["lora"] == 32 and seen["shapes"] == [(3584, 3584)] and seen["kinds"] == ("fwd",)
    assert tune.main(["--models", "7B", "--projs", "o", "--ms", "8"]) == 0 and seen["lora"] == 0
    assert not seen["tiled"] and tune.main(["--models", "7B", "--ms", "8", "--tiled"]) == 0 and seen["tiled"]
    key = tune._compile_key("fwd", 8, {"MMV": 1, "BM": 8, "SPLIT": 1}, 32, 3584)
    assert key[3] == 32 and key[1] == 8  # the LoRA launch: the real M


def test_engine_ranks_are_the_ranks_the_rollout_engine_calls_each_projection_with():
    from qerl.models.shapes import projections

    ranks = tune.engine_ranks("0.5B")
    p = projections("0.5B")
    # fused q/k/v: 3 x 32 = 96 padded to 128; fused gate/up: 64; o and down: 32
    assert ranks == {p["qkv"]: 128, p["o"]: 32, p["gate_up"]: 64, p["down"]: 32}
    assert p["qkv"] == (14 * 64 + 2 * 2 * 64, 896) and p["down"] == (896, 4864)
    assert tune._rank(ranks, *p["qkv"]) == 128 and tune._rank(32, 1, 1) == 32 and tune._rank({}, 5, 5) == 0


@pytest.mark.parametrize("model", ["0.5B", "1.5B", "3B"])
def test_the_h100_table_has_the_small_models_decode_sizes(model):
    """The small models people start with are tuned (issue 45): every fused projection at the decode buckets the
    GRPO rollouts of 8 x 8 sequences pass through, each entry a config of a path that exists."""
    from qerl.models.shapes import projections
    from qerl_kernels import ops

    table = json.loads((ops.TUNED_DIR / "NVIDIA_H100_80GB_HBM3.json").read_text())
    for N, K in projections(model).values():
        for m in (1, 8, 16, 32, 64):
            cfg = table[f"fwd:{m}:{N}:{K}"]
            assert ops.path_of("fwd", cfg) in ("wgmma", "mmv"), (model, N, K, m, cfg)


def test_tiled_search_keeps_the_candidates_that_read_the_layout():
    """``--tiled``: only candidates that run as they are on tiled weights — the plain warpgroup-MMA loop (split-K or
    stream-K) and the warp-specialised kernel stay, the pipelined loop and the decode kernels go (their tiled calls
    would run another config); nothing for shapes without whole tiles."""
    from qerl_kernels import ops

    allc = tune.candidates("fwd", 8, 37888, 3584, 132, "all", None)
    kept = tune.tiled_candidates("fwd", 8, 37888, 3584, 132, allc)
    assert kept and all(c.get("WGMMA") and not (c.get("PIPE") or c.get("MMV") or c.get("GEMV")) or "BM" in c
                        for c in kept)
    assert all(ops.tiled_config("fwd", c, 8, 37888, 3584, 132) == c for c in kept)
    assert any(c.get("MMV") for c in allc) and not any(c.get("MMV") for c in kept)
    sk = tune.candidates("fwd", 8, 37888, 3584, 132, "decode-sk", None)
    assert tune.tiled_candidates("fwd", 8, 37888, 3584, 132, sk) == sk  # stream-K (plain, staged) and WS
    assert any(c.get("SK") and not c.get("WS") for c in sk) and any(c.get("WS") for c in sk)
    piped = [c for c in allc if c.get("PIPE")]
    assert piped and not tune.tiled_candidates("fwd", 8, 37888, 3584, 132, piped)
    assert tune.tiled_candidates("fwd", 8, 37888 + 32, 3584, 132, allc) == []


def test_a_users_own_tables_are_read_over_the_packages(tmp_path, monkeypatch):
    """``$QERL_TUNED_DIR``: a search writes there (not into the installed package), and its entries are read over
    the package's table — a user's own key wins, the package's other keys stay; a broken file is an error naming it."""
    from qerl_kernels import ops

    device = "NVIDIA H100 80GB HBM3"
    package = json.loads(ops.table_path(device, ops.TUNED_DIR).read_text())
    key = "fwd:64:4608:3584"
    assert key in package
    monkeypatch.delenv(ops.USER_TABLES, raising=False)
    assert ops.table_dirs() == (ops.TUNED_DIR,) and ops.table_path(device).parent == ops.TUNED_DIR
    monkeypatch.setenv(ops.USER_TABLES, str(tmp_path))
    assert ops.table_dirs() == (ops.TUNED_DIR, tmp_path)
    assert ops.table_path(device) == tmp_path / "NVIDIA_H100_80GB_HBM3.json"  # where kernels_tune writes
    mine = {key: {"DQ": 1, "CHUNK": 0}, "fwd:64:6144:4096": {"WGMMA": 1, "WG": 1, "BT": 64, "NS": 2, "SPLIT": 1}}
    ops.table_path(device).write_text(json.dumps(mine))
    ops._tables.cache_clear()
    try:
        merged = ops._tuned(device)
        assert merged[key] == mine[key] and merged["fwd:64:6144:4096"]["BT"] == 64
        assert len(merged) == len(package) + 1 and ops.tuned_entry(device, "fwd", 64, 6144, 4096)["BT"] == 64
        ops.table_path(device).write_text("{broken")
        ops._tables.cache_clear()
        with pytest.raises(ops.KernelInputError, match="NVIDIA_H100_80GB_HBM3.json: not valid JSON"):
            ops._tuned(device)
        for corrupt, words in (([1, 2], "a list, not a mapping"), ({key: {"BT": "64"}}, f"entry '{key}'"),
                               ({"fwd:64": {"BT": 64}}, "entry 'fwd:64'"), ({key: [64]}, f"entry '{key}'")):
            ops.table_path(device).write_text(json.dumps(corrupt))  # valid JSON, not a table: named, not a crash
            ops._tables.cache_clear()
            with pytest.raises(ops.KernelInputError, match=words):
                ops._tuned(device)
    finally:
        ops._tables.cache_clear()
        ops._transfer.cache_clear()
