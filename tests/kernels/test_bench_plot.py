"""The benchmark figure (`qerl bench kernels --plot CSV`) from a CSV, on CPU."""
import csv
import json

import pytest

from qerl.stages import bench_kernels
from qerl.stages.bench_plot import plot


def _csv(path, rows):
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def test_plot_from_csv(tmp_path, capsys):
    rows = [dict(device="Test GPU", copy_GBps=4000.0, model=m, proj=p, N=64, K=128, M=M, kind=k, us=1.0,
                 cublas_us=1.5, speedup=1.5 / (1 + M / 64), GBps=1000.0 / (1 + M), cublas_GBps=1.0, TFLOPs=1.0,
                 lora32_overhead="")
            for m in ("7B", "32B") for p in ("qkv", "o") for M in (1, 16, 64, 2048) for k in ("fwd", "bwd")]
    path = tmp_path / "Test_GPU.csv"
    _csv(path, rows)
    assert bench_kernels.main(["--plot", str(path)]) == 0
    png = tmp_path / "Test_GPU.png"
    assert json.loads(capsys.readouterr().out)["png"] == str(png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert not list(tmp_path.glob("*.tmp.png"))


def test_plot_rejects_other_csv(tmp_path):
    path = tmp_path / "x.csv"
    _csv(path, [{"a": 1, "b": 2}])
    with pytest.raises(ValueError, match="not a `qerl bench kernels` CSV"):
        plot(path)


def test_decode_limits_figure_from_the_committed_measurements(tmp_path):
    """scripts/plot_decode_limits.py redraws the v6 evidence figure from the committed H200 files."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    src = root / "reports" / "kernels"
    for name in ("access_pattern_NVIDIA_H200.json", "NVIDIA_H200.csv", "ncu_decode_stalls_NVIDIA_H200.txt"):
        shutil.copy(src / name, tmp_path / name)
    out = subprocess.run([sys.executable, str(root / "scripts" / "plot_decode_limits.py"), str(tmp_path), "NVIDIA_H200"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    png = tmp_path / "decode_limits_NVIDIA_H200.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
