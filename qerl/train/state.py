"""Training checkpoints: written atomically, restored exactly.

``<output>/checkpoint/`` holds ``adapter/`` (PEFT format) and ``trainable.safetensors`` (the trained weights) —
or, under FSDP2, ``dcp/`` (every rank's shards of weights and optimizer states) —, ``trainer_state.pt``
(optimizer, scheduler, torch/python/numpy RNG states) and ``trainer_state.json`` (step, data position, MLflow
run id). The directory is replaced in one
rename, so a kill at any moment leaves the previous checkpoint intact.
"""
from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from qerl.files import commit
from qerl.checkpoint import CheckpointError, atomic_directory, write_json

CHECKPOINT = "checkpoint"


@dataclass
class TrainState:
    step: int = 0  # optimizer steps completed
    data_pos: int = 0  # prompts consumed from the data stream
    run_id: str | None = None
    world_size: int = 1  # processes of the run that wrote it (a resume must use as many)
    skipped_updates: int = 0  # updates dropped for a non-finite gradient norm so far (optim.skip_nonfinite)


def _trainable_state(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().cpu().contiguous() for n, p in model.named_parameters() if p.requires_grad}


def save_checkpoint(out_dir: Path, model, optimizer, scheduler, state: TrainState, is_peft: bool,
                    sharded: Path | None = None) -> Path:
    """Write ``<out_dir>/checkpoint`` atomically. ``sharded``: a directory the ranks of an FSDP2 run have just
    written their weight and optimizer shards into (:func:`qerl.train.fsdp.save_sharded`); it becomes the
    checkpoint's ``dcp/`` (marked ``fsdp``) in place of ``trainable.safetensors`` and the optimizer state."""
    path = Path(out_dir) / CHECKPOINT
    with atomic_directory(path, force=True) as tmp:
        if is_peft:
            model.save_pretrained(str(tmp / "adapter"))
        if sharded is not None:
            commit(sharded, tmp / "dcp")  # (a directory the ranks wrote, moved into the staged checkpoint)
        else:
            save_file(_trainable_state(model), str(tmp / "trainable.safetensors"))
        torch.save({
            "optimizer": None if sharded is not None else optimizer.state_dict(),
            "optimizer_format": "fsdp" if sharded is not None else "index",
            "scheduler": scheduler.state_dict(),
            "torch_rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
            "python_rng": random.getstate(),
            "numpy_rng": np.random.get_state(),
        }, tmp / "trainer_state.pt")
        write_json(tmp / "trainer_state.json", asdict(state))  # last, and whole: its presence marks a complete checkpoint
    return path


def load_checkpoint(out_dir: Path, model, optimizer, scheduler, sharded: bool = False) -> TrainState:
    """Restore trainable weights, optimizer, scheduler and RNG states; return the saved state. ``sharded``: the
    model is FSDP2-sharded (each rank reads its own shards back from ``dcp/``)."""
    path = Path(out_dir) / CHECKPOINT
    if not (path / "trainer_state.json").exists():
        raise CheckpointError(f"{path}: no checkpoint to resume from")
    try:
        blob = torch.load(path / "trainer_state.pt", weights_only=False)
    except FileNotFoundError:
        raise CheckpointError(f"{path / 'trainer_state.pt'}: missing from the checkpoint") from None
    except Exception as e:  # (a truncated or foreign file: pickle / zip errors of many kinds)
        raise CheckpointError(f"{path / 'trainer_state.pt'}: unreadable ({type(e).__name__}: {e}); the checkpoint "
                              "is damaged") from None
    fmt = blob.get("optimizer_format", "index")
    if fmt != ("fsdp" if sharded else "index"):
        raise ValueError(f"{path}: written with sharding {'fsdp' if fmt == 'fsdp' else 'none/optimizer'}, this run "
                         f"uses {'fsdp' if sharded else 'none/optimizer'}: resume with the same `sharding`")
    if sharded:
        from qerl.train.fsdp import load_sharded

        load_sharded(model, optimizer, path / "dcp")
        return _restore_rest(path, blob, scheduler)
    try:
        weights = load_file(str(path / "trainable.safetensors"))
    except FileNotFoundError:
        raise CheckpointError(f"{path / 'trainable.safetensors'}: missing from the checkpoint") from None
    except Exception as e:  # safetensors raises its own error types
        size = (path / "trainable.safetensors").stat().st_size
        raise CheckpointError(f"{path / 'trainable.safetensors'}: not a readable safetensors file ({size} bytes; "
                              f"truncated or corrupt?): {e}") from None
    params = dict(model.named_parameters())
    missing = [n for n in weights if n not in params]
    if missing:
        raise CheckpointError(f"{path}: checkpoint has parameters the model lacks, e.g. {missing[:3]}")
    bad = [(n, tuple(t.shape), tuple(params[n].shape)) for n, t in weights.items() if t.shape != params[n].shape]
    if bad:
        n, got, want = bad[0]
        raise CheckpointError(f"{path / 'trainable.safetensors'}: {n} has shape {got}, the model's is {want} (a "
                              "checkpoint of another model or LoRA rank)")
    with torch.no_grad():
        for n, t in weights.items():
            params[n].copy_(t)
    load_optimizer_state(optimizer, blob["optimizer"])
    return _restore_rest(path, blob, scheduler)


def _restore_rest(path: Path, blob: dict, scheduler) -> TrainState:
    """Scheduler, RNG states and the saved :class:`TrainState`."""
    scheduler.load_state_dict(blob["scheduler"])
    torch.set_rng_state(blob["torch_rng"])
    if blob["cuda_rng"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(blob["cuda_rng"])
    random.setstate(blob["python_rng"])
    np.random.set_state(blob["numpy_rng"])
    return TrainState(**json.loads((path / "trainer_state.json").read_text()))


def load_optimizer_state(optimizer, state_dict: dict) -> None:
    """``optimizer.load_state_dict``, also for a :class:`~torch.distributed.optim.ZeroRedundancyOptimizer` over
    bitsandbytes' 8-bit AdamW: bitsandbytes' ``state_dict`` nests its quantized states under one key (for FSDP)
    and only its own ``load_state_dict`` un-nests them, which ZeRO bypasses (it assigns each rank's states
    directly), so they are un-nested here first."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    key = getattr(getattr(optimizer, "optim", None), "_FSDP_WRAPPED_QUANT_STATE_KEY", None)
    if isinstance(optimizer, ZeroRedundancyOptimizer) and key:
        state_dict = {**state_dict, "state": {
            i: ({**{k: v for k, v in st.items() if k != key}, **st.get(key, {})} if isinstance(st, dict) else st)
            for i, st in state_dict["state"].items()}}
    optimizer.load_state_dict(state_dict)

