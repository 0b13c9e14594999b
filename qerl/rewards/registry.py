"""Reward functions by name. A reward maps ``(completion, gold) -> float``; register your own
with :func:`register_reward`. Correctness rewards are 1/0; ``format`` rewards the paper's
``<think>…</think><answer>…</answer>`` layout (0.2 in the reference code when enabled)."""
from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from qerl.rewards.extract import DEFAULT_ORDER, extract_answer, strip_units

RewardFn = Callable[[str, str], float]
_REGISTRY: dict[str, Callable[..., RewardFn]] = {}
_FORMAT = re.compile(r"^\s*<think>.*?</think>\s*<answer>.*?</answer>\s*$", re.DOTALL)


def register_reward(name: str):
    """Decorator registering a factory ``(settings) -> RewardFn`` under ``name``."""
    def deco(factory):
        if name in _REGISTRY:
            raise ValueError(f"reward {name!r} is already registered")
        _REGISTRY[name] = factory
        return factory
    return deco


@dataclass(frozen=True)
class RewardSettings:
    """correctness: a registered reward name; format_weight: bonus for the think/answer format
    (0 = off; reference code 0.2); extraction: answer extraction methods in order;
    timeout: math-verify time limit per check (s)."""

    correctness: str = "math"
    format_weight: float = 0.0
    extraction: tuple[str, ...] = DEFAULT_ORDER
    timeout: float = 5.0


@register_reward("math")
def _math(settings: RewardSettings) -> RewardFn:
    from qerl.rewards.verify import MathVerifier

    verifier = MathVerifier(timeout=settings.timeout)

    def reward(completion: str, gold: str) -> float:
        # both sides lose a currency sign / unit words (MATH500 holds golds such as "\\$18.90")
        return 1.0 if verifier(strip_units(gold), strip_units(extract_answer(completion, settings.extraction))) else 0.0

    reward.verifier = verifier
    return reward


@register_reward("exact")
def _exact(settings: RewardSettings) -> RewardFn:
    def reward(completion: str, gold: str) -> float:
        ans = extract_answer(completion, settings.extraction)
        if ans is None:
            ans = completion.strip()
        return 1.0 if ans == gold.strip() else 0.0

    return reward


def format_reward(completion: str) -> float:
    """1 if the completion is exactly ``<think>…</think><answer>…</answer>`` (whitespace aside)."""
    return 1.0 if _FORMAT.match(completion[-20_000:]) else 0.0


class Reward:
    """``reward(completion, gold) -> total``; ``reward.score(...) -> (total, correctness)``.
    total = correctness + format_weight · format."""

    def __init__(self, correct: RewardFn, format_weight: float):
        self.correct = correct
        self.format_weight = format_weight

    def score(self, completion: str, gold: str) -> tuple[float, float]:
        c = self.correct(completion, gold)
        f = format_reward(completion) if self.format_weight else 0.0
        return c + self.format_weight * f, c

    def __call__(self, completion: str, gold: str) -> float:
        return self.score(completion, gold)[0]

    def close(self) -> None:
        v = getattr(self.correct, "verifier", None)
        if v is not None:
            v.close()


def build_reward(settings: RewardSettings) -> Reward:
    """The configured reward (correctness from the registry plus the optional format bonus)."""
    if settings.correctness not in _REGISTRY:
        raise ValueError(f"unknown reward {settings.correctness!r}; registered: {sorted(_REGISTRY)}")
    return Reward(_REGISTRY[settings.correctness](settings), settings.format_weight)


def available_rewards() -> list[str]:
    return sorted(_REGISTRY)
