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


def int_at_least(lo: int):
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"must be >= {lo}, got {v}")
        return v
    parse.__name__ = f"integer >= {lo}"
    return parse


def float_in(lo: float, hi: float | None = None, lo_open: bool = False):
    def parse(text: str) -> float:
        import math

        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not math.isfinite(v) or (v <= lo if lo_open else v < lo) or (hi is not None and v > hi):
            rng = f"{'(' if lo_open else '['}{lo}, {hi}]" if hi is not None else f"{'>' if lo_open else '>='} {lo}"
            raise argparse.ArgumentTypeError(f"must be {'in ' if hi is not None else ''}{rng}, got {text}")
        return v
    parse.__name__ = "number"
    return parse


POSITIVE = int_at_least(1)
