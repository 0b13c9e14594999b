"""``qerl bench host``: the report it writes (the timing itself needs a GPU)."""
from qerl.bench import host


def _row(call, M, us, path="mmv"):
    return {"model": "0.5B", "proj": "qkv", "N": 1152, "K": 896, "M": M, "call": call, "path": path, "host_us": us,
            "cublas_host_us": 14.0, "meets": us <= host.TARGET_US,
            "direct_launches": 100, "same_result": True}


def test_report_counts_rows_meeting_the_target_and_names_the_slowest(tmp_path):
    rows = [_row("fwd", 1, 31.5), _row("fwd_lora", 1, 52.0), _row("bwd", 64, 120.5, "tile_bwd")]
    md = host.write(rows, tmp_path, "NVIDIA H100 80GB HBM3", profile="fwd ...\n  ncalls tottime")
    text = md.read_text()
    assert md.name == "NVIDIA_H100_80GB_HBM3.md"
    assert "1 / 3 meet it" in text and "the slowest is bwd 0.5B qkv M = 64 (tile_bwd): 120.5 µs" in text
    assert "ncalls tottime" in text and "Direct launches (`qerl_kernels.launch`): on" in text
    assert "equal to Triton's own launches in 3 / 3 rows" in text
    csv_text = (tmp_path / "NVIDIA_H100_80GB_HBM3.csv").read_text().splitlines()
    assert csv_text[0].endswith(",device") and len(csv_text) == 4 and "NVIDIA H100 80GB HBM3" in csv_text[1]


def test_parser_knows_the_small_shapes():
    a = host.build_parser().parse_args(["--models", "0.5B", "1.5B", "--ms", "1", "64"])
    assert a.models == ["0.5B", "1.5B"] and a.ms == [1, 64]


def test_comparison_rows_carry_the_triton_path_time_of_the_same_call(tmp_path):
    on = [_row("fwd", 1, 60.0), _row("fwd_lora", 1, 90.0)]
    off = [{**_row("fwd", 1, 95.0), "M": "1"}, _row("fwd_lora", 1, 140.0)]
    rows = host.with_comparison(on, off)
    assert [r["triton_host_us"] for r in rows] == [95.0, 140.0]
    text = host.write(rows, tmp_path, "dev").read_text()
    assert "| 0.5B | qkv | 1152 | 896 | 1 | fwd | mmv | 60.0 | 95.0 | 14.0 |" in text


def _csv_rows(path_of_call, host, loop, config=None):
    return [{**_row(call, 512, host[call], path_of_call[call]), "loop_us": loop[call], "cublas_loop_us": 14.0,
             "config": (config or {}).get(call, "WGMMA=1")} for call in path_of_call]


def _probe_done(site):
    """A stand-in probe child's result: it imports ``qerl_kernels`` from ``site``."""
    from pathlib import Path

    return type("Done", (), {"returncode": 0, "stdout": str((Path(site) / "qerl_kernels").resolve()) + "\n"})


def _child_done(out, rows):
    """A stand-in ``qerl bench host`` child: ``rows`` written as its CSV in ``out``."""
    import csv

    out.mkdir(parents=True)
    with open(out / "dev.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return type("Done", (), {"returncode": 0})


def test_ab_alternates_the_baseline_and_current_kernels_and_reports_the_change(tmp_path, monkeypatch):
    """``--baseline-kernels``: the children alternate (baseline, current, current, baseline, …), the baseline ones with the
    copied package first on PYTHONPATH (checked by a probe before any run); per row the median over the rounds of
    each side, the route before and after; the .md counts rows at the target and gives the changed rows by call."""
    import csv
    import sys

    from qerl.bench import host_ab

    base = tmp_path / "old"
    (base / "kernels").mkdir(parents=True)
    (base / "kernels" / "ops.py").write_text("")
    calls = []
    # fwd: another route; seam: the same route, another config (one launch); bwd: unchanged
    before = {"fwd": ("dq", 52.0, 50.0), "bwd": ("dq", 48.0, 45.0), "seam": ("wgmma", 60.0, 58.0)}
    after = {"fwd": ("wgmma", 27.0, 28.0), "bwd": ("dq", 47.0, 44.0), "seam": ("wgmma", 30.0, 31.0)}

    def runner(cmd, env, capture_output=False, text=False):
        calls.append((cmd, env.get("PYTHONPATH", "")))
        if "-c" in cmd:  # the probe: what a baseline child imports
            return _probe_done(env["PYTHONPATH"].split(":")[0])
        out = Path(cmd[cmd.index("--output") + 1])
        side = before if out.name.startswith("baseline") else after
        rnd = int(out.name[-1])
        return _child_done(out, _csv_rows({c: v[0] for c, v in side.items()}, {c: v[1] + rnd for c, v in side.items()},
                                          {c: v[2] for c, v in side.items()},
                                          {"seam": "WGMMA=1 XS=0" if side is before else "WGMMA=1 XS=1"}))

    from pathlib import Path

    md = host_ab.run(["--models", "0.5B"], base, 3, tmp_path / "report", "NVIDIA H100 80GB HBM3", runner=runner,
                     current_args=["--lora-inkernel-flops", "1e9"])
    sides = [("baseline" if Path(c[c.index("--output") + 1]).name.startswith("baseline") else "current", pp)
             for c, pp in calls if "--output" in c]
    assert [s for s, _ in sides] == ["baseline", "current", "current", "baseline", "baseline", "current"]  # ABBA
    assert all(pp.split(":")[0].endswith("baseline_site") for s, pp in sides if s == "baseline")
    assert all("baseline_site" not in pp for s, pp in sides if s == "current")
    assert all(c[0] == sys.executable and "--no-compare" in c for c, _ in calls if "--output" in c)
    knobbed = ["--lora-inkernel-flops" in c for c, _ in calls if "--output" in c]  # the current side's only
    assert knobbed == [s == "current" for s, _ in sides]
    rows = list(csv.DictReader(open(tmp_path / "report" / "NVIDIA_H100_80GB_HBM3_ab.csv")))
    fwd = next(r for r in rows if r["call"] == "fwd")
    assert (fwd["path_before"], fwd["path_after"], fwd["host_before"], fwd["host_after"]) == ("dq", "wgmma", "53.0", "28.0")
    assert fwd["device"] == "NVIDIA H100 80GB HBM3" and (fwd["direct_before"], fwd["direct_after"]) == ("100", "100")
    text = md.read_text()
    # the changed row's ratio 28 / 53 divided by the unchanged row's 48 / 49
    assert "rows at ≤ 40 µs of host time: **0 → 2**" in text and "| fwd (1) | 53.0 → 28.0 | 50.0 → 28.0 | 14.0 | 0.54 |" in text
    assert "Rows whose route or config changed (2)" in text and "| seam (1) | 61.0 → 31.0 |" in text
    assert "Rows whose route and config did not change (1): host µs median 49.0 → 48.0 (×0.98" in text
    assert ("in the order run: baseline 1 48.0, current 1 47.0, current 2 48.0, baseline 2 49.0, baseline 3 50.0, "
            "current 3 49.0.") in text


def test_ab_refuses_a_directory_without_the_kernels(tmp_path):
    import pytest

    from qerl.bench import host_ab

    with pytest.raises(SystemExit, match="no ops.py there"):
        host_ab.baseline_package(tmp_path)
    with pytest.raises(SystemExit, match="--rounds must be at least 1"):
        host_ab.run([], tmp_path, 0, tmp_path, "dev")
    a = host.build_parser().parse_args(["--baseline-kernels", str(tmp_path), "--rounds", "3"])
    assert a.baseline_kernels == tmp_path and a.rounds == 3


def test_config_field_is_stable():
    assert host.config_str({"WGMMA": 1, "BT": 32, "XS": 1}) == "BT=32 WGMMA=1 XS=1"
    assert host.config_str(None) == "None"


def test_ab_against_a_copy_of_the_installed_kernels(tmp_path):
    """``--baseline-kernels self``: the baseline is a fresh copy of the installed ``qerl_kernels`` (a null A/B, or a
    knob's with the current side's extra arguments); the baseline children import that copy."""
    from pathlib import Path

    from qerl.bench import host_ab

    seen = []

    def runner(cmd, env, capture_output=False, text=False):
        site = Path(env.get("PYTHONPATH", "").split(":")[0])
        if "-c" in cmd:
            return _probe_done(site)
        out = Path(cmd[cmd.index("--output") + 1])
        if out.name.startswith("baseline"):
            copy = (site / "qerl_kernels").resolve()
            seen.append((copy / "ops.py").is_file() and "self_copy" in str(copy))
        return _child_done(out, _csv_rows({"fwd": "mmv"}, {"fwd": 30.0}, {"fwd": 31.0}))

    md = host_ab.run([], Path(host_ab.SELF), 1, tmp_path, "dev", runner=runner)
    assert seen == [True]
    assert "host µs median 30.0 → 30.0 (×1.00" in md.read_text()


def test_knobs_go_to_the_current_side_of_an_ab(monkeypatch, tmp_path):
    """``qerl bench host --baseline-kernels DIR --lora-inkernel-flops F --lora-inkernel-decode-weights W``: both
    knobs are set in this process and handed to the current side's child runs only (``host_ab.run``'s
    ``current_args``)."""
    import torch

    from qerl.bench import host, host_ab
    from qerl_kernels import ops

    seen = {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(host_ab, "run", lambda args, base, rounds, out, device, current_args: seen.update(
        args=args, current=current_args) or "report.md")
    monkeypatch.setattr(ops, "LORA_INKERNEL_FLOPS", ops.LORA_INKERNEL_FLOPS)
    monkeypatch.setattr(ops, "LORA_INKERNEL_DECODE_WEIGHTS", ops.LORA_INKERNEL_DECODE_WEIGHTS)
    assert host.main(["--baseline-kernels", str(tmp_path), "--models", "0.5B", "--lora-inkernel-flops", "2e9",
                      "--lora-inkernel-decode-weights", "2.4e7"]) == 0
    assert seen["current"] == ["--lora-inkernel-flops", "2000000000.0", "--lora-inkernel-decode-weights", "24000000.0"]
    assert seen["args"][:2] == ["--models", "0.5B"]
    assert (ops.LORA_INKERNEL_FLOPS, ops.LORA_INKERNEL_DECODE_WEIGHTS) == (2e9, 2.4e7)
