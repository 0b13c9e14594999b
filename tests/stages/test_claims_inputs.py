"""`qerl claims` against bad input, concurrent writers and a failing disk (issue 80, L1-L3, T1-T2, S2-S5, S14-S15,
S18-S19): one line naming the problem, never a traceback, and nothing a user or an earlier run wrote is changed."""
import errno
import gzip
import json

import pytest

from tests.stages.test_claims import CONFIG, _write


def _claims(*argv):
    from qerl.cli import main

    return main(["claims", *map(str, argv)])


@pytest.fixture
def res(tmp_path):
    res = tmp_path / "results"
    for seed in (0, 1):
        for m, acc in (("lora", 0.4), ("lora_aqn", 0.4), ("nvfp4_lora", 0.3), ("qerl", 0.3)):
            _write(res, m, seed, acc, 0.004, 0.3, 2.0, m in ("qerl", "lora_aqn"))
    for base in ("bf16", "nvfp4"):
        d = res / "eval" / f"m/{base}/untrained/none/seed0"
        d.mkdir(parents=True)
        (d / "b.json").write_text(json.dumps({"pass@1": 0.3, "problems": 300, "per_problem": [0.3] * 300}))
    return res


@pytest.fixture
def cfg(tmp_path):
    import yaml

    f = tmp_path / "cfg.yaml"
    f.write_text(yaml.safe_dump(CONFIG))
    return f


def _err(capsys):
    err = capsys.readouterr().err.strip().splitlines()
    assert err and "Traceback" not in "\n".join(err)
    return err[-1]


def test_L2_output_holding_a_users_files_is_refused_and_left_as_it_was(res, cfg, tmp_path, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "claims.md").write_text("# my notes\n")
    assert _claims("--workflow-config", cfg, "--results", res, "--output", out) != 0
    assert "claims.md was not written by qerl claims" in _err(capsys)
    assert [p.name for p in out.iterdir()] == ["claims.md"] and (out / "claims.md").read_text() == "# my notes\n"
    (out / "claims.md").unlink()
    (out / "curves.png").write_text("not a figure")
    assert _claims("--workflow-config", cfg, "--results", res, "--output", out) != 0
    assert "curves.png is not a figure qerl claims wrote" in _err(capsys)
    (out / "curves.png").unlink()
    assert _claims("--workflow-config", cfg, "--results", res, "--output", out) == 0  # a rerun over its own report
    assert _claims("--workflow-config", cfg, "--results", res, "--output", out) == 0


def test_S19_output_inside_the_results_tree_or_the_evidence_is_refused(res, cfg, capsys):
    assert _claims("--workflow-config", cfg, "--results", res, "--output", res / "reports") != 0
    assert "is inside --results" in _err(capsys) and not (res / "reports").exists()


def test_L3_a_rerun_that_fails_while_writing_leaves_the_previous_report_whole(res, cfg, tmp_path, monkeypatch,
                                                                           capsys):
    out = tmp_path / "rep"
    assert _claims("--workflow-config", cfg, "--results", res, "--output", out) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    from qerl import files

    real, calls = files.write_text_atomic, []

    def full(path, text):  # the disk fills up on the third file of the rerun
        calls.append(path)
        if len(calls) == 3:
            raise OSError(errno.ENOSPC, "No space left on device", path)
        return real(path, text)

    monkeypatch.setattr(files, "write_text_atomic", full)
    rows = [json.loads(x) for x in (res / "train/m/qerl/grpo/d/seed0/metrics.jsonl").read_text().splitlines()]
    (res / "train/m/qerl/grpo/d/seed0/metrics.jsonl").write_text(
        "".join(json.dumps({**r, "reward_mean": 0.9}) + "\n" for r in rows))  # the rerun would change the verdicts
    assert _claims("--workflow-config", cfg, "--results", res, "--output", out) != 0
    msg = _err(capsys)
    assert "rep/accuracy.csv: no space left" in msg and ".qerl-claims-" not in msg, msg
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # the old set, whole; no staging folder left


def test_L1_two_packs_into_one_evidence_directory_never_both_write(res, cfg, tmp_path):
    """The second writer is refused while the first holds the evidence directory (its runs are never dropped by a
    read-merge-write race)."""
    import os
    import subprocess
    import sys

    from qerl import outputs

    ev = tmp_path / "ev"
    with outputs.hold(ev, "claims --pack"):  # a first writer (this process) holds it; a second process arrives
        env = {k: v for k, v in os.environ.items() if k != "QERL_HELD_OUTPUTS"}
        r = subprocess.run([sys.executable, "-m", "qerl", "claims", "--workflow-config", str(cfg), "--results",
                            str(res), "--pack", str(ev)], capture_output=True, text=True, env=env)
    assert r.returncode != 0 and "is in use by PID" in r.stderr and "Traceback" not in r.stderr
    assert _claims("--workflow-config", cfg, "--results", res, "--pack", ev) == 0


def test_T1_runs_of_two_to_four_steps_are_compared_without_a_traceback(tmp_path, capsys, cfg):
    res = tmp_path / "results"
    for seed in (0, 1):
        for m in ("lora", "lora_aqn", "nvfp4_lora", "qerl"):
            _write(res, m, seed, 0.4, 0.004, 0.3, 2.0, m in ("qerl", "lora_aqn"))
            f = res / f"train/m/{m}/grpo/d/seed{seed}/metrics.jsonl"
            f.write_text("".join(f.read_text().splitlines(True)[:3]))  # a 3-step run (the workflow's tiny default)
    assert _claims("--workflow-config", cfg, "--results", res, "--output", tmp_path / "rep") == 0


def test_T2_a_cut_or_foreign_evidence_file_names_itself(res, cfg, tmp_path, capsys):
    ev = tmp_path / "ev"
    assert _claims("--workflow-config", cfg, "--results", res, "--pack", ev) == 0
    data = (ev / "metrics.jsonl.gz").read_bytes()
    (ev / "metrics.jsonl.gz").write_bytes(data[: len(data) // 2])
    assert _claims("--evidence", ev, "--output", tmp_path / "rep") != 0
    msg = _err(capsys)
    assert "metrics.jsonl.gz: not a whole gzip file" in msg and "qerl-evidence-" not in msg
    (ev / "metrics.jsonl.gz").write_text("plain text")
    assert _claims("--evidence", ev, "--output", tmp_path / "rep") != 0
    assert "metrics.jsonl.gz: not a whole gzip file" in _err(capsys)


def test_S2_S3_metrics_are_read_by_step_and_duplicates_or_gaps_are_named(res, cfg, tmp_path, capsys):
    from qerl.stages.claims import build

    f = res / "train/m/lora/grpo/d/seed0/metrics.jsonl"
    lines = f.read_text().splitlines(True)
    got = build(CONFIG, res, tmp_path / "a")["claims"]
    f.write_text("".join(reversed(lines)))  # reversed rows: the same verdicts and numbers, never a flipped sign
    assert build(CONFIG, res, tmp_path / "b")["claims"] == got
    f.write_text("".join(lines + lines[-1:]))
    assert _claims("--workflow-config", cfg, "--results", res, "--output", tmp_path / "c") != 0
    assert "step 50 appears more than once" in _err(capsys)
    f.write_text("".join(lines[:10] + lines[11:]))
    assert _claims("--workflow-config", cfg, "--results", res, "--output", tmp_path / "c") != 0
    assert "step 11 is missing" in _err(capsys)


def test_S14_S15_unfinished_runs_and_cut_evaluations_are_never_counted(res, cfg, tmp_path, capsys):
    (res / "train/m/lora_aqn/grpo/d/seed1/summary.json").unlink()
    assert _claims("--workflow-config", cfg, "--results", res, "--output", tmp_path / "rep") == 0
    out = capsys.readouterr().out
    assert "left out (training unfinished): 1 run(s): m/lora_aqn/grpo/d/seed1" in out and "(7 runs)" in out
    assert "did not finish (no summary.json; left out): m/lora_aqn/grpo/d/seed1" in \
        (tmp_path / "rep" / "claims.md").read_text()
    ev = res / "eval/m/qerl/grpo/d/seed0/b.json"
    ev.write_text(json.dumps({**json.loads(ev.read_text()), "per_problem": [1.0] * 5}))
    assert _claims("--workflow-config", cfg, "--results", res, "--output", tmp_path / "rep") != 0
    assert "per_problem holds 5 scores for 300 problems" in _err(capsys)


def test_S4_S5_S18_evidence_is_checked_against_its_config_and_holds_no_nan(res, cfg, tmp_path, capsys):
    import yaml

    ev = tmp_path / "ev"
    assert _claims("--workflow-config", cfg, "--results", res, "--pack", ev) == 0
    other = tmp_path / "other.yaml"  # the same configuration name, another setting
    other.write_text(yaml.safe_dump({**CONFIG, "train": {"optim": {"lr": 2.0e-4}}}))
    assert _claims("--workflow-config", other, "--results", res, "--pack", ev) != 0
    msg = _err(capsys)
    assert "its runs were made with another config of 'unit'" in msg and "train.optim.lr" in msg
    rows = [json.loads(x) for x in gzip.open(ev / "metrics.jsonl.gz", "rt")]
    rows.append({**rows[0], "run": "m/qlora/grpo/d/seed0"})
    with gzip.open(ev / "metrics.jsonl.gz", "wt") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))
    assert _claims("--evidence", ev, "--output", tmp_path / "rep") != 0
    assert "holds run(s) its config.yaml does not name (m/qlora/grpo/d/seed0)" in _err(capsys)
    f = res / "train/m/lora/grpo/d/seed0/metrics.jsonl"
    lines = f.read_text().splitlines()
    lines[4] = json.dumps({**json.loads(lines[4]), "reward_mean": float("nan")})
    f.write_text("\n".join(lines) + "\n")
    assert _claims("--workflow-config", cfg, "--results", res, "--pack", tmp_path / "ev2") != 0
    assert "step 5 has reward_mean = nan" in _err(capsys) and not (tmp_path / "ev2" / "metrics.jsonl.gz").exists()


def test_S13_a_label_with_a_bar_or_a_line_break_keeps_the_tables_whole(res, tmp_path):
    from qerl.stages.claims import build

    config = {**CONFIG, "variants": {"lora_aqn": {**CONFIG["variants"]["lora_aqn"], "label": "AQN | on\nbf16"}}}
    build(config, res, tmp_path / "rep")
    for name in ("runs.md", "accuracy.md"):
        rows = [x for x in (tmp_path / "rep" / name).read_text().splitlines() if x.startswith("| ")]
        bars = {x.replace("\\|", "").count("|") for x in rows}
        assert len(bars) == 1, (name, bars)  # every row as wide as the header
        assert any("AQN \\| on bf16" in x for x in rows), name
