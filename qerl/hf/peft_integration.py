"""PEFT on NVFP4 layers, with the user's own ``LoraConfig``: ``get_peft_model(model, LoraConfig(...))``.

PEFT's dispatch knows ``nn.Linear`` and a fixed list of quantized layers; others it takes through the
custom-module mapping of a config (``LoraConfig._register_custom_module``). :func:`register` (run when
:mod:`qerl.hf` is imported) makes that mapping implicit for :class:`qerl.models.nvfp4_linear.NVFP4Linear`:

* PEFT's ``LoraModel._create_new_module`` adds ``{NVFP4Linear: LoraNVFP4Linear}`` to a config that maps nothing
  for it, so the layer PEFT builds is qerl's fused LoRA layer (the one ``qerl train`` uses: one kernel for base +
  LoRA in rollouts, one autograd node in training; :func:`qerl.lora._lora_linear_cls`), and ``merge`` on it
  raises one line that points to ``qerl export-merged``;
* ``target_modules="all-linear"`` also selects the NVFP4 layers (PEFT's own expansion sees ``nn.Linear`` only, so
  on a quantized model it would target almost nothing).

Adapters save in PEFT's format with PEFT's key names, and load onto the bf16 base as well.
"""
from __future__ import annotations

import functools


def _nvfp4_mapping():
    from qerl.lora import _lora_linear_cls
    from qerl.models.nvfp4_linear import NVFP4Linear

    return NVFP4Linear, _lora_linear_cls()


def register() -> None:
    """Install the two hooks above (idempotent)."""
    from peft.tuners import tuners_utils
    from peft.tuners.lora.model import LoraModel

    create = LoraModel.__dict__["_create_new_module"]
    if not getattr(create, "_qerl", False):
        original = create.__func__

        @functools.wraps(original)
        def _create_new_module(lora_config, adapter_name, target, **kwargs):
            from peft.tuners.tuners_utils import BaseTunerLayer

            key, cls = _nvfp4_mapping()
            base = target.get_base_layer() if isinstance(target, BaseTunerLayer) else target
            if isinstance(base, key) and key not in (lora_config._custom_modules or {}):
                lora_config._register_custom_module({key: cls})
            return original(lora_config, adapter_name, target, **kwargs)

        wrapped = staticmethod(_create_new_module)
        wrapped.__func__._qerl = True
        LoraModel._create_new_module = wrapped

    expand = tuners_utils._maybe_include_all_linear_layers
    if not getattr(expand, "_qerl", False):

        @functools.wraps(expand)
        def _maybe_include_all_linear_layers(peft_config, model):
            target = getattr(peft_config, "target_modules", None)
            all_linear = isinstance(target, str) and target.lower() == tuners_utils.INCLUDE_LINEAR_LAYERS_SHORTHAND
            out = expand(peft_config, model)
            if all_linear:
                key, _ = _nvfp4_mapping()
                names = {name.rpartition(".")[2] for name, m in model.named_modules() if isinstance(m, key)}
                if names:
                    out.target_modules = set(out.target_modules or set()) | names
            return out

        _maybe_include_all_linear_layers._qerl = True
        tuners_utils._maybe_include_all_linear_layers = _maybe_include_all_linear_layers
