"""qerl.train.modes: the update's mode switch over one walk's module list equals ``model.train(mode)``."""
import torch
from torch import nn

from qerl.train.modes import set_training


class _Counted(nn.Module):
    """A module whose ``train`` does more than set flags (as PEFT's DoRA layers do)."""

    calls = 0

    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(2, 2)

    def train(self, mode: bool = True):
        _Counted.calls += 1
        return super().train(mode)


def test_set_training_equals_train(tiny_dirs):
    from qerl.lora import LoraSettings, apply_lora
    from qerl.models import load_policy

    model = apply_lora(load_policy(tiny_dirs["qwen2"], dtype=torch.float32), LoraSettings(r=4, alpha=8.0))
    mods = list(model.modules())
    assert len(mods) > 50
    for mode in (True, False, True):
        set_training(model, mods, mode)
        assert all(m.training is mode for m in mods)
        assert model.training is mode and model.get_decoder().layers[0].training is mode


def test_set_training_falls_back_to_an_overriding_train():
    model = nn.Sequential(nn.Linear(2, 2), _Counted())
    before = _Counted.calls
    set_training(model, list(model.modules()), True)
    assert _Counted.calls == before + 1 and all(m.training for m in model.modules())
    set_training(model, list(model.modules()), False)
    assert _Counted.calls == before + 2 and not any(m.training for m in model.modules())
    plain = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    set_training(plain, list(plain.modules()), False)
    assert not any(m.training for m in plain.modules())
