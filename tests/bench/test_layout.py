"""``qerl bench layout``: the report it writes, its check of bit-equality, its options (the timing needs a GPU)."""
import pytest

from qerl.bench import layout


def _row(M, rows_us, tiled_us, same=True, equal=True, cublas_us=74.0):
    return {"model": "7B", "proj": "gate_up", "N": 37888, "K": 3584, "M": M, "path_rows": "wgmma",
            "path_tiled": "wgmma", "same_config": same, "rows_us": rows_us, "tiled_us": tiled_us,
            "cublas_us": cublas_us, "speedup": round(rows_us / tiled_us, 3),
            "rows_x_cublas": round(cublas_us / rows_us, 3), "tiled_x_cublas": round(cublas_us / tiled_us, 3),
            "equal": equal, "rel_diff": 0.0 if equal else 1.2e-3, "config_tiled": "{}"}


def test_report_rows_and_csv(tmp_path):
    rows = [_row(8, 44.0, 37.0), _row(64, 60.0, 58.0, same=False, equal=False)]
    md = layout.write(rows, tmp_path, "NVIDIA H100 80GB HBM3")
    text = md.read_text()
    assert md.name == "NVIDIA_H100_80GB_HBM3.md"
    assert ("| 7B | gate_up | 37888 | 3584 | 8 | wgmma / wgmma | yes | 44.0 | 37.0 | 74.0 | 1.19x | 1.68x | 2.00x | yes "
            "| 0.0e+00 |") in text
    assert "| 64 | wgmma / wgmma | no | 60.0 | 58.0 | 74.0 | 1.03x | 1.23x | 1.28x | no | 1.2e-03 |" in text  # may differ
    # the per-M medians against issue 66's goals: none at M = 8, 1.6x at M = 64 (1.28x: not met)
    assert "| 8 | 1 | 1.68x | 2.00x | 1.19x |  |  |" in text and "| 64 | 1 | 1.23x | 1.28x | 1.03x | ≥ 1.6x | no |" in text
    lines = (tmp_path / "NVIDIA_H100_80GB_HBM3.csv").read_text().splitlines()
    assert lines[0].endswith(",device") and len(lines) == 3


def test_a_call_that_kept_its_config_must_be_bit_equal(tmp_path):
    with pytest.raises(AssertionError, match="1 call\\(s\\) kept their config but differ: 7B gate_up M=8"):
        layout.write([_row(8, 44.0, 37.0, equal=False)], tmp_path, "NVIDIA H200")
    assert (tmp_path / "NVIDIA_H200.md").exists()  # the report is written before the check fails


def test_parser_defaults_and_cpu_refusal(monkeypatch):
    a = layout.build_parser().parse_args(["--models", "7B", "--ms", "8"])
    assert a.models == ["7B"] and a.ms == [8] and a.projs == ["qkv", "o", "gate_up", "down"]
    assert layout.build_parser().parse_args([]).ms == [1, 8, 16, 64, 128, 256]  # the goals' M (64, 128) included
    assert a.output == "reports/layout" and a.reps == 11
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        layout.main(["--ms", "8"])


def test_medians_per_m_against_the_goals():
    rows = [_row(64, 40.0, 36.0, cublas_us=60.0), _row(64, 50.0, 40.0, cublas_us=60.0), _row(64, 30.0, 30.0, cublas_us=60.0),
            _row(128, 50.0, 40.0, cublas_us=52.0)]
    m = {r["M"]: r for r in layout.medians(rows)}
    assert m[64] == {"M": 64, "rows": 3, "rows_x_cublas": 1.5, "tiled_x_cublas": 1.67, "tiled_x_rows": 1.11,
                     "goal": 1.6, "met": True}
    assert m[128]["tiled_x_cublas"] == 1.3 and m[128]["goal"] == 1.25 and m[128]["met"] is True


def test_bench_shape_runs_both_layouts_under_interpreter():
    """The measurement loop on the CPU (interpreter, a stand-in timer that runs every closure once): each M gives a
    row with both paths through the public op and cuBLAS; the interpreter routes both layouts to the same tile
    config, so the tiled call's output is bit-equal."""
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", """
import json, torch
from qerl.bench import layout
calls = []
def timer(named, reps):
    for fs in named.values():
        for f in fs:
            f()
    calls.append(sorted(named))
    return {"rows": 2e-5, "tiled": 1e-5, "cublas": 3e-5}
rows = layout.bench_shape("tiny", "gate_up", 128, 256, [1, 8], reps=1, device="cpu", timer=timer)
print(json.dumps({"rows": rows, "calls": calls}))
"""], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert [row["M"] for row in r["rows"]] == [1, 8] and r["calls"] == [["cublas", "rows", "tiled"]] * 2
    for row in r["rows"]:
        assert row["path_tiled"] == row["path_rows"] == "tile_fwd" and row["same_config"]
        assert row["equal"] and row["rel_diff"] == 0.0 and row["speedup"] == 2.0
        assert row["rows_x_cublas"] == 1.5 and row["tiled_x_cublas"] == 3.0
