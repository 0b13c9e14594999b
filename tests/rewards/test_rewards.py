"""Answer extraction, math-verify grading (with hostile completions), the reward registry."""

import pytest

from qerl.rewards.extract import extract_answer, gsm8k_gold, strip_units
from qerl.rewards.registry import RewardSettings, build_reward, format_reward, register_reward
from qerl.rewards.verify import MathVerifier


@pytest.fixture(scope="module")
def verifier():
    v = MathVerifier(timeout=3.0)
    yield v
    v.close()


@pytest.mark.parametrize("text, want", [
    ("<think>2+2</think><answer> 4 </answer>", "4"),
    ("<answer>1</answer> then <answer>2</answer>", "2"),
    ("so \\boxed{\\frac{1}{2}} done", "\\frac{1}{2}"),
    ("nested \\boxed{\\sqrt{\\frac{a}{b}}}", "\\sqrt{\\frac{a}{b}}"),
    ("He pays 3 + 4 = 7.\n#### 1,234", "1234"),
    ("no answer here", None),
])
def test_extraction(text, want):
    assert extract_answer(text) == want


def test_extraction_fallback_order_and_errors():
    assert extract_answer("the result is 42.", ("answer_tag", "last_number")) == "42"
    assert extract_answer("\\boxed{3} <answer>5</answer>", ("boxed", "answer_tag")) == "3"
    with pytest.raises(ValueError, match="unknown answer extraction"):
        extract_answer("x", ("regex",))
    assert gsm8k_gold("Natalia sold 48/2 = 24 clips.\n#### 72") == "72"
    with pytest.raises(ValueError, match="####"):
        gsm8k_gold("no marker")


@pytest.mark.parametrize("gold, answer, ok", [
    ("\\frac12", "0.5", True), ("0.5", "\\boxed{1/2}", True), ("72", "72.0", True),
    ("1/3", "0.33", False), ("x^2", "x*x", True), ("7", "8", False), ("7", None, False),
])
def test_math_verify_equivalence(verifier, gold, answer, ok):
    assert verifier(gold, answer) is ok


def test_hostile_completions_cost_at_most_the_limit(verifier):
    """Bounded by work, not by a wall clock: an answer over ``max_chars`` is scored 0 without being parsed; every
    other one is one check in the worker, answered or killed at the verifier's own limit (a timeout is a result)."""
    hostile = [
        "9" * 5000,                                   # huge number (over max_chars: scored 0 at once)
        "{" * 400 + "1" + "}" * 400,                  # deep nesting
        "\\frac{" * 200 + "1" + "}{2}" * 200,
        "10^{10^{10^{10^{10^{10}}}}}",                # sympy power tower
        "(" * 300 + "x" + ")" * 300,
    ]
    for ans in hostile:
        checks, timeouts = verifier.checks, verifier.timeouts
        assert verifier("1", ans) is False
        assert verifier.checks - checks == (0 if len(ans) > verifier.max_chars else 1)
        assert verifier.timeouts - timeouts <= verifier.checks - checks  # at most one limit's wait per check
    reward = build_reward(RewardSettings())
    checks = reward.correct.verifier.checks
    assert reward("x" * 3_000_000 + "<answer>" + "1" * 2000 + "</answer>", "1") == 0.0  # megabytes
    assert reward.correct.verifier.checks == checks  # decided without parsing
    reward.close()
    assert verifier.timeouts >= 1  # the power tower really hung sympy and was killed
    assert verifier("2", "2.0") is True  # a fresh worker answers after a kill


def test_registry_and_format():
    r = build_reward(RewardSettings(format_weight=0.2))
    assert r("<think>hm</think><answer>\\frac{1}{2}</answer>", "0.5") == pytest.approx(1.2)
    assert r("<answer>0.5</answer>", "1/2") == pytest.approx(1.0)
    assert format_reward("<think>a</think> <answer>b</answer>") == 1.0
    assert format_reward("<answer>b</answer>") == 0.0
    exact = build_reward(RewardSettings(correctness="exact"))
    assert exact(" 12", "12") == 1.0 and exact("12.0", "12") == 0.0

    @register_reward("always_one_test")
    def _factory(settings):
        return lambda completion, gold: 1.0

    assert build_reward(RewardSettings(correctness="always_one_test"))("", "") == 1.0
    with pytest.raises(ValueError, match="unknown reward"):
        build_reward(RewardSettings(correctness="nope"))


@pytest.mark.parametrize("answer, want", [
    ("20 cups", "20"), ("2 dollars", "2"), ("20 minutes/day", "20"), ("\\$20", "20"), ("$1,000", "1,000"),
    ("-3.5 meters.", "-3.5"), ("20", "20"),
    # left alone: an expression, an equation, a number glued to a symbol, LaTeX units math-verify reads itself
    ("20 + x", "20 + x"), ("x = 20", "x = 20"), ("20x", "20x"), ("20 \\text{ cups}", "20 \\text{ cups}"),
    ("20 cups of 3", "20 cups of 3"), (None, None),
])
def test_strip_units(answer, want):
    assert strip_units(answer) == want


def test_math_reward_takes_plain_word_units_of_real_outputs():
    """Seen in a real Qwen2.5 0.5B run on GSM8K: \\boxed{20 cups} and \\boxed{\\$20} against the gold 20 scored 0."""
    reward = build_reward(RewardSettings(correctness="math"))
    try:
        for text in ("so \\boxed{20 cups}", "<answer>20 minutes/day</answer>", "\\boxed{\\$20}", "\\boxed{20}"):
            assert reward.score(text, "20")[1] == 1.0, text
        assert reward.score("\\boxed{200 cups}", "20")[1] == 0.0
    finally:
        reward.close()
