"""The training methods: one registry that the trainer, its config, the workflow, the planner and the report read
(no torch: the Snakefile imports it).

A method is (base format, LoRA?, AQN?): the five rows the paper compares. The untrained bases (``bf16``,
``nvfp4``, and ``nf4`` where QLoRA is compared) are evaluated beside them; :data:`ROWS` is the order of the paper's
tables.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Method:
    name: str
    base: str  # "bf16" | "nf4" | "nvfp4"
    lora: bool
    aqn: bool
    description: str
    label: str  # the paper's row label (Tables 1 and 2)


METHODS = {m.name: m for m in (
    Method("full", "bf16", False, False, "bf16 full fine-tuning (all parameters)", "bf16 full fine-tuning"),
    Method("lora", "bf16", True, False, "bf16 base + LoRA", "bf16 LoRA"),
    Method("qlora", "nf4", True, False, "NF4 base (bitsandbytes) + LoRA (QLoRA)", "NF4 LoRA (QLoRA)"),
    Method("nvfp4_lora", "nvfp4", True, False, "NVFP4 base + LoRA", "NVFP4 LoRA"),
    Method("qerl", "nvfp4", True, True, "NVFP4 base + LoRA + AQN (QeRL)", "NVFP4 LoRA + AQN (QeRL)"),
)}
NAMES = tuple(METHODS)
#: The untrained bases evaluated beside the trained methods: name -> (base format, the paper's row label).
UNTRAINED = {"bf16": ("bf16", "bf16, untrained"), "nvfp4": ("nvfp4", "NVFP4, untrained"),
             "nf4": ("nf4", "NF4, untrained")}
#: The untrained bases a workflow evaluates when its config names none (``nf4`` only on request: QLoRA's base).
DEFAULT_UNTRAINED = ("bf16", "nvfp4")
#: Methods trained on the NVFP4 checkpoint (the workflow quantizes their model first).
NVFP4_METHODS = tuple(n for n, m in METHODS.items() if m.base == "nvfp4")
#: Every row of the paper's tables, in their order.
ROWS = (*UNTRAINED, *NAMES)


def base_of(name: str) -> str:
    """The base format a method (or an untrained base) runs on."""
    return UNTRAINED[name][0] if name in UNTRAINED else METHODS[name].base


def resolve_aqn(setting, method_aqn: bool) -> bool:
    """The one rule for ``aqn.enabled``: true / false as set, ``auto`` the method's own choice ``method_aqn``."""
    flag = str(setting).lower()
    return method_aqn if flag == "auto" else flag == "true"


def aqn_on(name: str, setting="auto") -> bool:
    """Whether a run of method ``name`` adds AQN (:func:`resolve_aqn` with the method's choice: QeRL only)."""
    return resolve_aqn(setting, METHODS[name].aqn)


def label(name: str) -> str:
    """The paper's row label of a method or an untrained base."""
    return UNTRAINED[name][1] if name in UNTRAINED else METHODS[name].label
