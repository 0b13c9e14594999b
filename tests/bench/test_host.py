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
