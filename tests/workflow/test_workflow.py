"""The Snakemake workflow: lint, dry run, and a real end-to-end run of the embedded default."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def snakemake(*args, cwd=ROOT, check=True):
    env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}"}
    out = subprocess.run([str(BIN / "snakemake"), "--snakefile", str(ROOT / "Snakefile"), *args],
                         cwd=cwd, env=env, capture_output=True, text=True)
    if check and out.returncode != 0:
        raise AssertionError(f"snakemake {args} failed:\n{out.stdout}\n{out.stderr}")
    return out


def test_lint_is_clean():
    out = snakemake("--lint")
    assert "Congratulations" in out.stdout + out.stderr


def test_default_workflow_end_to_end(tmp_path):
    dry = snakemake("--cores", "2", "--directory", str(tmp_path), "-n")
    assert "build_tiny_model" in dry.stdout and "quantize" in dry.stdout
    snakemake("--cores", "2", "--directory", str(tmp_path))
    for model, arch in (("tiny-qwen2", "qwen2"), ("tiny-llama", "llama")):
        cfg = json.loads((tmp_path / "results/quantize" / model / "config.json").read_text())
        assert cfg["model_type"] == arch
        assert cfg["quantization_config"]["format"] == "nvfp4-pack-quantized"
        report = json.loads((tmp_path / "results/quantize" / model / "quantization_report.json").read_text())
        assert report["summary"]["quantized_linears"] == 14
        assert (tmp_path / "logs/quantize" / f"{model}.log").exists()
    # a rerun has nothing to do
    again = snakemake("--cores", "2", "--directory", str(tmp_path), "-n")
    assert "Nothing to be done" in again.stdout + again.stderr


def test_bad_config_is_rejected_before_any_job(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("models:\n  m1:\n    source: tiny\n    arch: gpt2\n")
    out = snakemake("--cores", "1", "--directory", str(tmp_path), "--configfile", str(bad), "-n", check=False)
    assert out.returncode != 0
    assert "gpt2" in out.stdout + out.stderr
    assert not (tmp_path / "results").exists()
