"""Shared fixtures: tiny models built offline once per session, and their NVFP4 checkpoints."""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    """``{"qwen2": dir, "llama": dir}`` of seeded tiny bf16 models."""
    from qerl.models.tiny import TinySpec, save_tiny_model

    root = tmp_path_factory.mktemp("tiny")
    return {arch: save_tiny_model(root / arch, TinySpec(arch=arch, seed=1)) for arch in ("qwen2", "llama")}


@pytest.fixture(scope="session")
def quantized_dirs(tiny_dirs, tmp_path_factory):
    """``{"qwen2": dir, "llama": dir}`` of NVFP4 checkpoints written by ``quantize_checkpoint``."""
    from qerl.stages.quantize import quantize_checkpoint

    root = tmp_path_factory.mktemp("nvfp4")
    out = {}
    for arch, src in tiny_dirs.items():
        quantize_checkpoint(src, root / arch, progress=False)
        out[arch] = root / arch
    return out


@pytest.fixture(scope="session")
def warm_model(tmp_path_factory):
    """A tiny Qwen2 model warm-started (SFT) on the synthetic arithmetic task: reward ~0.25."""
    from qerl.data.tasks import synthetic_arithmetic
    from qerl.models.tiny import TinySpec, save_tiny_model
    from qerl.train.sft import sft

    root = tmp_path_factory.mktemp("warm")
    base = save_tiny_model(root / "base", TinySpec(seed=0))
    sft(base, root / "sft", synthetic_arithmetic(2000, seed=0), steps=80, progress=False)
    return root / "sft"
