"""The README's "From TRL" snippet, exactly as printed, on this CPU: a tiny warm-started model quantized to NVFP4 at the
snippet's own path, the snippet's code run verbatim (its GRPOConfig held to two steps: the test's one change), TRL's
GRPOTrainer sampling through qerl's rollout_func with AQN; the completion length capped to the model's context.
(That an update on qerl's rollouts moves the adapter: tests/hf/test_hf.py, with a reward a tiny model can vary on.)"""
import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def readme_trl_snippet() -> str:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("### From TRL"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_readmes_trl_snippet_trains_on_a_cpu(warm_model, tmp_path, monkeypatch):
    pytest.importorskip("trl")
    import trl

    from qerl.stages.quantize import quantize_checkpoint

    code = readme_trl_snippet()
    path = re.search(r'^path = "([^"]+)"', code, re.M).group(1)
    quantize_checkpoint(warm_model, tmp_path / path, progress=False)
    monkeypatch.chdir(tmp_path)
    made = []

    class TwoSteps(trl.GRPOConfig):  # the snippet's own arguments, two steps, no logging integrations
        def __init__(self, *args, **kwargs):
            kwargs.update(max_steps=2, report_to="none", save_strategy="no", logging_steps=1)
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(trl, "GRPOConfig", TwoSteps)
    scope: dict = {}
    with pytest.warns(UserWarning, match=r"max_completion_length 512 > the model's context \(512, "
                                         r"max_position_embeddings\): completions capped at \d+ tokens"):
        exec(compile(code, "README.md (From TRL)", "exec"), scope)
    args, trainer, model = made[0], scope["trainer"], scope["model"]
    assert args.learning_rate == 3e-5 and args.use_cpu is (not torch.cuda.is_available())
    assert trainer.state.global_step == 2
    logged = [h for h in trainer.state.log_history if "reward" in h]
    assert len(logged) == 2 and all(h["loss"] == h["loss"] for h in logged)  # two steps, each logged, finite
    assert [h["aqn/sigma"] == 0.0 for h in logged] == [True, False]  # AQN's stage 0 noise-free, then σ > 0
    # the adapter as saved is PEFT's, on the checkpoint the snippet loaded
    import json

    saved = json.loads((tmp_path / "adapter/adapter_config.json").read_text())
    assert saved["r"] == 32 and saved["peft_type"] == "LORA" and (tmp_path / "adapter/adapter_model.safetensors").is_file()
