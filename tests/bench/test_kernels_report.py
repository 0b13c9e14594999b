"""The benchmark figure (`qerl bench kernels --plot CSV`) from a CSV, on CPU."""
import csv
import json
from pathlib import Path

import pytest

from qerl.bench import kernels as bench_kernels
from qerl.bench.kernels_plot import plot

ROOT = Path(__file__).resolve().parents[2]


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
    assert not list(tmp_path.glob("*.tmp-*"))  # qerl.figures.save_figure: no temporary left


def test_plot_rejects_other_csv(tmp_path):
    path = tmp_path / "x.csv"
    _csv(path, [{"a": 1, "b": 2}])
    with pytest.raises(ValueError, match="not a `qerl bench kernels` CSV"):
        plot(path)


def test_lora_trace_summary_reads_the_stamps():
    """tools/lora_trace.py's summary of the %globaltimer stamps (GPU-only script; its arithmetic here):
    producer / tile split by program id, times relative to the first start, tiles that finished their
    main loop before the ready flag; the PDL primary's stamps on the same clock."""
    import torch

    import importlib.util

    spec = importlib.util.spec_from_file_location("lora_trace", ROOT / "tools" / "lora_trace.py")  # (not installed)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)

    # grid (3, 2, 1), XP = 1: program 0 produces, program 3 (pid 0 of row 1) idles, 1, 2, 4, 5 are tiles
    st = torch.zeros(6, 8, dtype=torch.int64)
    st[0, :5] = torch.tensor([1000, 5, 2000, 3000, 4000])
    st[3, :2] = torch.tensor([1200, 9])
    for i, (t_start, loop, done) in zip((1, 2, 4, 5), ((1000, 3500, 5000), (1100, 4500, 6000),
                                                        (1050, 3900, 4200), (1300, 5500, 5600))):
        st[i, 0], st[i, 1], st[i, 2], st[i, 4] = t_start, 6, loop, done
    s = mod._summary(st, None, 1, (3, 2, 1))
    assert s["programs"] == 6 and s["sms"] == 3 and s["span_us"] == 5.0
    assert s["flag_us"] == 3.0 and s["producer_mma_last_us"] == 1.0 and s["tiles_done_before_flag"] == 2
    assert s["tile_start_last_us"] == 0.3 and s["tile_loop_end_median_us"] == 3.2
    pdl = torch.zeros(2, 8, dtype=torch.int64)
    pdl[0, :4] = torch.tensor([500, 1, 1500, 2500])
    pdl[1, :5] = torch.tensor([600, 2, 1600, 2700, 3600])
    s = mod._summary(st, pdl, 1, (3, 2, 1))
    assert s["span_us"] == 5.5 and s["xa_done_us"] == 3.1 and s["tiles_done_before_xa"] == 1


def test_targets_recomputed_from_the_committed_runs(tmp_path, capsys):
    """`qerl bench kernels --targets CSV [--against OLD]` (no GPU) recomputes the numbers that
    reports/kernels/README.md quotes for the committed runs: the M >= 2048 counts (H200 47/48, H100 40/48), no
    decode row and one H100 M = 64 row at the target, LoRA <= 10% at 6/60 (H200) and 3/60 (H100); against an older run whose kernels were
    10% slower at M = 2 (LoRA overhead unchanged) the M = 2 median speed-up drops by 1/1.1 and the base + LoRA
    time ratio is 1/1.1; a CSV that is not a benchmark is refused by name."""
    from pathlib import Path

    from qerl.bench import kernels_targets as bt

    kdir = Path(__file__).resolve().parents[2] / "reports" / "kernels"
    h200, copy_h200, dev = bt.read_csv(kdir / "NVIDIA_H200.csv")
    h100, copy_h100, _ = bt.read_csv(kdir / "NVIDIA_H100_80GB_HBM3.csv")
    t200, t100 = bt.targets(h200, copy_h200), bt.targets(h100, copy_h100)
    assert dev == "NVIDIA H200" and len(h200) == len(h100) == 288
    assert (t200["large_met"], t100["large_met"]) == (47, 41) and t200["large_speedup"]["n"] == 48
    assert all(0.79 <= m[-1] < 0.85 for m in t100["large_missed"] + t200["large_missed"])
    assert t200["decode_met"] == t100["decode_met"] == 0 and (t200["m64_met"], t100["m64_met"]) == (0, 1)
    assert (t200["lora_decode_met"], t100["lora_decode_met"]) == (9, 3) and t200["lora_decode"]["n"] == 60
    assert round(t100["decode_speedup"]["median"], 2) == 2.05 and round(t100["m64_speedup"]["median"], 2) == 1.60
    old = tmp_path / "old.csv"
    with open(kdir / "NVIDIA_H200.csv") as f:
        rows = list(csv.DictReader(f))
    for r in rows:
        if r["M"] == "2":
            r["us"], r["speedup"] = str(float(r["us"]) * 1.1), str(float(r["speedup"]) / 1.1)
    _csv(old, rows)
    cmp = bt.compare(h200, bt.read_csv(old)[0])
    new2 = cmp[2]["new_median"]
    assert cmp[2]["old_median"] == pytest.approx(new2 / 1.1) and cmp[2]["base_plus_lora_ratio"] == pytest.approx(1 / 1.1)
    assert cmp[1]["old_median"] == cmp[1]["new_median"] and cmp[1]["base_plus_lora_ratio"] == pytest.approx(1.0)
    assert bench_kernels.main(["--targets", str(kdir / "NVIDIA_H200.csv"), "--against", str(old)]) == 0
    out = capsys.readouterr().out
    assert "| M ≥ 2048 fwd + bwd | ≥ 0.85x |" in out and "47/48" in out
    assert f"{new2 / 1.1:.2f}x → {new2:.2f}x | -9% |" in out
    bad = tmp_path / "x.csv"
    bad.write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="x.csv: not a `qerl bench kernels` CSV"):
        bt.read_csv(bad)


def test_gemlite_peer_columns_in_markdown(tmp_path):
    """`qerl bench kernels` with gemlite importable: its µs / speed-up / error columns in the Markdown, an
    eager-timed row marked, backward rows left blank; without it the table has no such columns."""
    base = dict(model="7B", proj="o", N=64, K=128, M=8, us=2.0, cublas_us=3.0, speedup=1.5, reference_us=9.0,
                vs_reference=4.5, GBps=100.0, cublas_GBps=90.0, TFLOPs=0.1, lora32_overhead=None)
    rows = [{**base, "kind": "fwd", "gemlite_us": 2.5, "gemlite_speedup": 1.2, "gemlite_rel_err": 3e-3,
             "gemlite_timing": "eager"},
            {**base, "kind": "bwd", "gemlite_us": None, "gemlite_speedup": None, "gemlite_rel_err": None,
             "gemlite_timing": None}]
    _, md = bench_kernels.write_reports(rows, 3000.0, "Test GPU", tmp_path, peer="gemlite 0.6.0")
    lines = md.read_text().splitlines()
    head = next(x for x in lines if x.startswith("| model"))
    assert head.endswith("gemlite µs | gemlite speed-up | gemlite rel. err |")
    fwd = next(x for x in lines if "| fwd |" in x)
    bwd = next(x for x in lines if "| bwd |" in x)
    assert fwd.endswith("| 2.5* | 1.20x | 3.0e-03 |") and bwd.endswith("| | |")
    assert all(x.count("|") == head.count("|") for x in lines if x.startswith("| 7B"))
    assert "gemlite 0.6.0" in md.read_text()
    bad = {**rows[0], "gemlite_us": None, "gemlite_speedup": None, "gemlite_rel_err": None, "gemlite_timing": None,
           "gemlite_error": "RuntimeError: PassManager::run failed"}
    _, md = bench_kernels.write_reports([bad, rows[1]], 3000.0, "Test GPU", tmp_path, peer="gemlite 0.6.0")
    text = md.read_text()
    assert "gemlite failed on 1 of 1 forward rows: `RuntimeError: PassManager::run failed`" in text
    assert next(x for x in text.splitlines() if "| fwd |" in x).endswith("| failed | | |")
    _, md = bench_kernels.write_reports([{**base, "kind": "fwd"}], 3000.0, "Test GPU", tmp_path)
    assert "gemlite" not in md.read_text()


def test_gemlite_peer_checks_shapes_before_importing():
    import torch

    from qerl.bench import gemlite_peer

    with pytest.raises(ValueError, match="packed must be a 2-D uint8"):
        gemlite_peer.linear(torch.zeros(4, 8), torch.zeros(4, 1), torch.ones(()))
    with pytest.raises(ValueError, match=r"scales must be \[4, 1\]"):
        gemlite_peer.linear(torch.zeros(4, 8, dtype=torch.uint8), torch.zeros(4, 2), torch.ones(()))
    y = torch.ones(3, 4)
    assert gemlite_peer.relative_error(y, y) == 0.0
    assert abs(gemlite_peer.relative_error(1.01 * y, y) - 0.01) < 1e-6
