"""The committed cost report is what its code writes: `qerl bench cost` (no GPU) regenerated here equals
reports/reproduce/cost_* byte for byte, and a run with another --gpu-gb says so in its title and file name."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _cost(tmp_path, *args):
    r = subprocess.run([sys.executable, "-m", "qerl", "bench", "cost", "--output", str(tmp_path), *args],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    return r


def test_committed_cost_report_equals_a_regeneration(tmp_path):
    _cost(tmp_path)
    for name in ("cost_NVIDIA_H100_80GB_HBM3.csv", "cost_NVIDIA_H100_80GB_HBM3.md"):
        assert (tmp_path / name).read_text() == (ROOT / "reports/reproduce" / name).read_text(), \
            f"reports/reproduce/{name} is stale: rerun `qerl bench cost` and update the prose that quotes it"
    table2 = next(line for line in (tmp_path / "cost_NVIDIA_H100_80GB_HBM3.md").read_text().splitlines()
                  if line.startswith("| table2 |"))
    cells = [c.strip() for c in table2.strip("|").split("|")]
    readme = (ROOT / "reports/reproduce/README.md").read_text()
    assert f"| {cells[2]} | {cells[4]} | **{cells[5]}** | **{cells[7]}** |" in readme  # the prose quotes the file


def test_another_gpu_memory_is_named_in_the_report(tmp_path):
    _cost(tmp_path, "--gpu-gb", "10")
    (md,) = tmp_path.glob("*.md")
    assert md.name == "cost_NVIDIA_H100_80GB_HBM3_rates_10_GB_per_GPU.md"
    assert "NVIDIA H100 80GB HBM3 rates, 10 GB per GPU" in md.read_text().splitlines()[0]
