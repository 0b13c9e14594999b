"""Numbers in one place (qerl.argtypes): every numeric option and name=value list is finite, in range, and named in
one line; repeated and unknown names are refused (the cases the bad-input round found)."""
import argparse
import subprocess
import sys

import pytest

from qerl.argtypes import finite_number, key_values, layer_count_or_fraction
from qerl.bench.lengths import parse


@pytest.mark.parametrize("spec, message", [
    ("lognormal:median=300,median=10", "median is given twice"),
    ("lognormal:median=inf,sigma=0.9", "median: must be a finite number, got inf"),
    ("lognormal:median=300,sigma=inf", "sigma: must be a finite number"),
    ("lognormal:median=1e308,sigma=0.9", "median must be in [1, 1e+06], got 1e308"),
    ("lognormal:median=nan,sigma=0.9", "median: must be a finite number"),
    ("uniform:low=1,high=inf", "high: must be a finite number"),
    ("lognormal:median=300,sigam=0.9", "unknown parameter 'sigam' (did you mean 'sigma'?)"),
    ("lognormal:median", "'median' is not name=number"),
    ("uniform:low=9,high=3", "needs 1 <= low <= high"),
])
def test_length_specs_are_refused_in_one_line(spec, message):
    with pytest.raises(ValueError) as e:
        parse(spec)
    assert message in str(e.value) and str(e.value).startswith(f"--lengths {spec!r}")


def test_good_specs_and_the_helpers():
    assert parse("lognormal:median=300,sigma=0.9").params == (("median", 300.0), ("sigma", 0.9))
    assert parse("fixed").fixed
    assert key_values(" a=1 , b=2 ", {"a": (0, 1), "b": (0, 5)}, "x") == {"a": 1.0, "b": 2.0}
    with pytest.raises(ValueError, match="--w: expected a number, got 'abc'"):
        finite_number("abc", "--w")
    for bad in ("inf", "-inf", "1e400", "nan"):
        with pytest.raises(ValueError, match="must be a finite number"):
            finite_number(bad, "--w")


@pytest.mark.parametrize("text", ["inf", "1e400", "nan", "-1", "1.5", "abc", "1e9"])
def test_keep_bf16_last_refuses_what_is_no_layer_count(text):
    with pytest.raises(argparse.ArgumentTypeError):
        layer_count_or_fraction(text)


def test_the_cli_names_the_flag_without_a_traceback(tmp_path):
    for argv, words in ((["quantize", "--model", "m", "--output", "o", "--keep-bf16-last", "inf"],
                         ["--keep-bf16-last", "a layer count"]),
                        (["quantize", "--model", "m", "--output", "o", "--keep-bf16-last", "nan"],
                         ["--keep-bf16-last"])):
        r = subprocess.run([sys.executable, "-m", "qerl", *argv], capture_output=True, text=True, cwd=tmp_path)
        assert r.returncode == 2 and all(w in r.stderr for w in words), r.stderr
        assert "Traceback" not in r.stderr
    assert layer_count_or_fraction("0.15") == 0.15 and layer_count_or_fraction("3") == 3.0


def test_plan_refuses_lengths_it_would_not_use():
    from pathlib import Path

    cfg = Path(__file__).resolve().parents[1] / "config/train/tiny.yaml"
    r = subprocess.run([sys.executable, "-m", "qerl", "plan", "--config", str(cfg), "--lengths", "fixed"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "--lengths: used only with --cost" in r.stderr and "Traceback" not in r.stderr


def test_tracking_options_without_a_run_name_are_refused(tmp_path):
    r = subprocess.run([sys.executable, "-m", "qerl", "quantize", "--model", "m", "--output", "o", "--mlflow-uri",
                        f"sqlite:///{tmp_path}/x.db"], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 2 and "--mlflow-uri is given without --mlflow-run-name" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "x.db").exists()


def test_counts_have_a_bound_stated_in_the_error():
    """issue 80 S1: `qerl bench cost --gpus 1000000000` ran 10 minutes at full CPU; a count over its bound is one
    line now, before any work."""
    import subprocess
    import sys

    for argv in (["bench", "cost", "--gpus", "1000000000"], ["train", "--nproc", "99999", "--config", "x.yaml"],
                 ["plan", "--nproc", "5000"]):
        r = subprocess.run([sys.executable, "-m", "qerl", *argv], capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and "must be <= 4096" in r.stderr and "Traceback" not in r.stderr, argv


def test_an_infinite_number_is_named_as_such():
    import argparse

    from qerl.argtypes import float_in

    with pytest.raises(argparse.ArgumentTypeError, match="must be a finite number, got inf"):
        float_in(0.0)("inf")
