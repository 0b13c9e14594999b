"""The tile-config search's candidate lists (``qerl_kernels.tune``): pure logic, no GPU."""
import json

import pytest

pytest.importorskip("triton")

from qerl_kernels import tune  # noqa: E402


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
    kind, m, _, lora, k = tune._compile_key("fwd", 16, {**base, "SPLIT": 1, "XPAD": 1})
    assert (kind, m, lora, k) == ("fwd", 16, 0, 1024)
    # the LoRA launch keeps the real M and the side of K = 8192 (they decide fused or not)
    assert tune._compile_key("fwd", 12, {**base, "SPLIT": 1}, 1, 13824)[1:] == (12, json.dumps(
        {**base, "SPLIT": 1}, sort_keys=True), 1, 8448)
    assert tune._compile_key("fwd", 12, {**base, "SPLIT": 1}, 1, 5120)[-1] == 1024
    plan = [("fwd", 16, {**base, "SPLIT": s}) for s in (2, 5)] + [("fwd", 128, {"DQ": 1, "CHUNK": 1 << 25})]
    assert tune.precompile(plan, workers=1) == 0  # one process: nothing to do ahead of the timing loop


def test_restricted_searches_time_against_the_config_in_use(monkeypatch):
    from qerl_kernels import ops

    table = {"fwd:16:64:256": {"MMV": 1, "BM": 16, "SPLIT": 3}, "fwd:2048:64:256": {"DQ": 1, "CHUNK": 1 << 25}}
    monkeypatch.setattr(ops, "_tuned", lambda name: table)
    assert tune._current("decode", "X", "fwd", 16, 64, 256, 132) == table["fwd:16:64:256"]
    assert tune._current("decode", "X", "fwd", 1, 64, 512, 132) == ops.heuristic("fwd", 1, 64, 512, 132)
    # dq: a tuned DQ entry is what is searched, so the comparison is the Triton-only heuristic
    assert tune._current("dq", "X", "fwd", 2048, 64, 256, 132) == ops.heuristic("fwd", 2048, 64, 256, 132, dq=False)
    assert tune._current("all", "X", "fwd", 16, 64, 256, 132) is None
