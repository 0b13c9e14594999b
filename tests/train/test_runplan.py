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
