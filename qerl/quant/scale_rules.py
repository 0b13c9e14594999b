"""NVFP4 block-scale rules as a registry: ``name -> (scale cap, block quantizer)``, the one place that names a rule.

Every rule writes ordinary NVFP4 (e2m1 codes, E4M3 block scales, an fp32 global scale): it decides only how the
scales are chosen. A rule is

* ``scale_cap`` — the largest block scale the global scale leaves room for: ``gs = scale_cap · 6 / amax(|w|)``
  (``max6``: 448, E4M3's largest; four-over-six: 256, so that its 1.5x larger max-to-4 candidate still fits);
* ``quantizer`` — ``(w [N, K] float, gs fp32 [1], own_scale: bool) -> (packed uint8 [N, K/2], scale float8_e4m3fn
  [N, K/16], gs fp32 [1])``: the block quantizer (a callable, or ``"module:function"`` imported when first used,
  so that this module and the command line that lists the rules stay light).

A new rule is one :func:`register` call (here for a built-in one); the CLI's ``--scale-rule`` choices, the Hugging
Face config's validation and the quantize report read this table. Light: no torch.
"""
from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class ScaleRule:
    name: str
    scale_cap: float
    quantizer: Callable | str
    help: str = ""

    def quantize_blocks(self) -> Callable:
        """The block quantizer (imported on first use where given as ``"module:function"``)."""
        if callable(self.quantizer):
            return self.quantizer
        module, _, fn = self.quantizer.partition(":")
        return getattr(importlib.import_module(module), fn)


#: name -> rule, in registration order (the first is the default)
RULES: dict[str, ScaleRule] = {}
DEFAULT = "max6"  # the paper's


def register(rule: ScaleRule, replace: bool = False) -> ScaleRule:
    """Add ``rule`` to :data:`RULES`; a name taken already is a ValueError unless ``replace``."""
    if not rule.name or not isinstance(rule.name, str):
        raise ValueError(f"a scale rule needs a name, got {rule.name!r}")
    if not (isinstance(rule.scale_cap, (int, float)) and 0 < rule.scale_cap <= 448):
        raise ValueError(f"scale rule {rule.name!r}: scale_cap {rule.scale_cap!r} must be in (0, 448] (E4M3's range)")
    if rule.name in RULES and not replace:
        raise ValueError(f"scale rule {rule.name!r} is registered already")
    RULES[rule.name] = rule
    return rule


def unregister(name: str) -> None:
    if name == DEFAULT:
        raise ValueError(f"the default scale rule {DEFAULT!r} cannot be removed")
    RULES.pop(name, None)


def get(name: str) -> ScaleRule:
    """The rule called ``name``; ValueError listing the registered ones."""
    try:
        return RULES[name]
    except (KeyError, TypeError):
        raise ValueError(f"scale rule {name!r} is not one of {', '.join(RULES)}") from None


def help_text() -> str:
    """One line for ``--scale-rule``'s help: every rule and what it does."""
    return "block scales: " + "; ".join(f"{r.name} ({r.help})" if r.help else r.name for r in RULES.values())


register(ScaleRule("max6", 448.0, "qerl.quant.nvfp4:quantize_max6",
                   "the paper's: each block's largest value lands on 6"))
register(ScaleRule("four-over-six", 256.0, "qerl.quant.nvfp4:quantize_four_over_six",
                   "Cook et al. 2025: per block the max-to-6 or max-to-4 scale with the smaller squared error"))
