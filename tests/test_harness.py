"""A generated bad-input harness (hypothesis, a fixed seed, a bounded budget): malformed workflow configs, results
files, numbers, GGUF / adapter files and output directories that are not qerl's, thrown at the verbs in process.

Every case must end without a traceback; a case that is certainly wrong must end with a non-zero exit and a last
line that names the problem; and no file that was there before may change. The cases of the bad-input rounds
(issue 64) are its explicit examples.
"""
import contextlib
import io
import json
import os
import shutil
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parents[1]
BUDGET = settings(derandomize=True, max_examples=30, deadline=None, database=None,
                  suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def run(*argv) -> tuple[int, str]:
    """``qerl ARGV`` in process: (exit code, stderr); argparse's own exit is caught."""
    from qerl.cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main([str(a) for a in argv])
        except SystemExit as e:  # argparse's exit, or a verb's SystemExit(message) (the interpreter prints that)
            code = e.code if isinstance(e.code, int) else 2
            if isinstance(e.code, str):
                err.write(e.code + "\n")
    return code, err.getvalue()


def snapshot(root: Path) -> dict:
    out = {}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            p = Path(dirpath) / name
            out[str(p)] = ("link", os.readlink(p)) if p.is_symlink() else p.read_bytes() if p.is_file() else "dir"
    return out


def judged(code: int, err: str, certainly_bad: bool, names: str | None = None) -> None:
    assert "Traceback" not in err, err[-2000:]
    if certainly_bad:
        assert code != 0, "a bad input was accepted"
    if code != 0:
        last = err.strip().splitlines()[-1]
        assert last.startswith("qerl"), err[-1000:]
        if names:
            assert names in last, (names, last)


# -- workflow configs: one mutation of the default config, read by every command that reads configs ----------------
BASE = yaml.safe_load((ROOT / "config/config.yaml").read_text())


def _paths(node, prefix=()):
    if isinstance(node, dict):
        for k, v in node.items():
            yield prefix + (k,)
            yield from _paths(v, prefix + (k,))


PATHS = sorted(_paths(BASE), key=str)
BAD_VALUES = st.sampled_from([float("nan"), float("inf"), -1, "x", [], {}, None, 10 ** 30, True])


@st.composite
def mutated_config(draw):
    kind = draw(st.sampled_from(["twice", "typo", "value", "drop"]))
    path = draw(st.sampled_from(PATHS))
    text = (ROOT / "config/config.yaml").read_text()
    data = json.loads(json.dumps(BASE))
    if kind == "twice":  # a top-level section given twice (the last would silently win)
        return text + f"\n{path[0]}: {json.dumps(data[path[0]])}\n", True
    node = data
    for k in path[:-1]:
        node = node[k]
    if kind == "typo":
        key = str(path[-1])
        i = draw(st.integers(0, len(key) - 1))
        new = key[:i] + draw(st.sampled_from("xqz_")) + key[i + 1:]
        if new == key or new in node:
            return text, False
        node[new] = node.pop(path[-1])
        return yaml.safe_dump(data), True
    if kind == "value":
        node[path[-1]] = draw(BAD_VALUES)
        return yaml.safe_dump(data), False  # (some values are allowed where they land: no traceback is the rule)
    del node[path[-1]]
    return yaml.safe_dump(data), len(path) == 1 and path[0] in ("configuration", "models", "datasets", "experiments",
                                                                 "train", "evaluation")


@BUDGET
@given(case=mutated_config())
@example(case=("configuration: a\nconfiguration: b\n", True))
@example(case=(open(ROOT / "config/config.yaml").read() + "\nreport: {table1: {algorithm: dapo}}\n", True))
def test_workflow_configs(case, tmp_path_factory):
    text, bad = case
    d = tmp_path_factory.mktemp("cfg")
    f = d / "c.yaml"
    f.write_text(text)
    before = snapshot(d)
    for argv in (["fetch", "--configfile", f, "--dry-run"],
                 ["report", "--workflow-config", f, "--results", d / "none", "--output", d / "rep"],
                 ["bench", "cost", "--configfile", f, "--output", d / "cost"]):
        code, err = run(*argv)
        judged(code, err, bad, names=str(f) if bad else None)
    after = snapshot(d)
    assert {k: v for k, v in after.items() if k in before} == before


# -- results read back: a run's metrics and an evaluation summary, one file damaged --------------------------------
CLAIMS_CFG = {"configuration": "h", "models": {"m": {"source": "tiny"}}, "datasets": {"d": {"task": "synthetic"}},
              "train": {}, "evaluation": {"benchmarks": ["b"], "local_benchmarks": {"b": {"path": "b.jsonl"}}},
              "experiments": [{"models": ["m"], "datasets": ["d"], "methods": ["lora", "qerl"], "algorithms": ["grpo"],
                               "seeds": [0]}]}


def _results(root: Path) -> None:
    for method in ("lora", "qerl"):
        run_dir = root / "train" / f"m/{method}/grpo/d/seed0"
        run_dir.mkdir(parents=True)
        run_dir.joinpath("summary.json").write_text(json.dumps({"steps": 5}))  # a finished run
        run_dir.joinpath("metrics.jsonl").write_text("".join(
            json.dumps({"step": i, "reward_mean": 0.1 * i, "entropy": 0.3, "rollout_seconds": 1.0,
                        "train_seconds": 0.5}) + "\n" for i in range(1, 6)))
        ev = root / "eval" / f"m/{method}/grpo/d/seed0"
        ev.mkdir(parents=True)
        ev.joinpath("b.json").write_text(json.dumps({"pass@1": 0.5, "problems": 4, "per_problem": [1, 0, 1, 0]}))


DAMAGE = st.sampled_from(["cut", "empty", "binary", "nan", "string", "twice", "list", "range"])


def test_the_intact_results_pass(tmp_path):
    """(The damage below is what fails: the same results undamaged make a report.)"""
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump(CLAIMS_CFG))
    _results(tmp_path / "results")
    for verb in ("claims", "report"):
        code, err = run(verb, "--workflow-config", cfg, "--results", tmp_path / "results", "--output", tmp_path / verb)
        assert code == 0, err


@settings(BUDGET, max_examples=10)  # (each example renders two reports: ~2 s)
@given(which=st.sampled_from(["metrics", "eval"]), damage=DAMAGE, at=st.floats(0.05, 0.95))
@example(which="eval", damage="string", at=0.5)  # "pass@1": "high" (a TypeError traceback in qerl report once)
@example(which="metrics", damage="empty", at=0.5)  # an empty metrics.jsonl (a ZeroDivisionError once)
def test_results_files(which, damage, at, tmp_path_factory):
    d = tmp_path_factory.mktemp("res")
    cfg = d / "cfg.yaml"
    cfg.write_text(yaml.safe_dump(CLAIMS_CFG))
    _results(d / "results")
    f = d / "results" / ("train/m/qerl/grpo/d/seed0/metrics.jsonl" if which == "metrics"
                         else "eval/m/qerl/grpo/d/seed0/b.json")
    raw = f.read_bytes()
    certainly = True
    if damage == "cut":
        f.write_bytes(raw[:max(1, int(len(raw) * at))])
        certainly = which == "eval"
    elif damage == "empty":
        f.write_bytes(b"")
    elif damage == "binary":
        f.write_bytes(b"\xff\xfe\x00garbage")
    elif damage == "list":
        f.write_text("[1, 2, 3]\n")
    elif which == "eval":
        body = {"nan": '{"pass@1": NaN, "problems": 4, "per_problem": [1, 0, 1, 0]}',
                "string": '{"pass@1": "high", "problems": 4, "per_problem": [1, 0, 1, 0]}',
                "twice": '{"pass@1": 0.5, "pass@1": 0.9, "problems": 4, "per_problem": [1, 0, 1, 0]}',
                "range": '{"pass@1": 7, "problems": 4, "per_problem": [1, 0, 1, 0]}'}[damage]
        f.write_text(body)
    else:
        row = {"nan": '{"step": 6, "reward_mean": NaN, "rollout_seconds": 1, "train_seconds": 1}',
               "string": '{"step": 6, "reward_mean": "x", "rollout_seconds": 1, "train_seconds": 1}',
               "twice": '{"step": 6, "step": 7, "reward_mean": 0.1}',
               "range": '{"step": 6, "reward_mean": 1e999, "rollout_seconds": 1, "train_seconds": 1}'}[damage]
        f.write_text(raw.decode() + row + "\n")
    before = snapshot(d / "results")
    for argv in (["claims", "--workflow-config", cfg, "--results", d / "results", "--output", d / "out"],
                 ["report", "--workflow-config", cfg, "--results", d / "results", "--output", d / "rep"]):
        code, err = run(*argv)
        judged(code, err, certainly and argv[0] == "claims")
    assert snapshot(d / "results") == before


# -- numbers: every numeric option and name=value list, finite and in range or one line naming the flag ------------
NUMBER_TEXT = st.one_of(st.floats(allow_nan=True, allow_infinity=True).map(repr), st.integers().map(str),
                        st.sampled_from(["1e400", "-0", "nan", "inf", "", "1,5", "0x10", "1e-400"]))


@BUDGET
@given(text=NUMBER_TEXT)
@example(text="inf")
@example(text="1e400")
@example(text="nan")
def test_keep_bf16_last(text, tmp_path_factory):
    d = tmp_path_factory.mktemp("num")
    code, err = run("quantize", "--model", d / "no_model", "--output", d / "q", "--keep-bf16-last", text)
    judged(code, err, True)
    assert not (d / "q").exists()


@BUDGET
@given(params=st.dictionaries(st.sampled_from(["median", "sigma", "low", "high", "mu", "median "]), NUMBER_TEXT,
                              max_size=3),
       kind=st.sampled_from(["lognormal", "uniform", "fixed", "gamma"]), repeat=st.booleans())
@example(params={"median": "inf", "sigma": "0.9"}, kind="lognormal", repeat=False)
@example(params={"median": "300", "sigma": "0.9"}, kind="lognormal", repeat=True)
def test_length_specs(params, kind, repeat):
    import math

    from qerl.bench.lengths import parse

    parts = [f"{k}={v}" for k, v in params.items()]
    if repeat and parts:
        parts.append(parts[0])
    spec = kind + (":" + ",".join(parts) if parts else "")
    try:
        got = parse(spec)
    except ValueError as e:
        assert str(e).startswith("--lengths") and "\n" not in str(e)
        return
    assert all(math.isfinite(v) for _, v in got.params) and not (repeat and parts)


# -- files: GGUF and adapters cut anywhere, output directories that hold someone's files ----------------------------
@pytest.fixture(scope="module")
def gguf_bytes(tiny_gguf):
    return Path(tiny_gguf["Q8_0"]).read_bytes()


@BUDGET
@given(at=st.floats(0.0, 0.999))
def test_gguf_cut_anywhere(at, gguf_bytes, tmp_path_factory):
    from qerl.models.gguf import GGUFError, inspect

    d = tmp_path_factory.mktemp("gguf")
    f = d / "cut.gguf"
    f.write_bytes(gguf_bytes[:int(len(gguf_bytes) * at)])
    with pytest.raises(GGUFError):
        inspect(f)


@pytest.fixture
def adapter(tiny_dirs, lora_policy, tmp_path_factory):
    from qerl.lora import save_adapter

    return save_adapter(lora_policy(tiny_dirs["qwen2"], 0), tmp_path_factory.mktemp("adapter") / "a")


@BUDGET
@given(at=st.floats(0.0, 0.999), manifest=st.booleans())
def test_adapter_cut_anywhere(at, manifest, adapter, tmp_path_factory):
    from qerl.checkpoint import CheckpointError
    from qerl.lora import _check_adapter_files

    d = tmp_path_factory.mktemp("ad") / "a"
    shutil.copytree(adapter, d)
    w = d / "adapter_model.safetensors"
    w.write_bytes(w.read_bytes()[:int(w.stat().st_size * at)])
    if not manifest:
        (d / "qerl_files.json").unlink()
    with pytest.raises(CheckpointError):
        _check_adapter_files(d)


@BUDGET
@given(names=st.lists(st.sampled_from(["notes.txt", "sub/keep.md", "link", "model.safetensors", "config.json",
                                       ".hidden", "nvfp4/config.json"]), min_size=1, max_size=4, unique=True))
@example(names=["notes.txt"])
@example(names=["link"])
def test_force_never_deletes_what_qerl_did_not_write(names, tmp_path_factory):
    d = tmp_path_factory.mktemp("force")
    out = d / "out"
    out.mkdir()
    (d / "elsewhere").mkdir()
    (d / "elsewhere" / "keep").write_text("keep")
    for n in names:
        p = out / n
        p.parent.mkdir(parents=True, exist_ok=True)
        if n == "link":
            os.symlink(d / "elsewhere", p)
        else:
            p.write_text(f"user {n}")
    before = snapshot(d)
    foreign = any(n not in ("model.safetensors", "config.json") for n in names)
    code, err = run("build-tiny", "--output", out, "--force")
    judged(code, err, foreign)
    if foreign:
        assert snapshot(d) == before
