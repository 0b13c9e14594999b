"""Data parallelism for ``qerl train`` on ``torch.distributed`` (``torchrun``; NCCL on GPUs, gloo on CPUs).

One step on ``W`` processes (ranks) computes what one process computes on the same configuration:

* every rank holds the same packed base and adapters and draws the same global prompt list; rank ``r``
  generates the groups of its contiguous share (:func:`share`: whole groups, so a group's advantage never
  straddles ranks) with the seeds of their *global* rows (``qerl.rollout.sampling.row_seeds``), scores
  them, and the shares are gathered (:func:`gather`) into the global batch that one process would have: the
  group statistics, DAPO's filter and refills (every rank decides on the same gathered rewards, so every rank
  keeps the same groups) and the rollout metrics are computed on it, identically on every rank;
* the update: rank ``r`` runs the micro-batches of its share of the global batch; each micro-batch loss carries
  its global weight times ``W``, and DDP's gradient *average* (:class:`torch.nn.parallel.DistributedDataParallel`,
  one all-reduce per optimizer step) turns the ranks' sums into the one-process gradient; every rank then clips
  and steps identically — or, with ``sharding: optimizer`` (the full method's default), each rank updates its
  partition of the parameters and keeps only that partition's AdamW states
  (:class:`torch.distributed.optim.ZeroRedundancyOptimizer`), broadcasting the new values; its checkpoint
  gathers every rank's states on rank 0 first; ``sharding: fsdp`` (full method) replaces DDP by FSDP2
  (:mod:`qerl.train.fsdp`);
* per-rank loss diagnostics are summed (:func:`all_sum`); rank 0 alone writes ``metrics.jsonl``, MLflow,
  checkpoints (atomically) and the final adapter.

What differs from one process is the order of floating-point reductions (the all-reduce sums ranks' partial
gradients; forwards run on other batch shapes when shares do not align with micro-batches): on a tiny fp32 model
GRPO's metrics are bit-identical (two partial gradients, doubled then averaged, sum exactly) and DAPO's with uneven
shares agree to 1e-5 relative (tests/train/test_dist.py).
"""
from __future__ import annotations

import datetime
import hashlib
import json
import os
import signal
from dataclasses import dataclass

import torch
import torch.distributed as tdist

from qerl.errors import TrainingError

TIMEOUT_S = int(os.environ.get("QERL_DIST_TIMEOUT", "1800"))  # a collective waiting longer: a lost rank


@dataclass(frozen=True)
class Dist:
    """This process's place in the run: ``rank`` of ``world`` (1: no torch.distributed), GPU ``local_rank``."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def on(self) -> bool:
        return self.world > 1


def from_env(device: torch.device) -> Dist:
    """Join the process group that ``torchrun`` describes (``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``,
    ``MASTER_ADDR/PORT``); one process without them. NCCL when training on CUDA (each rank on GPU
    ``LOCAL_RANK``), gloo on CPU."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return Dist()
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if not tdist.is_initialized():
        # QERL_DIST_BACKEND=gloo: e.g. several ranks sharing one GPU in a smoke test (NCCL needs a GPU per rank)
        backend = os.environ.get("QERL_DIST_BACKEND") or ("nccl" if device.type == "cuda" else "gloo")
        if device.type == "cuda":
            torch.cuda.set_device(local % torch.cuda.device_count())
        tdist.init_process_group(backend, timeout=datetime.timedelta(seconds=TIMEOUT_S))
    return Dist(rank, world, local)


def rank_device(device: torch.device, d: Dist) -> torch.device:
    """``cuda`` -> ``cuda:LOCAL_RANK`` under torchrun (``cuda:LOCAL_RANK % GPUs`` where ranks share GPUs, see
    ``QERL_DIST_BACKEND``); anything else unchanged."""
    if device.type != "cuda" or not d.on or device.index is not None:
        return device
    return torch.device("cuda", d.local_rank % torch.cuda.device_count())


def share(n: int, d: Dist) -> range:
    """Rank ``d.rank``'s contiguous share of ``n`` items (groups): sizes differ by at most one, lower ranks
    first (``n = 5, W = 2``: 0-2 and 3-4). Used for refill rounds, whose group count need not divide."""
    lo = d.rank * (n // d.world) + min(d.rank, n % d.world)
    return range(lo, lo + n // d.world + (1 if d.rank < n % d.world else 0))


def gather(d: Dist, obj, what: str) -> list:
    """Every rank's ``obj`` in rank order (``all_gather_object``; tensors should be on the CPU). A rank that
    died or hangs becomes a :class:`TrainingError` naming ``what`` was being gathered."""
    if not d.on:
        return [obj]
    out = [None] * d.world
    try:
        tdist.all_gather_object(out, obj)
    except (RuntimeError, tdist.DistBackendError) as e:  # gloo / NCCL: a peer closed, or the timeout
        raise lost_rank(d, what, e) from None
    return out


def all_sum(d: Dist, values: dict[str, float], what: str) -> dict[str, float]:
    """``values`` summed over ranks (same keys on every rank)."""
    if not d.on:
        return values
    return {k: sum(part[k] for part in gather(d, values, what)) for k in values}


def collective(d: Dist, fn, what: str):
    """Run ``fn()`` (a collective every rank calls) with a lost peer reported as in :func:`gather`."""
    try:
        return fn()
    except (RuntimeError, tdist.DistBackendError) as e:
        raise lost_rank(d, what, e) from None


def barrier(d: Dist, what: str) -> None:
    if d.on:
        gather(d, None, what)


def lost_rank(d: Dist, what: str, err: BaseException) -> TrainingError:
    first = str(err).splitlines()[0][:200] if str(err) else type(err).__name__
    return TrainingError(
        f"rank {d.rank} of {d.world}: another rank stopped or stalled while {what} ({first}). Nothing is "
        "half-written (checkpoints are replaced atomically by rank 0); rerun with --resume on the same number "
        "of processes.")


def check_same_config(d: Dist, cfg_dict: dict) -> None:
    """Refuse to start when the ranks were given different configurations (a hash of each rank's)."""
    if not d.on:
        return
    digest = hashlib.sha256(json.dumps(cfg_dict, sort_keys=True, default=str).encode()).hexdigest()[:16]
    hashes = gather(d, digest, "comparing the configurations")
    if len(set(hashes)) > 1:
        raise TrainingError("the ranks were started with different configurations (hash per rank: "
                            + ", ".join(f"rank {i} {h}" for i, h in enumerate(hashes))
                            + "): start every rank from the same config file and --set values")


def check_divisible(prompts_per_step: int, d: Dist) -> None:
    if d.on and prompts_per_step % d.world:
        raise TrainingError(
            f"prompts_per_step = {prompts_per_step} does not split over {d.world} processes: each rank takes whole "
            f"groups, equally; use a multiple of {d.world} (e.g. {prompts_per_step + d.world - prompts_per_step % d.world})"
            f" or --nproc dividing {prompts_per_step}")


def wrap(module: torch.nn.Module, d: Dist, device: torch.device):
    """``module`` in DDP (gradients averaged over ranks in one all-reduce per optimizer step), or itself."""
    if not d.on:
        return module
    from torch.nn.parallel import DistributedDataParallel

    import inspect

    ids = [device.index] if device.type == "cuda" else None
    # No broadcast of the module's state, at start or before each forward: every rank built the same weights
    # (same seed, same checkpoint: check_same_weights), the packed NVFP4 weights are buffers (GBs; gloo cannot
    # send their float8 scales), and nothing in the forward changes a buffer. torch >= 2.13 names the switch
    # forward_sync_buffers.
    names = inspect.signature(DistributedDataParallel).parameters
    quiet = {"forward_sync_buffers": False} if "forward_sync_buffers" in names else {"broadcast_buffers": False}
    if "init_sync" in names:
        quiet["init_sync"] = False
    # gradient_as_bucket_view: the .grad tensors are views into the all-reduce buckets, not a second copy (for the
    # full method that copy is the size of the bf16 weights)
    return DistributedDataParallel(module, device_ids=ids, gradient_as_bucket_view=True, **quiet)


def check_same_weights(d: Dist, module: torch.nn.Module) -> None:
    """Refuse to train when the ranks' trainable weights differ at start (a per-rank checksum)."""
    if not d.on:
        return
    with torch.no_grad():
        sums = [float(p.double().sum()) for p in module.parameters() if p.requires_grad]
    parts = gather(d, sums, "comparing the initial weights")
    if any(p != parts[0] for p in parts):
        bad = [i for i, p in enumerate(parts) if p != parts[0]]
        raise TrainingError(f"ranks {bad} start from other trainable weights than rank 0: every rank must load "
                            "the same model, adapters and checkpoint")


def maybe_fault(d: Dist, step: int) -> None:
    """Test hooks: ``QERL_FAULT_KILL=RANK:STEP`` kills rank RANK (SIGKILL, no cleanup) as step STEP (1-based)
    starts, ``QERL_FAULT_HANG=RANK:STEP`` makes it stall there — how tests/train/test_dist.py checks that the
    other ranks stop (torchrun's teardown / the collectives' timeout) and that --resume reproduces."""
    for var in ("QERL_FAULT_KILL", "QERL_FAULT_HANG"):
        spec = os.environ.get(var)
        if spec:
            rank, at = (int(v) for v in spec.split(":"))
            if d.rank == rank and step == at:
                if var == "QERL_FAULT_KILL":
                    os.kill(os.getpid(), signal.SIGKILL)
                import time

                time.sleep(3600)


def close(d: Dist) -> None:
    if d.on and tdist.is_initialized():
        tdist.destroy_process_group()
