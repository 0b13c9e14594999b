"""How ``qerl train --nproc N`` starts N processes: ``torchrun`` (``python -m torch.distributed.run``) on this
machine, or ``srun`` + ``torchrun`` on the nodes of a SLURM allocation (one torchrun agent per node, c10d
rendezvous on the allocation's first node). The commands are built here, printed by ``--dry-run``, and run
with ``subprocess`` (the exit status is the run's)."""
from __future__ import annotations

import os
import shlex
import subprocess
import sys


def strip_launch_args(argv: list[str]) -> list[str]:
    """``qerl train`` arguments without the launcher's own (``--nproc N``, ``--nnodes M``, ``--dry-run``)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in ("--nproc", "--nnodes"):
            skip = True
            continue
        if a.startswith(("--nproc=", "--nnodes=")) or a == "--dry-run":
            continue
        out.append(a)
    return out


def torchrun_argv(nproc: int, train_args: list[str], python: str = sys.executable,
                  command: tuple[str, ...] = ("train",)) -> list[str]:
    """One machine: ``python -m torch.distributed.run --standalone --nproc-per-node N -m qerl train ...``
    (``command``: another ``qerl`` subcommand, e.g. ``("bench", "step")``)."""
    return [python, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            "-m", "qerl", *command, *train_args]


def slurm_command(nnodes: int, nproc: int, train_args: list[str], python: str = "python", port: int = 29500) -> str:
    """Several nodes inside a SLURM allocation (``sbatch --nodes=M --gpus-per-node=N``): one ``srun`` task per
    node, each a torchrun agent of N processes, meeting at the first node of ``$SLURM_JOB_NODELIST``. A shell
    command line (it expands SLURM's variables on the nodes)."""
    inner = (f"{python} -m torch.distributed.run --nnodes={nnodes} --nproc-per-node={nproc} --rdzv-backend=c10d "
             f"--rdzv-endpoint=$(scontrol show hostnames $SLURM_JOB_NODELIST | head -n1):{port} "
             f"--rdzv-id=$SLURM_JOB_ID -m qerl train {shlex.join(train_args)}")
    return (f"srun --nodes={nnodes} --ntasks-per-node=1 --gpus-per-node={nproc} --kill-on-bad-exit=1 "
            f"bash -c {shlex.quote(inner)}")


def launch(nproc: int, nnodes: int, train_args: list[str], dry_run: bool = False) -> int:
    """Run (or with ``dry_run`` print) the launch command; returns its exit status."""
    if nproc < 1 or nnodes < 1:
        raise ValueError(f"--nproc and --nnodes must be >= 1, got {nproc} and {nnodes}")
    if nnodes > 1:
        cmd = slurm_command(nnodes, nproc, train_args)
        if dry_run:
            print(cmd)
            return 0
        if "SLURM_JOB_ID" not in os.environ:
            raise ValueError(f"--nnodes {nnodes}: several nodes are launched through SLURM; run this inside an "
                             "allocation (sbatch --nodes=M --gpus-per-node=N), or print the command with --dry-run")
        return _report(subprocess.call(cmd, shell=True), nproc * nnodes)
    argv = torchrun_argv(nproc, train_args)
    if dry_run:
        print(shlex.join(argv))
        return 0
    return _report(subprocess.call(argv), nproc)


def _report(rc: int, nproc: int) -> int:
    if rc:
        print(f"qerl train: the run on {nproc} processes stopped (exit status {rc}; torchrun's report above names the "
              "rank that failed first). Rank 0 writes checkpoints atomically, so the last one is intact: rerun with "
              f"--resume --nproc {nproc}.", file=sys.stderr)
    return rc
