"""The compressed-tensors ``nvfp4-pack-quantized`` checkpoint format: config and tensor names.

A quantized Linear ``prefix`` stores ``prefix.weight_packed`` (uint8 ``[N, K/2]``),
``prefix.weight_scale`` (float8_e4m3fn ``[N, K/16]``), ``prefix.weight_global_scale`` (float32
``[1]``) and, if it has one, ``prefix.bias``. ``config.json`` carries the ``quantization_config``
built by :func:`quantization_config` (llm-compressor's NVFP4A16 preset). No I/O here.
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

PACKED_SUFFIXES = ("weight_packed", "weight_scale", "weight_global_scale")
QUANT_METHOD = "compressed-tensors"
FORMAT = "nvfp4-pack-quantized"


class CheckpointFormatError(ValueError):
    """A checkpoint's config or tensors do not match the NVFP4 format."""


def quantization_config(ignore: Iterable[str] = ("lm_head",)) -> dict[str, Any]:
    """The ``quantization_config`` block of ``config.json`` for NVFP4A16 (weights only)."""
    return {
        "quant_method": QUANT_METHOD,
        "format": FORMAT,
        "quantization_status": "compressed",
        "ignore": list(ignore),
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {
                    "num_bits": 4,
                    "type": "float",
                    "symmetric": True,
                    "strategy": "tensor_group",
                    "group_size": 16,
                    "dynamic": False,
                    "observer": "minmax",
                },
                "input_activations": None,
                "output_activations": None,
            }
        },
        "kv_cache_scheme": None,
    }


def parse_quantization_config(cfg: Mapping[str, Any] | None, source: str) -> dict[str, Any] | None:
    """Validate a ``quantization_config``; return ``{"ignore": [...], "targets": [...]}``.

    Returns ``None`` when ``cfg`` is ``None`` (an unquantized checkpoint). Raises
    :class:`CheckpointFormatError` naming ``source`` and the offending field otherwise.
    """
    if cfg is None:
        return None
    where = f"{source}: quantization_config"

    def expect(field: str, got: Any, want: Any) -> None:
        if got != want:
            raise CheckpointFormatError(f"{where}.{field} is {got!r}; expected {want!r}")

    expect("quant_method", cfg.get("quant_method"), QUANT_METHOD)
    expect("format", cfg.get("format"), FORMAT)
    groups = cfg.get("config_groups")
    if not isinstance(groups, Mapping) or not groups:
        raise CheckpointFormatError(f"{where}.config_groups is missing or empty")
    targets: list[str] = []
    for gname, group in groups.items():
        w = group.get("weights") or {}
        expect(f"config_groups.{gname}.weights.num_bits", w.get("num_bits"), 4)
        expect(f"config_groups.{gname}.weights.type", w.get("type"), "float")
        expect(f"config_groups.{gname}.weights.group_size", w.get("group_size"), 16)
        expect(f"config_groups.{gname}.weights.symmetric", w.get("symmetric", True), True)
        if group.get("input_activations") is not None:
            raise CheckpointFormatError(
                f"{where}.config_groups.{gname}.input_activations is set: this is a W4A4 "
                "checkpoint; qerl reads weight-only NVFP4 (NVFP4A16), expected null"
            )
        targets.extend(group.get("targets") or [])
    return {"ignore": list(cfg.get("ignore") or []), "targets": targets}


def _matches(pattern: str, name: str, class_names: tuple[str, ...]) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return pattern == name or pattern in class_names


def kept_layers(num_layers: int, keep: float) -> int:
    """How many last decoder layers ``--keep-bf16-last keep`` leaves in bf16: ``keep`` >= 1 a count, 0 < ``keep``
    < 1 a fraction of ``num_layers`` (rounded up), 0 none."""
    import math

    if keep < 0 or (keep >= 1 and keep != int(keep)):
        raise ValueError(f"--keep-bf16-last {keep:g}: a layer count (0, 1, 2, ...) or a fraction in (0, 1)")
    n = int(keep) if keep >= 1 or keep == 0 else math.ceil(keep * num_layers)
    if n > num_layers:
        raise ValueError(f"--keep-bf16-last {keep:g}: the model has {num_layers} decoder layers")
    return n


def last_layers_pattern(num_layers: int, keep: float) -> str | None:
    """The ``re:`` ignore entry that keeps the last decoder layers in bf16 (the NVFP4 RL recipes of 2026 keep the
    last ~15%): ``keep`` >= 1 is a count, 0 < ``keep`` < 1 a fraction of ``num_layers`` (rounded up); 0: None.
    Matches every module of those layers (``model.layers.<i>.…``), as compressed-tensors / vLLM read it."""
    n = kept_layers(num_layers, keep)
    if n == 0:
        return None
    return "re:(.*\\.)?layers\\.(" + "|".join(str(i) for i in range(num_layers - n, num_layers)) + ")\\."


def check_patterns(patterns: Iterable[str], what: str = "--ignore") -> None:
    """Every ``re:`` entry compiles; a bad one is a ValueError naming it."""
    for p in patterns:
        if p.startswith("re:"):
            try:
                re.compile(p[3:])
            except re.error as e:
                raise ValueError(f"{what} {p!r}: not a valid regular expression ({e})") from None


def is_target(
    name: str, class_names: Iterable[str], targets: Iterable[str], ignore: Iterable[str]
) -> bool:
    """Whether module ``name`` is quantized under ``targets``/``ignore``.

    ``class_names`` are the names of the module's classes (its MRO). Entries are exact module
    names, class names (``"Linear"``) or ``re:`` regexes matched from the start of the name
    (``re.match``), exactly as compressed-tensors' ``match_name``/``_match_class`` do.
    """
    classes = tuple(class_names)
    if any(_matches(p, name, classes) for p in ignore):
        return False
    return any(_matches(p, name, classes) for p in targets)
