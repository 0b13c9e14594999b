"""``qerl bench logprobs``: the report it writes and its options (the timing itself needs a GPU)."""
import pytest

from qerl.bench import logprobs


def _row(path, f, b, tokens=14080, hidden=896):
    return {"tokens": tokens, "vocab": 151936, "hidden": hidden, "path": path, "forward_ms": f, "backward_ms": b,
            "peak_gb": 1.3, "max_lp_diff": 1.9e-6, "max_entropy_diff": 7.6e-6, "grad_rel_diff": 2.7e-5}


def test_report_pairs_the_paths_into_speed_ups(tmp_path):
    rows = [_row("fused", 10.5, 18.1), _row("composite", 42.0, 62.1), _row("fused", 1.0, 2.0, 1024)]
    md = logprobs.write(rows, tmp_path, "NVIDIA H100 80GB HBM3")
    text = md.read_text()
    assert md.name == "NVIDIA_H100_80GB_HBM3.md"
    assert "| 14080 | 896 | 4.00x | 3.43x |" in text  # composite / fused
    assert "| 1024 | 896 |" not in text  # a size measured on one path only has no speed-up row
    assert "| 14080 | 151936 | 896 | fused | 10.5 | 18.1 | 1.3 | 1.9e-06 | 7.6e-06 | 2.7e-05 |" in text
    lines = (tmp_path / "NVIDIA_H100_80GB_HBM3.csv").read_text().splitlines()
    assert lines[0].endswith(",device") and len(lines) == 4


def test_parser_defaults_and_cpu_refusal(monkeypatch):
    a = logprobs.build_parser().parse_args(["--tokens", "2048", "--hidden", "896"])
    assert a.tokens == [2048] and a.hidden == [896] and a.vocab == 151936 and a.output == "reports/logprobs"
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        logprobs.main(["--tokens", "64"])
