"""Supported architectures and their NVFP4-relevant structure (no torch import).

Everything decoder-side that is an ``nn.Linear`` gets quantized; what the architecture decides is
which projections share one global scale (vLLM fuses them: q/k/v into ``qkv_proj`` and gate/up into
``gate_up_proj``, with a single global scale per fused layer).
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

#: model_type -> groups of sibling projection names that vLLM fuses.
FUSED_GROUPS: dict[str, tuple[tuple[str, ...], ...]] = {
    "qwen2": (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")),
    "qwen3": (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")),
    "llama": (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")),
    "mistral": (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")),
}
SUPPORTED = tuple(sorted(FUSED_GROUPS))
#: The seven LoRA/AQN target projections of a Qwen2/Llama decoder layer.
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class UnsupportedArchitectureError(ValueError):
    """The model's ``model_type`` is not one qerl knows how to quantize and train."""


def check_supported(model_type: str | None, source: str) -> str:
    """Return ``model_type`` or raise naming the file and the supported types."""
    if model_type not in FUSED_GROUPS:
        raise UnsupportedArchitectureError(
            f"{source}: model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED)}"
        )
    return model_type


def fused_groups(model_type: str, linear_names: Iterable[str]) -> list[list[str]]:
    """Partition full module names into global-scale groups (singletons for unfused ones).

    >>> fused_groups("qwen2", ["m.l.0.self_attn.q_proj", "m.l.0.self_attn.k_proj", "m.l.0.mlp.down_proj"])
    [['m.l.0.self_attn.q_proj', 'm.l.0.self_attn.k_proj'], ['m.l.0.mlp.down_proj']]
    """
    member_of = {p: i for i, group in enumerate(FUSED_GROUPS[model_type]) for p in group}
    buckets: dict[tuple[str, int], list[str]] = defaultdict(list)
    groups: list[list[str]] = []
    for name in linear_names:
        parent, _, leaf = name.rpartition(".")
        if leaf in member_of:
            key = (parent, member_of[leaf])
            if key not in buckets:
                groups.append(buckets[key])
            buckets[key].append(name)
        else:
            groups.append([name])
    return groups
