"""Answer extraction from completions (pure string functions, bounded work).

Methods, tried in the configured order, the first that finds something wins:
``answer_tag`` (last ``<answer>…</answer>``), ``boxed`` (last ``\\boxed{…}``, balanced braces),
``gsm8k`` (text after the last ``####``), ``last_number`` (the last number in the text).
"""
from __future__ import annotations

import re

METHODS = ("answer_tag", "boxed", "gsm8k", "last_number")
DEFAULT_ORDER = ("answer_tag", "boxed", "gsm8k")
#: Completions are cut to their last MAX_SCAN characters before extraction (a megabyte of text
#: must not cost a megabyte of regex work; answers sit at the end).
MAX_SCAN = 20_000

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def _answer_tag(text: str) -> str | None:
    found = _ANSWER.findall(text)
    return found[-1].strip() if found else None


def _boxed(text: str) -> str | None:
    start = text.rfind("\\boxed")
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0:
        return None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j].strip()
    return None


def _gsm8k(text: str) -> str | None:
    if "####" not in text:
        return None
    return text.rsplit("####", 1)[1].strip().replace(",", "") or None


def _last_number(text: str) -> str | None:
    found = _NUMBER.findall(text)
    return found[-1].replace(",", "") if found else None


#: a number with only a currency sign before it and the plain words of a unit after it ("20 cups", "\\$20",
#: "2 dollars", "20 minutes/day"): math-verify reads the words as symbols (and "\\$" as text), so the answer never
#: equals the gold number; seen in real Qwen2.5 outputs on GSM8K
_NUMBER_UNITS = re.compile(r"^\s*(?:\\?\$)?\s*(-?\d[\d,]*(?:\.\d+)?)(?:\s+[A-Za-z][A-Za-z ]*(?:/[A-Za-z ]+)?)?\.?\s*$")


def strip_units(answer: str | None) -> str | None:
    """``"20 cups"`` / ``"\\$20"`` -> ``"20"``: a number with only a currency sign before it and the plain words of
    a unit after it loses them; anything else (``"20 + x"``, ``"x = 20"``, LaTeX units that math-verify already
    reads) is returned as it was."""
    if answer is None:
        return None
    m = _NUMBER_UNITS.match(answer)
    return m.group(1).strip() if m else answer


_FUNCS = {"answer_tag": _answer_tag, "boxed": _boxed, "gsm8k": _gsm8k, "last_number": _last_number}


def extract_answer(text: str, methods: tuple[str, ...] = DEFAULT_ORDER) -> str | None:
    """The answer string of ``text`` by the first method that finds one, or None."""
    bad = [m for m in methods if m not in _FUNCS]
    if bad:
        raise ValueError(f"unknown answer extraction method(s) {bad}; known: {METHODS}")
    text = text[-MAX_SCAN:]
    for m in methods:
        ans = _FUNCS[m](text)
        if ans:
            return ans
    return None


def gsm8k_gold(solution: str) -> str:
    """GSM8K gold answer: the text after ``####`` (commas removed)."""
    ans = _gsm8k(solution)
    if ans is None:
        raise ValueError(f"GSM8K solution has no '####' answer: {solution[-80:]!r}")
    return ans
