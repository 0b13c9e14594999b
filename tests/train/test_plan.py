"""The memory planner (qerl.train.plan, `qerl plan`) and a GRPO step of `qerl bench step` on CPU."""
import json
from pathlib import Path

import pytest
import torch

from qerl.cli import main as cli
from qerl.train import plan
from qerl.train.config import ConfigError, load_config

S = plan.Shape(hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, head_dim=16, vocab=100)


def test_parts_by_hand():
    # per layer: q 64·64, k 64·32, v 64·32, o 64·64, gate/up 64·128 each, down 128·64 -> 36864 weights
    w = plan.weight_bytes(S, "nvfp4")
    assert w["linears"] == 2 * 36864 * 0.5625 and w["embeddings+lm_head"] == 2 * 100 * 64 * 2
    assert plan.weight_bytes(S, "bf16")["linears"] == 2 * 36864 * 2
    # LoRA r=4: sum(K + N) = 128 + 96 + 96 + 128 + 192 + 192 + 192 = 1024 per layer
    lo = plan.lora_bytes(S, 4, eight_bit=False)
    n = 2 * 4 * 1024
    assert lo == {"lora master+grad": 8 * n, "optimizer states": 8 * n, "lora bf16 copies": 2 * n}
    assert plan.lora_bytes(S, 4, eight_bit=True)["optimizer states"] == 2 * n
    assert plan.kv_bytes(S, rows=3, positions=10) == 2 * 2 * 2 * 16 * 2 * 3 * 10


def test_checkpointing_and_release_lower_the_update_peak():
    kw = dict(rows=8, prompt_len=256, gen_len=2048, micro=2)
    s7 = plan.QWEN25["7B"]
    on, off = plan.estimate(s7, "nvfp4", **kw, checkpointing=True), plan.estimate(s7, "nvfp4", **kw, checkpointing=False)
    assert on["phases"]["update"] < off["phases"]["update"] / 5
    kept = plan.estimate(s7, "nvfp4", **kw, release_cache=False)
    assert kept["phases"]["update"] - on["phases"]["update"] == pytest.approx(plan.kv_bytes(s7, 8, 2304))
    assert plan.estimate(s7, "bf16", **kw)["peak_bytes"] > on["peak_bytes"] + 9e9  # bf16 weights: +~9 GB
    # auto: on when the update would not fit without it (14B: a small step fits; 2 x 2,304 tokens per micro-batch
    # do not fit in 40 GB), off otherwise
    cfg14 = {"hidden_size": 5120, "intermediate_size": 13824, "num_hidden_layers": 48, "num_attention_heads": 40,
             "num_key_value_heads": 8, "vocab_size": 152064}
    assert not plan.resolve_checkpointing("auto", cfg14, "nvfp4", 2, 512, 1, budget_bytes=80e9)
    assert plan.resolve_checkpointing("auto", cfg14, "nvfp4", 8, 2304, 2, budget_bytes=40e9)
    cfg7 = {"hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
            "num_key_value_heads": 4, "vocab_size": 152064}
    assert plan.resolve_checkpointing("auto", cfg7, "nvfp4", 8, 2304, 8, budget_bytes=80e9)
    assert not plan.resolve_checkpointing("auto", cfg7, "nvfp4", 2, 300, 1, budget_bytes=80e9)
    assert plan.resolve_checkpointing("off", cfg7, "nvfp4", 8, 2304, 8) is False


def test_qerl_plan_cli_and_refusal(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("method: qerl\nmodel: {path: none}\nprompts_per_step: 8\nmicro_batch_size: 4\n"
                   "rollout: {max_new_tokens: 2048}\n")
    assert cli(["plan", "--config", str(cfg), "--shape", "7B", "--gpu-gb", "80"]) == 0
    out = capsys.readouterr().out
    assert "| **peak (" in out and "fits in 80.0 GB" in out
    assert cli(["plan", "--config", str(cfg), "--shape", "32B", "--gpu-gb", "10", "--json"]) == 3
    res = json.loads(capsys.readouterr().out)
    assert not res["fits"] and res["advice"] and res["estimate"]["peak_gb"] > 10
    c = load_config(cfg, {"model.path": str(tmp_path)})
    with pytest.raises(ConfigError, match="no config.json to plan from"):
        plan.plan_config(c)
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 5120, "intermediate_size": 27648,
                                                      "num_hidden_layers": 64, "num_attention_heads": 40,
                                                      "num_key_value_heads": 8, "vocab_size": 152064}))
    with pytest.raises(ConfigError, match=r"needs ~\d+\.\d GB at its .* phase .* the GPU has 20\.0 GB\. To fit:"):
        plan.check_fits(c, tmp_path / "config.json", available=20e9)


def test_bench_step_one_grpo_step_on_cpu(tiny_dirs, monkeypatch):
    """`qerl bench step`'s step on a tiny NVFP4 policy on CPU: rollout, then the trainer's own update phase
    (`qerl.train.update.update_policy`, called once with GRPO groups and the micro-batch asked for — not a copy);
    the LoRA weights move and every phase is timed; the report files carry the paper's column."""
    from transformers import AutoTokenizer

    from qerl.lora import LoraSettings, apply_lora
    from qerl.models import load_policy
    from qerl.rl.aqn import AQN, AQNSettings
    from qerl.bench import step as bench_step
    from qerl.models.random import CountTokenizer
    from qerl.train import update

    calls, real = [], update.update_policy

    def spy(policy, scorer, batch, rewards, cfg, *a, **k):
        calls.append((len(batch.texts), cfg.algorithm.group_size, cfg.micro_batch_size, cfg.rollout.max_new_tokens))
        return real(policy, scorer, batch, rewards, cfg, *a, **k)

    monkeypatch.setattr(update, "update_policy", spy)
    policy = apply_lora(load_policy(tiny_dirs["qwen2"], base="nvfp4", dtype=torch.float32), LoraSettings(r=4))
    params = [p for p in policy.parameters() if p.requires_grad]
    before = [p.detach().clone() for p in params]
    opt = torch.optim.AdamW(params, lr=1e-2)
    st = bench_step.one_step(policy, CountTokenizer(), AQN(policy, AQNSettings()), batch=4, prompt_len=5, gen_len=4,
                             micro=2, optimizer=opt, seed=1)
    assert calls == [(4, 4, 2, 4)]
    assert st["tokens"] == 16 and all(st[k] > 0 for k in ("rollout_s", "logprob_s", "update_s"))
    assert st["rollout_s"] + st["logprob_s"] + st["update_s"] <= st["total_s"] + 1e-6
    assert any(not torch.equal(a, p) for a, p in zip(before, params))
    with pytest.raises(ValueError, match="batch 7: must be a multiple of 2"):
        bench_step._bench_config(7, 1, 4, 2)
    assert AutoTokenizer  # (the tokenizer used is CountTokenizer: random-token prompts, EOS never sampled)
    # `--offload`: the same step with the AdamW states parked during the rollout moves the weights identically
    import copy

    from qerl.train import offload

    snap = [p.detach().clone() for p in params], copy.deepcopy(opt.state_dict())
    kept = bench_step.one_step(policy, CountTokenizer(), None, batch=4, prompt_len=5, gen_len=4, micro=2,
                               optimizer=opt, seed=2)
    after_kept = [p.detach().clone() for p in params]
    with torch.no_grad():
        for p, v in zip(params, snap[0]):
            p.copy_(v)
    opt.load_state_dict(snap[1])
    offload.PARK_ON_CPU = True  # (CPU tensors: parked only under the tests' switch)
    try:
        parked = bench_step.one_step(policy, CountTokenizer(), None, batch=4, prompt_len=5, gen_len=4, micro=2,
                                     optimizer=opt, seed=2, parking=offload.StateOffload(opt))
    finally:
        offload.PARK_ON_CPU = False
    assert "parked_gb" not in kept and parked["parked_gb"] > 0 and parked["offload_s"] > 0
    assert all(torch.equal(a, p) for a, p in zip(after_kept, params))
    # `--lengths`: the rollout's rows stop at the drawn lengths (global rows, seeded by the step's seed)
    from qerl.bench.lengths import parse

    spec = parse("uniform:low=1,high=4")
    drawn = spec.draw(4, 4, seed=3)
    assert len(set(drawn)) > 1
    st = bench_step.one_step(policy, CountTokenizer(), None, batch=4, prompt_len=5, gen_len=4, micro=2,
                             optimizer=opt, seed=3, lengths=spec)
    assert st["tokens"] == sum(drawn)


def test_bench_step_report_files(tmp_path):
    from qerl.bench import step as bench_step

    rows = [dict(device="GPU X", model="32B", method="qerl", batch=8, prompt_len=256, gen_len=2048, status="ok",
                 rollout_s=30.0, logprob_s=2.0, update_s=5.0, total_s=37.0, tokens_per_s=442.8, peak_gb=40.1,
                 checkpointing=True, micro_batch=2, optimizer="adamw", note=""),
            dict(device="GPU X", model="32B", method="lora", batch=8, prompt_len=256, gen_len=2048, status="oom",
                 note="CUDA out of memory")]
    csv_path, md = bench_step.write(rows, tmp_path, "GPU X")
    text = md.read_text()
    assert "| 32B | qerl | 8 | 256 | 2048 | fixed | 1 | ok | 30.00 |" in text and "12.2 s/step (b8)" in text
    assert "| 32B | lora | 8 | 256 | 2048 | fixed | 1 | oom |" in text
    assert csv_path.read_text().splitlines()[0].split(",") == bench_step.COLUMNS


def test_estimates_within_15_percent_of_the_measured_peaks():
    """The planner against every measured `qerl bench step` peak committed under reports/step."""
    import csv
    from pathlib import Path

    from qerl.bench.step import BASE
    from qerl.models.shapes import named

    files = sorted((Path(__file__).parents[2] / "reports" / "step").glob("*.csv"))
    assert files, "reports/step has no benchmark CSV"
    n = n_parked = 0
    for f in files:
        for r in csv.DictReader(open(f)):
            if r["status"] != "ok":
                continue
            est = plan.estimate(named(r["model"]), BASE[r["method"]], int(r["batch"]), int(r["prompt_len"]),
                                int(r["gen_len"]), int(r["micro_batch"]), 32, r["checkpointing"] == "True",
                                eight_bit="8bit" in r["optimizer"], release_cache=r.get("engine_cache") != "kept",
                                full=r["method"] == "full", offload=r.get("optimizer_states") == "parked",
                                dense=r.get("dense_update") == "True",
                                prompts=int(r["batch"]) // int(r.get("samples_per_prompt") or 1),
                                fused=r.get("fused_update") == "True",
                                update_tokens=int(r["micro_tokens"]) if r.get("micro_tokens") else None)
            measured = float(r["peak_gb"])
            if r.get("packed_update") in ("True", "auto"):  # packed micro-batches hold only their real tokens: the
                # planner (padded micro-batches; lengths are unknown before the rollout) is then an upper bound
                assert est["peak_gb"] >= 0.85 * measured, (f.name, r["model"], r["method"], est["peak_gb"], measured)
                continue
            assert abs(est["peak_gb"] / measured - 1) <= 0.15, (f.name, r["model"], r["method"], r["batch"],
                                                                r["gen_len"], est["peak_gb"], measured)
            n += 1
            if r.get("optimizer_states") == "parked":  # the rollout phase without the states (the note has its peak)
                roll = float(r["note"].split("rollout-phase peak ")[1].split(" GB")[0])
                planned = (sum(est["static"].values()) + est["phases"]["rollout"]) / 1e9
                assert abs(planned / roll - 1) <= 0.15, (f.name, r["model"], r["batch"], planned, roll)
                n_parked += 1
    assert n >= 10 and n_parked >= 1


def test_plan_per_process_under_data_parallelism():
    """`--nproc N`: each process holds 1/N of a step's sequences (its rollout KV cache and activations)."""
    from qerl.train.config import load_config

    cfg = load_config(Path(__file__).parents[2] / "config/train/tiny.yaml",
                      {"prompts_per_step": 16, "rollout.max_new_tokens": 2048, "gradient_checkpointing": True,
                       "micro_batch_size": 2})
    one, two = (plan.plan_config(cfg, shape="32B", available=80e9, world=w) for w in (1, 2))
    assert two["estimate"]["peak_gb"] < one["estimate"]["peak_gb"]
    assert "64 sequences per process (2 processes)" in two["markdown"]


def test_release_cache_auto_keeps_the_engine_cache_when_it_fits(tmp_path, monkeypatch):
    """rollout.release_cache: auto keeps the cache (no graph recapture per step) when the planned peak with it
    stays under 85% of the GPU, else releases; true / false as given; a bad value names the field."""
    (tmp_path / "config.json").write_text(json.dumps({
        "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
        "num_key_value_heads": 4, "vocab_size": 152064}))
    over = {"model.path": str(tmp_path), "prompts_per_step": 2, "rollout.max_new_tokens": 1024}
    cfg = load_config(Path(__file__).parents[2] / "config/train/tiny.yaml", over)
    assert cfg.rollout.release_cache == "auto"
    monkeypatch.setattr(plan, "device_bytes", lambda: 80e9)
    assert plan.keep_engine_cache(cfg) is True
    assert "engine cache kept between steps" in plan.plan_config(cfg)["markdown"]
    monkeypatch.setattr(plan, "device_bytes", lambda: 8e9)
    assert plan.keep_engine_cache(cfg) is False
    for value, keep in ((True, False), (False, True)):
        assert plan.keep_engine_cache(load_config(Path(__file__).parents[2] / "config/train/tiny.yaml",
                                                  {**over, "rollout.release_cache": value})) is keep
    with pytest.raises((ConfigError, ValueError), match="release_cache"):
        load_config(Path(__file__).parents[2] / "config/train/tiny.yaml", {**over, "rollout.release_cache": "sometimes"})


def test_prefill_is_planned_per_engine_chunk():
    """The engine prefills at most PREFILL_TOKENS prompt positions at once; the planner's prefill term follows it
    (256 sequences of 256-token prompts: 32 rows per call, not 256 — the 7B QeRL b256 row measured 27.7 GB)."""
    from qerl.rollout.engine import runner

    assert plan.PREFILL_TOKENS == runner.PREFILL_TOKENS
    assert plan.prefill_rows(256, 256) == 32 and plan.prefill_rows(8, 256) == 8 and plan.prefill_rows(4, 9000) == 1
    s = plan.QWEN25["7B"]
    big, small = (plan.estimate(s, "nvfp4", b, 256, 1024, 2, 32, False)["rollout"]["prefill"] for b in (256, 32))
    assert big == small
    # GRPO: the engine prefills each distinct prompt once (share_prompts) — 64 rows of 4 prompts x 16 samples
    per_row = plan.estimate(s, "nvfp4", 64, 256, 1024, 2, 32, False)["rollout"]["prefill"]
    shared = plan.estimate(s, "nvfp4", 64, 256, 1024, 2, 32, False, prompts=4)["rollout"]["prefill"]
    assert per_row == 32 * shared / 4 and shared == plan.estimate(s, "nvfp4", 4, 256, 1024, 2, 32, False)[
        "rollout"]["prefill"]
    cfg = load_config(Path(__file__).parents[2] / "config/train/tiny.yaml",
                      {"prompts_per_step": 4, "algorithm.group_size": 16, "rollout.max_new_tokens": 1024})
    got = plan.plan_config(cfg, shape="7B", available=80e9)["estimate"]["rollout"]["prefill"]
    assert got == shared  # (qerl plan / qerl train count 4 prompts' prefill)


def test_full_method_per_process_and_sharding():
    """The full method: bf16 weights + bf16 gradients + AdamW states (8 B fp32 / 2 B 8-bit per weight); ZeRO-1
    divides the states by the process count; FSDP2 divides all three except the whole lm_head, and its rollout
    gathers the rest of the weights (14B fits 8 x 80 GB, 32B does not: README's arithmetic)."""
    s = plan.QWEN25["7B"]
    w = sum(plan.weight_bytes(s, "bf16").values())
    assert 15.0e9 < w < 15.5e9  # 7.6 B parameters
    one, _, g = plan.full_bytes(s, eight_bit=False)
    assert g == w and one["optimizer states"] == 4 * w
    zero, _, g = plan.full_bytes(s, eight_bit=False, world=8, sharding="optimizer")
    assert zero["optimizer states"] == w / 2 and g == w
    head = s.vocab * s.hidden * 2
    shard, extra, g = plan.full_bytes(s, eight_bit=False, world=8, sharding="fsdp")
    assert shard["weights (shard + whole lm_head)"] == (w - head) / 8 + head == g
    assert extra["gathered weights"] == (w - head) * 7 / 8
    # gradients: in the update phase only; added whole with several micro-batches, overlapping the activations
    # with one (the measured 7B b8 / b2 rows)
    many, single = (plan.estimate(s, "bf16", b, 256, 1024, 2, 32, False, True, full=True) for b in (8, 2))
    assert many["update"]["gradients"] == w and single["update"]["gradients"] == 0
    rows = 8 * 16 // 8
    for size, fits in (("14B", True), ("32B", False)):
        est = plan.estimate(plan.QWEN25[size], "bf16", rows, 256, 1024, 2, checkpointing=True, eight_bit=False,
                            full=True, world=8, sharding="fsdp")
        gathered = est["static"]["weights (shard + whole lm_head)"] + est["rollout"]["gathered weights"]
        assert abs(gathered - sum(plan.weight_bytes(plan.QWEN25[size], "bf16").values())) < 1  # whole, in the rollout
        assert (est["peak_bytes"] <= 80e9) == fits, (size, est["peak_gb"])


def test_plan_config_covers_the_full_method(tmp_path):
    from qerl.train.config import load_config

    cfg = load_config(Path(__file__).parents[2] / "config/train/tiny.yaml",
                      {"method": "full", "prompts_per_step": 8, "rollout.max_new_tokens": 1024, "sharding": "fsdp",
                       "gradient_checkpointing": True, "micro_batch_size": 2})
    res = plan_one = plan.plan_config(cfg, shape="32B", available=80e9, world=1)
    assert not plan_one["fits"] and "gradients" in res["estimate"]["update"]
    assert any("sharding: fsdp" in tip for tip in res["advice"])
    eight = plan.plan_config(cfg, shape="14B", available=80e9, world=8)
    assert eight["fits"] and "sharding fsdp" in eight["markdown"] and "gathered weights" in eight["markdown"]



def test_auto_micro_batch_is_the_largest_the_planner_fits():
    """`micro_batch_size: auto`: the largest power of two (or the whole step) whose planned peak stays within 90% of
    the GPU without checkpointing if that is >= 2 sequences, else the largest that fits with it; a bad value is one
    ConfigError naming the field."""
    from qerl.models.shapes import QWEN25
    from qerl.train.config import ConfigError, from_dict, validate, TrainConfig
    from qerl.train.plan import auto_micro_batch, estimate, PROMPT_TOKENS

    s = QWEN25["7B"]
    m, ckpt = auto_micro_batch(s, "nvfp4", 64, 1024, available=80e9)
    peak = lambda m, c: estimate(s, "nvfp4", 64, PROMPT_TOKENS, 1024, m, 32, c, True, True)["peak_bytes"]  # noqa: E731
    assert not ckpt and 1 < m < 64 and peak(m, False) <= 72e9 < peak(2 * m, False)
    assert auto_micro_batch(s, "nvfp4", 64, 1024, available=1000e9) == (64, False)  # everything fits: one forward
    # 14B: 4 (QeRL) / 2 (bf16) sequences fit without checkpointing, the faster configuration measured (reports/step)
    assert auto_micro_batch(QWEN25["14B"], "nvfp4", 64, 1024, available=80e9, eight_bit=False) == (4, False)
    assert auto_micro_batch(QWEN25["14B"], "bf16", 64, 1024, available=80e9, eight_bit=False) == (2, False)
    # 32B QeRL: only one sequence fits without it -> checkpointing with the largest micro-batch that fits with it
    m32, ckpt32 = auto_micro_batch(QWEN25["32B"], "nvfp4", 64, 1024, available=80e9)
    assert ckpt32 and m32 >= 8
    assert peak(1, False) < 72e9  # (7B) and a 1-row step may go without checkpointing
    assert auto_micro_batch(s, "nvfp4", 1, 1024, available=80e9) == (1, False)
    assert auto_micro_batch(s, "nvfp4", 64, 1024, checkpointing=False, available=1e9) == (1, False)
    # at most half a GRPO group (micro-batches cut from length-sorted group rows; 32B measured fastest at 8 of 16)
    assert auto_micro_batch(s, "nvfp4", 64, 1024, available=1000e9, group=16) == (8, False)
    assert auto_micro_batch(QWEN25["32B"], "nvfp4", 16, 1024, available=80e9, eight_bit=False, group=16) == (8, True)
    assert auto_micro_batch(QWEN25["32B"], "nvfp4", 16, 1024, available=80e9, eight_bit=False) == (16, True)
    assert auto_micro_batch(s, "nvfp4", 64, 1024, available=1000e9, group=4) == (64, False)  # (groups of 8 on)
    cfg = validate(from_dict(TrainConfig, {"model": {"path": "m"}, "micro_batch_size": "auto"}))
    assert cfg.micro_batch_size == "auto"
    with pytest.raises(ConfigError, match=r"config.micro_batch_size: a positive integer or 'auto', got 'big'"):
        validate(from_dict(TrainConfig, {"model": {"path": "m"}, "micro_batch_size": "big"}))


def test_the_paper_3b_shape_plans_with_tied_embeddings(tmp_path):
    """Qwen2.5-3B (the paper's GSM8K table): tied embeddings counted once; `qerl plan --shape 3B` answers."""
    from qerl.cli import main
    from qerl.models.random import qwen_config
    from qerl.models.shapes import QWEN25

    s3 = QWEN25["3B"]
    assert s3.tied and qwen_config("3B").tie_word_embeddings and not qwen_config("7B").tie_word_embeddings
    assert plan.weight_bytes(s3, "nvfp4")["embeddings+lm_head"] == s3.vocab * s3.hidden * 2
    cfg = tmp_path / "c.yaml"
    cfg.write_text("method: qerl\nmodel: {path: none}\nprompts_per_step: 8\nalgorithm: {group_size: 8}\n"
                   "rollout: {max_new_tokens: 1024}\n")
    assert main(["plan", "--config", str(cfg), "--shape", "3B", "--gpu-gb", "80", "--json"]) == 0


def test_mixed_checkpoints_plan_their_bf16_layers():
    """A checkpoint that keeps its last layers in bf16 (`qerl quantize --keep-bf16-last`): the planner reads them
    from the ignore list and counts those layers' linears at 2 B per weight."""
    from qerl.models.shapes import Shape
    from qerl.quant.format import last_layers_pattern

    cfg = {"hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
           "num_key_value_heads": 4, "vocab_size": 152064}
    plain = Shape.from_config(cfg)
    mixed = Shape.from_config({**cfg, "quantization_config": {"ignore": ["lm_head", last_layers_pattern(28, 0.15)]}})
    assert plain.bf16_layers == 0 and mixed.bf16_layers == 5
    per_layer = sum(k * n for k, n in plain.projections().values())
    extra = plan.weight_bytes(mixed, "nvfp4")["linears"] - plan.weight_bytes(plain, "nvfp4")["linears"]
    assert extra == pytest.approx(5 * per_layer * (2 - plan.PACKED_BYTES["nvfp4"]))
    assert plan.weight_bytes(mixed, "bf16") == plan.weight_bytes(plain, "bf16")


def test_dense_update_is_planned_in_the_update_phase():
    """``dense_update``: the NVFP4 linears' bf16 copy (2 B per weight: 7B ~13 GB) is part of the update phase's
    peak, nothing for a bf16 base; a non-boolean setting is refused."""
    from qerl.models.shapes import QWEN25
    from qerl.train.config import ConfigError, TrainConfig, validate
    from qerl.train.plan import estimate

    s = QWEN25["7B"]
    plain = estimate(s, "nvfp4", 64, 256, 1024, 4, checkpointing=False)
    dense = estimate(s, "nvfp4", 64, 256, 1024, 4, checkpointing=False, dense=True)
    extra = dense["update"]["dense base (dense_update)"]
    linears = (s.layers - s.bf16_layers) * sum(k * n for k, n in s.projections().values())
    assert extra == 2 * linears and 12e9 < extra < 14e9
    assert dense["phases"]["update"] == plain["phases"]["update"] + extra
    assert "dense base (dense_update)" not in estimate(s, "bf16", 64, 256, 1024, 4, dense=True)["update"]
    with pytest.raises(ConfigError, match="config.dense_update: true, false or auto, got 'yes'"):
        validate(TrainConfig(dense_update="yes"))


def test_dense_update_auto_where_measured_faster():
    """``dense_update: auto`` with ``micro_batch_size: auto`` (80 GB, 64 sequences x 1,280 tokens): 7B QeRL takes the
    copy at micro-batch 4 (8 without it: the copy at half of it is faster, reports/step), 14B keeps micro-batch 4
    without it (the copy would need micro-batch 2); with a micro-batch given, on where it fits; never for a bf16 base;
    ``qerl plan`` says so in its title."""
    import dataclasses

    from qerl.models.shapes import QWEN25
    from qerl.train.config import ModelConfig, TrainConfig, validate

    base = validate(TrainConfig(method="qerl", micro_batch_size="auto", prompts_per_step=8, model=ModelConfig(path="m"),
                                rollout=dataclasses.replace(TrainConfig().rollout, max_new_tokens=1024)))
    assert base.dense_update == "auto" and base.algorithm.group_size == 8  # 64 sequences per step
    got = {}
    for shape in ("7B", "14B"):
        cfg, said = plan.resolve_micro_batch(base, QWEN25[shape], available=80e9)
        got[shape] = (cfg.micro_batch_size, plan.resolve_dense_update(cfg, QWEN25[shape], available=80e9).dense_update)
        if shape == "7B":
            assert "with dense_update" in said and "without it 4 would fit" in said  # (half a group of 8)
    assert got == {"7B": (4, True), "14B": (4, False)}
    fixed = dataclasses.replace(base, micro_batch_size=4)
    assert plan.resolve_dense_update(fixed, QWEN25["7B"], available=80e9).dense_update is True
    assert plan.resolve_dense_update(fixed, QWEN25["7B"], available=24e9).dense_update is False  # does not fit
    lora = dataclasses.replace(fixed, method="lora")
    assert plan.resolve_dense_update(lora, QWEN25["7B"], available=80e9).dense_update is False
    rows = dataclasses.replace(base, micro_batch_tokens=False)
    assert "dense update" in plan.plan_config(rows, shape="7B", available=80e9)["markdown"].splitlines()[0]
    # micro-batches cut by tokens (the default): the copy would cost tokens at 7B, so none (test_micro_tokens)
    title = plan.plan_config(base, shape="7B", available=80e9)["markdown"].splitlines()[0]
    assert "dense update" not in title and "(packed: at most 10496 tokens)" in title


def test_half_group_cap_only_where_the_update_is_arithmetic_bound():
    """A small model's update is host-bound: micro-batch auto takes the largest that fits, not half a group (0.5B on
    an H100: 2.31 s at 4, 0.54 s at 64); 7B / 32B keep the cap (an update arithmetic-bound at group / 2)."""
    from qerl.models.shapes import named
    from qerl.train.plan import auto_micro_batch, host_bound

    small, big = named("0.5B"), named("7B")
    assert host_bound(small, 4, 256 + 384) and not host_bound(big, 8, 256 + 1024)
    micro, ckpt = auto_micro_batch(small, "nvfp4", 64, 384, 32, False, "auto", 80e9, 8, dense=True, prompts=8)
    assert micro > 4 and not ckpt
    assert auto_micro_batch(big, "nvfp4", 64, 1024, 32, False, "auto", 80e9, 16, dense=True, prompts=4)[0] <= 8


def test_plan_refuses_the_split_train_refuses():
    """issue 80: `qerl plan --nproc 3` said a config fits where `qerl train --nproc 3` refuses it (8 prompts a
    step do not split over 3 ranks)."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "qerl", "plan", "--config", "config/train/tiny.yaml", "--nproc", "3"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "prompts_per_step = 8 does not split over 3 processes" in r.stderr
    assert "Traceback" not in r.stderr
