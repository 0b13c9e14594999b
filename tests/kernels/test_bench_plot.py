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
