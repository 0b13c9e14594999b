"""How the ranks of one run share the model and its optimizer: a strategy object the training loop calls, so the loop
reads the same under one process, DDP, ZeRO-1 and FSDP2 (``TrainConfig.sharding``, resolved by
:func:`qerl.train.config.resolve_sharding`).

* :class:`Replicated` (``none``): every rank holds everything; DDP all-reduces the gradients (one process: no-op).
* :class:`OptimizerSharded` (``optimizer``, ZeRO-1): DDP + ``ZeroRedundancyOptimizer``, each rank keeping the AdamW
  states of 1/W of the weights; rank 0 collects them all before it writes a checkpoint.
* :class:`FullySharded` (``fsdp``, the full method): FSDP2 shards weights, gradients and states
  (:mod:`qerl.train.fsdp`); its forwards all-gather, so every rank runs as many micro-batches; checkpoints are every
  rank's own shards.
"""
from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path

import torch

from qerl.errors import TrainingError
from qerl.train import dist, fsdp
from qerl.train.state import TrainState, load_checkpoint
from qerl.train.steps import make_optimizer


class Replicated:
    """``sharding: none``: every rank holds the whole model and optimizer."""

    name = "none"
    lockstep = False  # whether every rank must run the filler micro-batches too (collectives inside the forward)
    keeps_engine_cache = True  # whether the rollout engine's KV cache may outlive a rollout

    def prepare(self, policy, device, world: int) -> None:
        """Called once before the optimizer exists (FSDP2 turns the weights into shards here)."""

    def make_optimizer(self, policy, cfg, device):
        return make_optimizer([p for p in policy.parameters() if p.requires_grad], cfg.optim, device)

    def note(self, optimizer, params, world: int) -> str | None:
        """What rank 0 says about the sharding at the start (None: nothing to say)."""
        return None

    def load(self, out: Path, policy, optimizer, scheduler) -> TrainState:
        return load_checkpoint(out, policy, optimizer, scheduler, sharded=False)

    def wrap(self, scorer, d: dist.Dist, device):
        """The module the update's forward goes through (DDP-wrapped under torchrun)."""
        return dist.wrap(scorer, d, device)

    def gathered(self, policy):
        """The context the rollout runs in (whole weights)."""
        return contextlib.nullcontext()

    def accumulating(self, policy, scorer):
        """The context of a micro-batch that is not the last before an optimizer step (no gradient sync)."""
        return scorer.no_sync()

    def clip(self, policy, params, max_norm: float, world: int) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(params, max_norm)

    def stage_checkpoint(self, out: Path, policy, optimizer, step: int, d: dist.Dist) -> Path | None:
        """Collective work before rank 0 writes a checkpoint; returns a staging directory of shards, or None."""
        return None

    def final_weights(self, policy, d: dist.Dist) -> dict | None:
        """The whole state dict for ``final/`` where the ranks hold parts of it (None: the model's own)."""
        return None


class OptimizerSharded(Replicated):
    """``sharding: optimizer`` (ZeRO-1)."""

    name = "optimizer"

    def make_optimizer(self, policy, cfg, device):
        return make_optimizer([p for p in policy.parameters() if p.requires_grad], cfg.optim, device, shard=True)

    def note(self, optimizer, params, world: int) -> str | None:
        mine = sum(p.numel() for p in optimizer.optim.param_groups[0]["params"])
        return (f"optimizer states sharded over {world} processes (ZeroRedundancyOptimizer, sharding: optimizer): "
                f"rank 0 keeps those of {mine:,} of {sum(p.numel() for p in params):,} parameters")

    def stage_checkpoint(self, out, policy, optimizer, step, d):
        # every rank sends its states' part to rank 0, which writes them all
        dist.collective(d, lambda: optimizer.consolidate_state_dict(to=0),
                        f"collecting the optimizer states of step {step}")
        return None


class FullySharded(Replicated):
    """``sharding: fsdp`` (FSDP2, the full method)."""

    name = "fsdp"
    lockstep = True
    keeps_engine_cache = False  # (the engine holds views of the gathered weights, which FSDP2 reshards)

    def prepare(self, policy, device, world):
        fsdp.shard(policy, device, world)

    def make_optimizer(self, policy, cfg, device):
        # bitsandbytes' 8-bit AdamW takes whole tensors, not DTensor shards: the fp32 states are sharded instead;
        # multi-tensor on every device, so CPU tests take the GPU's path
        optim = cfg.optim
        if optim.eight_bit == "true":
            raise TrainingError("optim.eight_bit: true cannot shard with sharding: fsdp (bitsandbytes' 8-bit AdamW "
                                "needs whole tensors); use eight_bit: auto/false, or sharding: optimizer")
        return make_optimizer(fsdp.optimizer_groups(policy), dataclasses.replace(optim, eight_bit="false"), device,
                              foreach=True)

    def note(self, optimizer, params, world):
        from torch.distributed.tensor import DTensor

        local = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in params)
        return (f"weights, gradients and optimizer states sharded over {world} processes (FSDP2, sharding: fsdp): "
                f"rank 0 holds {local:,} of {sum(p.numel() for p in params):,} parameters (the lm_head whole)")

    def load(self, out, policy, optimizer, scheduler):
        return load_checkpoint(out, policy, optimizer, scheduler, sharded=True)

    def wrap(self, scorer, d, device):
        return scorer  # (FSDP2's own hooks reduce the gradients)

    def gathered(self, policy):
        return fsdp.gathered(policy)

    def accumulating(self, policy, scorer):
        return fsdp.accumulating(policy)

    def clip(self, policy, params, max_norm, world):
        fsdp.average_replicated_grads(policy, world)
        return fsdp.clip_grad_norm_(params, max_norm)

    def stage_checkpoint(self, out, policy, optimizer, step, d):
        """Every rank writes its shards into ``out/.checkpoint.dcp-stepN`` (rank 0 then moves it into the new
        checkpoint, atomically; a staging left by a killed run is removed first)."""
        import shutil

        staging = out / f".checkpoint.dcp-step{step}"
        if d.main:
            for old in out.glob(".checkpoint.dcp-step*"):
                shutil.rmtree(old, ignore_errors=True)
            staging.mkdir(parents=True)
        dist.barrier(d, f"staging the checkpoint of step {step}")
        dist.collective(d, lambda: fsdp.save_sharded(policy, optimizer, staging),
                        f"writing the shards of step {step}")
        return staging

    def final_weights(self, policy, d):
        return dist.collective(d, lambda: fsdp.full_weights(policy), "gathering the final weights")


STRATEGIES = {s.name: s for s in (Replicated, OptimizerSharded, FullySharded)}


def strategy(name: str) -> Replicated:
    """The strategy of a resolved ``sharding`` (none | optimizer | fsdp)."""
    return STRATEGIES[name]()
