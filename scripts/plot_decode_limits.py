"""Draw what limits the decode kernel (H200, v6) from the committed measurements — no GPU needed.

Left: share of copy bandwidth at M = 1 on three projections: the packed weights streamed alone with the
decode kernel's access pattern (``access_pattern_*.json``, best variant and the kernel's own 64 x 64 B
pattern), the decode kernel (benchmark CSV) and cuBLAS bf16 on the bf16 weights. Right: Nsight Compute
on the decode kernel (7B gate/up) for 8 / 16 / 32 activation rows: L1 busy and instructions issued
per cycle (``ncu_decode_stalls_*.txt``).

``python scripts/plot_decode_limits.py reports/kernels NVIDIA_H200``
"""
import csv
import json
import re
import sys
from pathlib import Path

SHAPES = {(55296, 5120): "32B gate/up", (5120, 27648): "32B down", (4608, 3584): "7B q/k/v"}


def _ncu(path: Path) -> dict:
    """{M: {metric: value}} from the ncu_decode_stalls text."""
    out, m = {}, None
    for line in path.read_text().splitlines():
        hit = re.match(r"=== M=(\d+)", line)
        if hit:
            m = int(hit.group(1))
            out[m] = {}
        elif m is not None and " " in line:
            name, value = line.rsplit(" ", 1)
            out[m][name] = float(value.replace(",", ""))
    return out


def main(folder: str, device: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    root = Path(folder)
    access = json.loads((root / f"access_pattern_{device}.json").read_text())
    bench = list(csv.DictReader(open(root / f"{device}.csv")))
    ncu = _ncu(root / f"ncu_decode_stalls_{device}.txt")
    labels, series = [], {"stream only, best": [], "stream only, 64 x 64 B": [], "decode kernel": [],
                          "cuBLAS bf16": []}
    for (n, k), name in SHAPES.items():
        rows = [r for r in access["rows"] if (r["N"], r["K"]) == (n, k)]
        row = next(r for r in bench if (int(r["N"]), int(r["K"]), int(r["M"]), r["kind"]) == (n, k, 1, "fwd"))
        copy = float(row["copy_GBps"])
        labels.append(name)
        series["stream only, best"].append(max(r["pct_copy"] for r in rows))
        series["stream only, 64 x 64 B"].append(max(r["pct_copy"] for r in rows if r["variant"].startswith("bn64_bk64")))
        series["decode kernel"].append(100 * float(row["GBps"]) / copy)
        series["cuBLAS bf16"].append(100 * float(row["cublas_GBps"]) / copy)
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.2))
    width = 0.2
    for i, (name, vals) in enumerate(series.items()):
        ax.bar([j + (i - 1.5) * width for j in range(len(labels))], vals, width, label=name)
    ax.axhline(80, color="k", ls=":", lw=1)
    ax.set_xticks(range(len(labels)), labels)
    ax.set_ylabel("% of copy bandwidth (M = 1)")
    ax.set_title("the weights can stream at ~90%; the kernel does not")
    ax.legend(fontsize=8, loc="upper right")
    ms = sorted(ncu)
    l1 = [ncu[m]["l1tex__throughput.avg.pct_of_peak_sustained_active"] for m in ms]
    issue = [ncu[m]["smsp__issue_active.avg.pct_of_peak_sustained_active"] for m in ms]
    dram = [ncu[m]["dram__throughput.avg.pct_of_peak_sustained_elapsed"] for m in ms]
    for vals, name in ((l1, "L1/TEX busy %"), (issue, "issue slots used %"), (dram, "DRAM throughput %")):
        bx.plot(ms, vals, marker="o", label=name)
    bx.set_xticks(ms, [f"M = {m}" for m in ms])
    bx.set_ylim(0, 100)
    bx.set_title("decode kernel, 7B gate/up (Nsight Compute)")
    bx.legend(fontsize=8)
    fig.suptitle(f"What limits NVFP4 decode — {device.replace('_', ' ')}")
    fig.tight_layout()
    out = root / f"decode_limits_{device}.png"
    fig.savefig(out, dpi=110)
    return out


if __name__ == "__main__":
    print(main(*(sys.argv[1:3] if len(sys.argv) > 2 else ("reports/kernels", "NVIDIA_H200"))))
