"""``model.train(mode)`` without walking the module tree again: the update phase walks a model's modules once
(``list(model.modules())``: a 0.5B Qwen2 with LoRA on its seven projections has ~2,000) and hands that list to each of
its switches (:func:`qerl.train.fused.fused_elementwise`, :func:`qerl.models.nvfp4_linear.dense_base`,
:func:`qerl.lora.frozen_adapters`, :func:`set_training`). The update of a small model waits on its host (reports/step:
0.5B, 0.31 s of wall clock for 0.18 s of GPU work), and each walk with a Python call per module is host time."""
from __future__ import annotations

from torch import nn


def _plain(m: nn.Module) -> bool:
    """Whether ``m.train(mode)`` does nothing but set its ``training`` flag (and its children's)."""
    train = type(m).train
    if train is nn.Module.train:
        return True
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover (transformers is a dependency)
        return False
    # transformers re-applies hub kernels on a mode change when use_kernels is on; otherwise it is nn.Module's
    return train is PreTrainedModel.train and not getattr(m, "use_kernels", False)


def set_training(model: nn.Module, modules: list[nn.Module], mode: bool = True) -> None:
    """``model.train(mode)``, given ``modules = list(model.modules())``: each module's ``training`` flag set directly
    where no module's class does more in ``train`` (PEFT's DoRA layers, transformers with ``use_kernels``, or any
    other override); else ``model.train(mode)`` itself."""
    if not all(_plain(m) for m in modules):
        model.train(mode)
        return
    for m in modules:
        object.__setattr__(m, "training", mode)
