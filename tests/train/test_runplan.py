"""One run plan: `qerl plan --config C` prints exactly the plan `qerl train --config C` prints at its start and then
follows (qerl.train.runplan.resolve, called once), and the run's config.json holds the resolved values."""
import json

import yaml


def _cfg(tmp_path, model, **over):
    cfg = {"method": "qerl", "steps": 1, "prompts_per_step": 2, "micro_batch_size": 8, "device": "cpu",
           "model": {"path": str(model), "dtype": "float32"}, "data": {"task": "synthetic", "synthetic_size": 20},
           "rollout": {"max_new_tokens": 4}, "algorithm": {"group_size": 2}, "lora": {"r": 4, "alpha": 8},
           "reward": {"correctness": "exact"}, "tracking": {"backend": "none"}, "output_dir": str(tmp_path / "run"),
           **over}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _plan_lines(text):
    return [line for line in text.splitlines() if line.startswith("run plan (")]


def test_plan_and_train_print_the_same_resolved_plan(tiny_dirs, tmp_path, capsys):
    from qerl.cli import main

    for name, over in (("qerl", {}), ("lora_aqn", {"method": "lora", "aqn": {"enabled": True},
                                                   "gradient_checkpointing": "auto", "dense_update": "auto"})):
        (tmp_path / name).mkdir()
        cfg = _cfg(tmp_path / name, tiny_dirs["qwen2"], **over)
        assert main(["plan", "--config", str(cfg)]) == 0
        planned = _plan_lines(capsys.readouterr().out)
        assert main(["train", "--config", str(cfg), "--no-progress"]) == 0
        trained = _plan_lines(capsys.readouterr().out)
        assert len(planned) == 1 and planned == trained, (planned, trained)
        assert "AQN on" in planned[0] and "gradient_checkpointing false" in planned[0]
        saved = json.loads((tmp_path / name / "run" / "config.json").read_text())
        assert saved["gradient_checkpointing"] is False and saved["dense_update"] is False  # resolved, not "auto"


def test_resolve_calls_the_planner_once_per_setting(tiny_dirs):
    from qerl.train.config import TrainConfig, from_dict, validate
    from qerl.train.runplan import resolve

    cfg = validate(from_dict(TrainConfig, {"method": "nvfp4_lora", "model": {"path": str(tiny_dirs["qwen2"])},
                                           "micro_batch_size": 4, "optim": {"offload": "rollout"}}))
    resolved, plan, memory = resolve(cfg, "cpu", 1)
    assert memory is None and not plan.offload and not plan.aqn and plan.sharding == "none"
    assert resolved.gradient_checkpointing is False and resolved.dense_update is False
    assert plan.lines()[0].startswith("run plan (cpu, 1 process(es)): micro_batch_size 4")


def test_the_checked_plan_and_the_runs_plan_agree_over_a_grid(tmp_path, monkeypatch):
    """On a (simulated, 80 GB) GPU, over Qwen2.5 shapes x methods x batch x completion length x micro-batch x
    `auto` settings: the memory check plans exactly the run that happens — its checkpointing is the run's (one
    rule), the planner runs once (no second call for the engine's cache), and the config the run writes back holds
    every decision (sharding, engine cache, offload), never `auto`."""
    import itertools

    from qerl.models.shapes import QWEN25
    from qerl.train import plan as planner
    from qerl.train.config import TrainConfig, from_dict, validate
    from qerl.train.runplan import resolve

    calls = []
    real = planner.plan_config
    monkeypatch.setattr(planner, "plan_config", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(planner, "device_bytes", lambda: 80e9)
    dirs = {}
    for size in ("3B", "7B", "14B", "32B"):
        s = QWEN25[size]
        d = tmp_path / size
        d.mkdir()
        (d / "config.json").write_text(json.dumps({
            "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": s.hidden,
            "intermediate_size": s.intermediate, "num_hidden_layers": s.layers, "num_attention_heads": s.heads,
            "num_key_value_heads": s.kv_heads, "head_dim": s.head_dim, "vocab_size": s.vocab,
            "max_position_embeddings": 32768,
            "tie_word_embeddings": s.tied}))
        dirs[size] = d
    checked = 0
    for size, method, prompts, gen, micro, ckpt in itertools.product(
            dirs, ("lora", "qerl"), (2, 16), (512, 4096), (2, 8), ("auto", True)):
        cfg = validate(from_dict(TrainConfig, {
            "method": method, "model": {"path": str(dirs[size])}, "prompts_per_step": prompts,
            "micro_batch_size": micro, "gradient_checkpointing": ckpt, "rollout": {"max_new_tokens": gen},
            "algorithm": {"group_size": 8}}))
        calls.clear()
        try:
            resolved, run, memory = resolve(cfg, "cuda", 1)
        except ValueError as e:  # does not fit 80 GB even so: refused before anything loads, with the sizes
            assert "GB" in str(e) and len(calls) == 1
            continue
        checked += 1
        assert len(calls) == 1, (size, method, prompts, gen, micro, ckpt)
        assert memory["checkpointing"] == run.gradient_checkpointing == resolved.gradient_checkpointing
        assert resolved.sharding == run.sharding and resolved.rollout.release_cache is (not run.keep_engine_cache)
        assert resolved.optim.offload == ("rollout" if run.offload else "none")
        assert "auto" not in json.dumps({"c": resolved.gradient_checkpointing, "s": resolved.sharding,
                                         "r": resolved.rollout.release_cache, "o": resolved.optim.offload})
    assert checked >= 40
    # a hub id as model.path: the memory check reads the downloaded copy's config.json (model_dir), as the run does
    hub = validate(from_dict(TrainConfig, {"method": "qerl", "model": {"path": "Qwen/Qwen2.5-7B-Instruct"}}))
    calls.clear()
    resolved, run, memory = resolve(hub, "cuda", 1, model_dir=dirs["7B"])
    assert len(calls) == 1 and memory["checkpointing"] == run.gradient_checkpointing
