"""Command-line argument types and the help format shared by every ``qerl`` command (light: no torch).

A bad value is argparse's one-line error naming the flag (``--samples: must be >= 1, got 0``); every option's help
ends with its default.
"""
from __future__ import annotations

import argparse


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's help ends with its default (none for flags and required options)."""

    def _get_help_string(self, action):
        if action.default in (None, False, argparse.SUPPRESS) or action.required or "%(default)" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


MAX_GPUS = 4096  # GPUs (or processes a node, nodes) a command plans for: more is a typo, not a cluster


def int_at_least(lo: int, hi: int | None = None):
    """An argparse type: an integer >= ``lo`` (and <= ``hi``, a bound stated in the error)."""
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"must be >= {lo}, got {v}")
        if hi is not None and v > hi:
            raise argparse.ArgumentTypeError(f"must be <= {hi}, got {v}")
        return v
    parse.__name__ = f"integer >= {lo}" if hi is None else f"integer in [{lo}, {hi}]"
    return parse


def float_in(lo: float, hi: float | None = None, lo_open: bool = False):
    def parse(text: str) -> float:
        import math

        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not math.isfinite(v):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
        if (v <= lo if lo_open else v < lo) or (hi is not None and v > hi):
            rng = f"{'(' if lo_open else '['}{lo}, {hi}]" if hi is not None else f"{'>' if lo_open else '>='} {lo}"
            raise argparse.ArgumentTypeError(f"must be {'in ' if hi is not None else ''}{rng}, got {text}")
        return v
    parse.__name__ = "number"
    return parse


POSITIVE = int_at_least(1)


def finite_number(text: str, what: str) -> float:
    """``text`` as a finite number, else ``ValueError`` naming ``what`` (``nan``, ``inf`` and ``1e400`` are
    refused here, not as an OverflowError deep in a computation)."""
    import math

    try:
        v = float(text)
    except (TypeError, ValueError):
        raise ValueError(f"{what}: expected a number, got {text!r}") from None
    if not math.isfinite(v):
        raise ValueError(f"{what}: must be a finite number, got {text}")
    return v


def key_values(text: str, ranges: dict[str, tuple[float, float]], what: str) -> dict[str, float]:
    """``name=number,name=number`` -> dict: every name one of ``ranges`` (the nearest named when not), none given
    twice, each number finite and within its ``(low, high)``; ``ValueError`` naming ``what`` and the part."""
    import difflib

    got: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in str(text).split(","))):
        k, eq, v = part.partition("=")
        k = k.strip()
        if not eq or not k:
            raise ValueError(f"{what}: {part!r} is not name=number")
        if k not in ranges:
            near = difflib.get_close_matches(k, list(ranges), n=1)
            raise ValueError(f"{what}: unknown parameter {k!r}" + (f" (did you mean {near[0]!r}?)" if near else "")
                             + f"; expected {', '.join(ranges) or 'none'}")
        if k in got:
            raise ValueError(f"{what}: {k} is given twice")
        x = finite_number(v.strip(), f"{what}: {k}")
        lo, hi = ranges[k]
        if not lo <= x <= hi:
            raise ValueError(f"{what}: {k} must be in [{lo:g}, {hi:g}], got {v.strip()}")
        got[k] = x
    return got


def layer_count_or_fraction(text: str) -> float:
    """``--keep-bf16-last``: 0, a layer count (1, 2, ...) or a fraction in (0, 1)."""
    try:
        v = finite_number(text, "")
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a layer count or a fraction in (0, 1), got {text!r}") from None
    if v < 0 or (v >= 1 and v != int(v)) or v > 10_000:
        raise argparse.ArgumentTypeError(f"expected 0, a layer count (1, 2, ...) or a fraction in (0, 1), got {text}")
    return v
