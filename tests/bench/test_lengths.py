"""Completion-length distributions of the benchmarks: parsing, seeded draws independent of how the rows are
split over ranks, the stated shape (median, tail at the cap), clear errors."""
import statistics

import pytest

from qerl.bench.lengths import REALISTIC, Lengths, draw, parse, summary


def test_specs_parse_and_print_back():
    assert parse("fixed") == Lengths() and str(parse("fixed")) == "fixed"
    s = parse(REALISTIC)
    assert s.kind == "lognormal" and dict(s.params) == {"median": 300.0, "sigma": 0.9}
    assert str(s) == REALISTIC and parse(str(s)) == s
    assert str(parse("uniform:high=200,low=10")) == "uniform:low=10,high=200"


@pytest.mark.parametrize("spec, match", [
    ("gamma", "unknown distribution 'gamma'"), ("lognormal:median=300", "takes median, sigma, got median"),
    ("lognormal:median=x,sigma=1", "median: expected a number, got 'x'"),
    ("lognormal:median=0,sigma=1", r"median must be in \[1, 1e\+06\], got 0"),
    ("uniform:low=9,high=3", "1 <= low <= high"), ("fixed:low=1", "unknown parameter 'low'; expected none")])
def test_bad_specs_are_named(spec, match):
    with pytest.raises(ValueError, match=match):
        parse(spec)


def test_draws_are_seeded_bounded_and_split_invariant():
    s = parse(REALISTIC)
    whole = draw(s, 2000, 1024, seed=4)
    assert whole == draw(s, 2000, 1024, seed=4) and whole != draw(s, 2000, 1024, seed=5)
    assert draw(s, 1000, 1024, seed=4) + draw(s, 1000, 1024, seed=4, first_row=1000) == whole  # two ranks' shares
    assert min(whole) >= 1 and max(whole) == 1024
    # lognormal(median 300, sigma 0.9): P(L >= 1024) = P(z >= ln(1024/300)/0.9 = 1.364) = 8.6%
    assert abs(statistics.median(whole) - 300) < 20
    assert 0.07 < sum(x == 1024 for x in whole) / len(whole) < 0.10
    assert draw(parse("fixed"), 3, 64) == [64, 64, 64]
    u = draw(parse("uniform:low=10,high=12"), 300, 1024)
    assert set(u) == {10, 11, 12}
    assert summary([1, 2, 3, 10, 10], 10) == "median 3, mean 5, p90 10, 40% at the max 10"
