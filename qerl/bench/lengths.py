"""Completion-length distributions for the benchmarks (``--lengths``): random-weight models never sample EOS, so
without one every row runs to the maximum — no row finishes early, the engine never refills a slot or compacts
its batch, and data-parallel ranks finish together by construction. With one, each row is stopped at its drawn
length exactly as if it had sampled EOS there (:meth:`qerl.rollout.engine.RolloutEngine.generate`'s ``eos_at``:
the row is found finished at the engine's next host check, like a real EOS).

Specs (stated in every row the benchmarks write):

* ``fixed`` — every row generates the maximum (the benchmarks' default, the paper's efficiency setting);
* ``lognormal:median=M,sigma=S`` — ``L = round(M · exp(S · z))``, ``z ~ N(0, 1)``, clipped to ``[1, max]``: a
  median of a few hundred tokens and a tail that reaches the maximum (the share at the maximum is the rollouts
  truncated there). Reasoning RL's length histograms are of this shape (right-skewed, a spike at the cap);
* ``uniform:low=A,high=B`` — ``L ~ U{A … B}`` clipped to ``[1, max]``.

Draws are seeded and indexed by the *global* row (:func:`draw`), so a data-parallel rank's share holds the same
lengths as the same rows of a one-process run.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

KINDS = {"fixed": (), "lognormal": ("median", "sigma"), "uniform": ("low", "high")}
#: the realistic default the reports use: median 300 tokens, ~9% of 1,024-token rollouts truncated at the cap
REALISTIC = "lognormal:median=300,sigma=0.9"
# each parameter's range: lengths are token counts (at most a million), sigma a log-scale spread
RANGES = {"median": (1, 1e6), "sigma": (0, 5), "low": (1, 1e6), "high": (1, 1e6)}


@dataclass(frozen=True)
class Lengths:
    """A parsed ``--lengths`` spec (see the module docstring)."""

    kind: str = "fixed"
    params: tuple[tuple[str, float], ...] = ()

    @property
    def fixed(self) -> bool:
        return self.kind == "fixed"

    def __str__(self) -> str:
        return self.kind + (":" + ",".join(f"{k}={v:g}" for k, v in self.params) if self.params else "")

    def draw(self, n: int, max_len: int, seed: int = 0, first_row: int = 0) -> list[int]:
        """Lengths of global rows ``first_row … first_row + n - 1`` (each in ``[1, max_len]``)."""
        return draw(self, n, max_len, seed, first_row)


def parse(spec: str) -> Lengths:
    """``fixed`` | ``lognormal:median=M,sigma=S`` | ``uniform:low=A,high=B`` -> :class:`Lengths` (a clear error
    naming the spec otherwise; usable as an argparse ``type``)."""
    kind, _, rest = str(spec).strip().partition(":")
    if kind not in KINDS:
        raise ValueError(f"--lengths {spec!r}: unknown distribution {kind!r} (expected one of {', '.join(KINDS)}, "
                         f"e.g. {REALISTIC})")
    from qerl.argtypes import key_values

    want = KINDS[kind]
    got = key_values(rest, {k: RANGES[k] for k in want}, f"--lengths {spec!r}")
    if set(got) != set(want):
        raise ValueError(f"--lengths {spec!r}: {kind} takes {', '.join(want) or 'no parameters'}, "
                         f"got {', '.join(sorted(got)) or 'none'}")
    if kind == "uniform" and not got["low"] <= got["high"]:
        raise ValueError(f"--lengths {spec!r}: needs 1 <= low <= high")
    return Lengths(kind, tuple((k, got[k]) for k in want))


def draw(spec: Lengths, n: int, max_len: int, seed: int = 0, first_row: int = 0) -> list[int]:
    """Seeded lengths of global rows ``first_row …`` (one stream over all rows, so any split of the rows over
    ranks draws the same values)."""
    import random

    if spec.fixed:
        return [max_len] * n
    p = dict(spec.params)
    rng = random.Random(f"qerl-lengths-{seed}")
    out = []
    for i in range(first_row + n):
        if spec.kind == "lognormal":
            x = p["median"] * math.exp(p["sigma"] * rng.gauss(0.0, 1.0))
        else:
            x = rng.uniform(p["low"], p["high"] + 1) - 0.5
        if i >= first_row:
            out.append(max(1, min(max_len, round(x))))
    return out


def summary(lengths: list[int], max_len: int) -> str:
    """``median M, mean A, p90 P, X% at the max`` of drawn (or generated) lengths."""
    s = sorted(lengths)
    if not s:
        return "no rows"
    q = lambda f: s[min(len(s) - 1, int(f * len(s)))]  # noqa: E731
    at_max = sum(x >= max_len for x in s) / len(s)
    return f"median {q(0.5)}, mean {sum(s) / len(s):.0f}, p90 {q(0.9)}, {at_max:.0%} at the max {max_len}"


def argtype(spec: str) -> Lengths:
    """:func:`parse` as an argparse ``type`` (a bad spec is a usage error naming it)."""
    import argparse

    try:
        return parse(spec)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
