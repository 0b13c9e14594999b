"""Building a method's policy (the registry itself is :mod:`qerl.methods`: base format, LoRA?, AQN?)."""
from __future__ import annotations

import torch

from qerl.methods import METHODS, Method  # noqa: F401  (re-exported for the trainer)


DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def resolve_device(device: str) -> torch.device:
    """``auto`` (CUDA when there is a GPU, else CPU), ``cpu``, ``cuda`` or ``cuda:N``; a device this machine lacks
    is a :class:`ValueError` naming it."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device: {device!r} is not a device (expected auto, cpu, cuda or cuda:N)") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device: {device!r}, but this machine has no usable CUDA GPU (torch "
                             f"{torch.__version__}{'' if torch.version.cuda else ', a CPU-only build'}); use "
                             "device: cpu or auto")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device: {device!r}, but this machine has {torch.cuda.device_count()} GPU(s)")
    elif dev.type != "cpu":
        raise ValueError(f"device: {device!r} is not supported (expected auto, cpu, cuda or cuda:N)")
    return dev


def build_policy(cfg, device: torch.device, world: int = 1, src=None, tokenizer=None):
    """Load the base in the method's format and wrap it for training. Returns ``(model, tokenizer)``. ``src`` /
    ``tokenizer``: the model directory and its tokenizer where the caller has them already."""
    from qerl.lora import apply_lora
    from qerl.models import load_policy
    from qerl.models.source import resolve_model_dir

    method = METHODS[cfg.method]
    src = src or resolve_model_dir(cfg.model.path, cfg.model.revision)
    model = load_policy(src, base=method.base, device=device, dtype=DTYPES[cfg.model.dtype])
    tokenizer = tokenizer or load_tokenizer(src)
    if method.lora:
        model = apply_lora(model, cfg.lora)
    else:
        model.requires_grad_(True)
    if checkpointing_on(cfg, model.config, method, device, world):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if hasattr(model, "enable_input_require_grads"):
            model.enable_input_require_grads()
    return model, tokenizer


def load_tokenizer(src):
    """The tokenizer of a model directory, with a pad token (its EOS when it has none)."""
    from transformers import AutoTokenizer

    from pathlib import Path

    from qerl.models.check import check_tokenizer

    if Path(src).is_dir():
        check_tokenizer(Path(src))  # (named as it is, not as transformers' error)
    try:
        tokenizer = AutoTokenizer.from_pretrained(src)
    except (OSError, ValueError) as e:
        from qerl.checkpoint import CheckpointError

        raise CheckpointError(f"{src}: cannot load its tokenizer ({type(e).__name__}: {str(e).splitlines()[0]})") \
            from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def checkpointing_on(cfg, hf_config, method: Method, device: torch.device, world: int = 1) -> bool:
    """``gradient_checkpointing`` resolved: ``auto`` asks the memory planner (:mod:`qerl.train.plan`): on from
    14B shapes, or when the update would not fit the device without it (per process: ``world`` share a step);
    off on the CPU."""
    from qerl.train.config import resolve_sharding
    from qerl.train.plan import PROMPT_TOKENS, resolve_checkpointing, update_tokens

    if cfg.gradient_checkpointing == "auto" and device.type != "cuda":
        return False
    rows = cfg.prompts_per_step * cfg.algorithm.group_size // max(1, world)
    full = ({"dense": bool(cfg.dense_update)} if method.lora else
            {"full": True, "world": world, "sharding": resolve_sharding(cfg, world)})
    full["update_tokens"] = update_tokens(cfg)
    return resolve_checkpointing(cfg.gradient_checkpointing, hf_config, method.base, rows,
                                 PROMPT_TOKENS + cfg.rollout.max_new_tokens, cfg.micro_batch_size, **full)
