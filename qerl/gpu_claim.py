"""Which GPUs a workflow job runs on, in a local run of several GPU jobs at once.

Snakemake counts a job's ``gpu`` resource against the limit (``--resources gpu=N``; the Snakefile sets the visible
GPUs) but does not say *which* GPUs a job gets: every ``qerl`` process would open ``cuda:0``. In a local run the
Snakefile exports ``QERL_GPU_LOCKS`` (a directory) and each GPU job's command ``QERL_CLAIM_GPUS=<its gpu>``; the
``qerl`` CLI then, before CUDA starts, takes an exclusive ``flock`` on ``<dir>/gpu<id>.lock`` for that many of the
visible GPUs and narrows ``CUDA_VISIBLE_DEVICES`` to them (a ``--nproc N`` job's torchrun workers inherit it). The
locks are held by the process until it exits — the kernel releases them on any exit, ``kill -9`` included — so
jobs never share a GPU and a crashed job leaves nothing to clean up. SLURM sets ``CUDA_VISIBLE_DEVICES`` per job
itself; there neither variable is exported.
"""
from __future__ import annotations

import fcntl
import os
import sys
import time
from pathlib import Path

_HELD: list[int] = []  # lock file descriptors, open for the life of the process


def visible_ids() -> list[str]:
    """The GPUs this process may use, as ``CUDA_VISIBLE_DEVICES`` entries (indices or UUIDs)."""
    from qerl.workflow_config import visible_gpus

    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [item.strip() for item in env.split(",")][:visible_gpus()]
    return [str(i) for i in range(visible_gpus())]


def jobs_per_gpu() -> int:
    """How many jobs may share one GPU (``QERL_JOBS_PER_GPU``, exported by the Snakefile from the config's
    ``resources.jobs_per_gpu``; default 1: each job its own GPU). Small models leave most of a GPU idle, so a local
    run of many of them goes faster several to a GPU."""
    raw = os.environ.get("QERL_JOBS_PER_GPU") or "1"
    try:
        n = int(raw)
    except ValueError:
        raise RuntimeError(f"QERL_JOBS_PER_GPU={raw!r}: expected a positive integer") from None
    if n < 1:
        raise RuntimeError(f"QERL_JOBS_PER_GPU={raw!r}: expected a positive integer")
    return n


def _lock_name(gid: str, slot: int, slots: int) -> str:
    return f"gpu{gid}.lock" if slots == 1 else f"gpu{gid}.slot{slot}.lock"


def claim(n: int, lock_dir: Path, ids: list[str] | None = None, timeout_s: float = 3600.0,
          poll_s: float = 0.5, slots: int | None = None) -> list[str]:
    """Lock a slot on each of ``n`` distinct GPUs of ``ids`` (default :func:`visible_ids`); ``slots`` jobs may share
    a GPU (default :func:`jobs_per_gpu`). Slots fill GPU by GPU in turn (slot 0 of every GPU first), so jobs spread
    over the GPUs before they share one. Waits while too few are free (another job still exiting) and raises
    ``RuntimeError`` after ``timeout_s``. Returns the claimed ids."""
    ids = visible_ids() if ids is None else ids
    slots = jobs_per_gpu() if slots is None else slots
    if n > len(ids):
        raise RuntimeError(f"this job asks for {n} GPU(s); {len(ids)} visible ({','.join(ids) or 'none'})")
    lock_dir.mkdir(parents=True, exist_ok=True)
    start, said = time.monotonic(), 0.0
    while True:
        got: list[tuple[str, int]] = []
        for slot in range(slots):
            for gid in ids:
                if any(g == gid for g, _ in got):
                    continue
                fd = os.open(lock_dir / _lock_name(gid, slot, slots), os.O_CREAT | os.O_RDWR, 0o644)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    os.close(fd)
                    continue
                got.append((gid, fd))
                if len(got) == n:
                    _HELD.extend(fd for _, fd in got)
                    return [g for g, _ in got]
        for _, fd in got:  # not enough free: give back what we took, wait, retry
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
        waited = time.monotonic() - start
        if waited > timeout_s:
            raise RuntimeError(f"no {n} free GPU(s) of {','.join(ids)} after {waited:.0f} s (locks in {lock_dir})")
        if waited - said >= 60:
            print(f"qerl: waiting for {n} free GPU(s) ({waited:.0f} s)", file=sys.stderr, flush=True)
            said = waited
        time.sleep(poll_s)


def claim_from_env() -> list[str] | None:
    """The CLI's hook: with ``QERL_GPU_LOCKS`` and ``QERL_CLAIM_GPUS`` > 0 set, claim and narrow
    ``CUDA_VISIBLE_DEVICES``; returns the ids, or None when there is nothing to claim."""
    lock_dir, n = os.environ.get("QERL_GPU_LOCKS"), int(os.environ.get("QERL_CLAIM_GPUS") or 0)
    if not lock_dir or n <= 0 or "LOCAL_RANK" in os.environ:  # (torchrun's workers: their launcher claimed)
        return None
    got = claim(n, Path(lock_dir))
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(got)
    os.environ["QERL_CLAIM_GPUS"] = "0"  # processes this one starts (torchrun's workers) run on the claimed GPUs
    print(f"qerl: this job runs on GPU(s) {','.join(got)} (CUDA_VISIBLE_DEVICES; locks in {lock_dir})",
          file=sys.stderr, flush=True)
    return got


def keep_one() -> str | None:
    """A one-process, one-GPU command's claim (``qerl bench hf``: TRL's ``Trainer`` wraps the model in
    ``nn.DataParallel`` when one process sees several GPUs, which ``GRPOTrainer`` refuses): narrow
    ``CUDA_VISIBLE_DEVICES`` to the first of :func:`visible_ids` before CUDA starts. Returns it, or None where
    nothing changed (torchrun's workers, one GPU or none visible)."""
    ids = visible_ids()
    if "WORLD_SIZE" in os.environ or len(ids) < 2:
        return None
    os.environ["CUDA_VISIBLE_DEVICES"] = ids[0]
    return ids[0]


def release() -> None:
    """Give back every GPU this process claimed (the process's exit does the same)."""
    while _HELD:
        fd = _HELD.pop()
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
