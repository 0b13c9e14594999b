"""Optimizer states parked in host memory during the rollout (`optim.offload`, qerl.train.offload): the bytes come
back exactly and the planner parks them where that is what makes a run fit (a run with them parked computing what
one without does: tests/train/test_dist.py)."""
import pytest
import torch

from qerl.train import offload
from qerl.train.config import ConfigError, TrainConfig, from_dict, validate
from qerl.train.plan import plan_config



def test_park_frees_the_storages_and_restore_brings_every_byte_back(monkeypatch):
    monkeypatch.setattr(offload, "PARK_ON_CPU", True)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    net(torch.randn(3, 8)).square().sum().backward()
    opt.step()
    shared = torch.randn(5)  # one storage in two states (as bitsandbytes' quantile maps are): parked once
    for st in list(opt.state.values())[:2]:
        st["qmap"] = shared
    before = {id(t): t.clone() for st in opt.state.values() for t in st.values()}
    parking = offload.StateOffload(opt)
    n = parking.park()
    # exp_avg + exp_avg_sq of 4 tensors (8 x 16 + 16 + 16 x 4 + 4 = 212 fp32 values each), 4 step counters, qmap
    assert n == 2 * 212 * 4 + 4 * 4 + 5 * 4
    assert all(t.untyped_storage().nbytes() == 0 for st in opt.state.values() for t in st.values())
    assert parking.park() == 0  # idempotent
    parking.restore()
    assert all(torch.equal(t, before[id(t)]) for st in opt.state.values() for t in st.values())
    assert opt.state[net[0].weight]["qmap"] is opt.state[net[0].bias]["qmap"]
    net(torch.randn(3, 8)).square().sum().backward()
    opt.step()  # the optimizer runs on the restored tensors
    parking.park(), parking.restore()  # the host buffers are reused
    # one arena, 64-byte aligned views: 4 x (step, exp_avg, exp_avg_sq) + qmap
    assert parking.arena.numel() == 4 * 64 + 2 * (8 * 16 * 4 + 64 + 16 * 4 * 4 + 64) + 64


def _cfg(**over) -> TrainConfig:
    base = {"method": "full", "sharding": "fsdp", "prompts_per_step": 16, "micro_batch_size": 64,
            "model": {"path": "unused"}, "rollout": {"max_new_tokens": 1024}, "algorithm": {"group_size": 8}}
    for k, v in over.items():
        node = base
        *parents, leaf = k.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = v
    return from_dict(TrainConfig, base)


def test_the_planner_parks_the_states_where_that_makes_the_run_fit():
    """32B full over 8 GPUs (FSDP2), 16 sequences x 1,280 tokens per GPU: 111 GB with the states on the GPU during
    the rollout (they are 38 GB of it), 72 GB parked; `auto` parks them, `none` does not fit."""
    gb = 80e9
    auto = plan_config(_cfg(), shape="32B", available=gb, world=8)
    assert auto["offload"] and auto["fits"] and auto["estimate"]["peak_phase"] == "rollout"
    none = plan_config(_cfg(**{"optim.offload": "none"}), shape="32B", available=gb, world=8)
    assert not none["offload"] and not none["fits"]
    host = auto["estimate"]["host_bytes"]
    assert none["estimate"]["peak_bytes"] > 100e9 and 70e9 < auto["estimate"]["peak_bytes"] < 75e9
    assert host == pytest.approx(38.2e9, rel=1e-3) and "in host memory during the rollout" in auto["markdown"]
    assert auto["estimate"]["waves"] == 1
    assert "optim.offload: rollout" in " ".join(none["advice"])
    # a run far below the GPU keeps its states (auto parks only above 90% of it)
    small = plan_config(_cfg(**{"method": "qerl", "sharding": "auto"}), shape="7B", available=gb, world=1)
    assert not small["offload"] and small["estimate"]["host_bytes"] == 0


def test_bad_offload_value_is_refused():
    with pytest.raises(ConfigError, match=r"config.optim.offload: one of \('auto', 'none', 'rollout'\), got 'always'"):
        validate(_cfg(**{"optim.offload": "always"}))


def test_the_planner_runs_the_rollout_in_waves_where_every_cache_does_not_fit():
    """The paper's 32B full BigMath run on 8 x 80 GB (config/resources/gpus8.yaml): 16 sequences x 8,448 tokens
    per GPU need 35 GB of KV cache beside 56 GB of gathered weights; the engine sizes its cache from the memory
    left, so the plan counts the 5 sequences that fit at once (4 waves; the one prompt of each process prefilled once)
    and the states parked; on 141 GB one wave."""
    over = {"micro_batch_size": 1, "prompts_per_step": 8, "algorithm.group_size": 16,
            "rollout.max_new_tokens": 8192}
    small = plan_config(_cfg(**over), shape="32B", available=80e9, world=8)
    e = small["estimate"]
    assert small["fits"] and small["offload"] and e["waves"] == 4 and e["wave_rows"] == 5
    assert "kv cache (5 of 16 sequences at once)" in e["rollout"] and "rollout 5 sequences at once" in small["markdown"]
    assert e["peak_bytes"] <= 80e9 - 2 * 1024 ** 3  # the engine's reserve stays free
    big = plan_config(_cfg(**over), shape="32B", available=141e9, world=8)
    assert big["fits"] and big["estimate"]["waves"] == 1 and "kv cache" in big["estimate"]["rollout"]
    # not even one sequence's cache beside the gathered weights and the kept states: no fit
    none = plan_config(_cfg(**over, **{"optim.offload": "none"}), shape="32B", available=80e9, world=8)
    assert not none["fits"] and none["estimate"]["peak_bytes"] > 80e9


def test_train_says_when_its_rollout_will_run_in_waves(tmp_path, monkeypatch, capsys):
    import json

    from qerl.train import plan, runplan

    s = plan.QWEN25["32B"]
    (tmp_path / "config.json").write_text(json.dumps({
        "hidden_size": s.hidden, "intermediate_size": s.intermediate, "num_hidden_layers": s.layers,
        "num_attention_heads": s.heads, "num_key_value_heads": s.kv_heads, "vocab_size": s.vocab}))
    cfg = _cfg(**{"model.path": str(tmp_path), "micro_batch_size": 1, "prompts_per_step": 8,
                  "algorithm.group_size": 16, "rollout.max_new_tokens": 8192})
    monkeypatch.setattr(plan, "device_bytes", lambda: 80e9)
    memory, notes = runplan._memory(cfg, 8, tmp_path / "config.json")
    assert "the rollout decodes at most 5 sequences at once" in notes[0]
    assert runplan._offload(cfg.optim.offload, "cuda", memory)  # auto parks the states here
    assert not runplan._offload("none", "cuda", memory) and runplan._offload("rollout", "cuda", None)
