"""SLURM checks the Snakefile makes before any job is submitted (``--executor slurm``,
``workflow/profiles/slurm``): every partition a job would be sent to exists on this cluster.

Without it a mistyped or missing partition surfaces only when the first job is submitted, as sbatch's
``invalid partition specified`` inside a screen of the submission command; here it is one line naming the partition,
where it was set and the partitions ``sinfo`` lists.
"""
from __future__ import annotations

import shutil
import subprocess


class ClusterError(ValueError):
    """The cluster cannot take the jobs as configured (one line)."""


def _value(resource) -> str | None:
    """A snakemake resource's value as given (a plain value, or the text of a not yet evaluated expression)."""
    for attr in ("value", "raw"):
        try:
            v = getattr(resource, attr)
        except Exception:  # (an expression snakemake evaluates per job)
            continue
        if v is not None and not callable(v):
            return str(v).strip().strip("'\"")
    return None if resource is None or callable(resource) else str(resource).strip().strip("'\"")


def asked_partitions(default_resources, overwrite_resources) -> dict[str, str]:
    """``{partition: where it was set}`` from snakemake's ``--default-resources`` and ``--set-resources`` (a profile's
    ``default-resources`` / ``set-resources``): ``slurm_partition`` values, each possibly a comma-separated list."""
    out: dict[str, str] = {}

    def take(mapping, where: str) -> None:
        try:
            items = list(mapping.items()) if mapping is not None else []
        except AttributeError:
            items = []
        for key, res in items:
            if key != "slurm_partition":
                continue
            for p in (_value(res) or "").split(","):
                if p.strip():
                    out.setdefault(p.strip(), where)

    take(getattr(default_resources, "parsed", default_resources), "default-resources slurm_partition")
    for rule, mapping in (overwrite_resources or {}).items():
        take(mapping, f"set-resources {rule}:slurm_partition")
    return out


def cluster_partitions() -> list[str]:
    """The partitions ``sinfo`` lists (the default one without its ``*``)."""
    if shutil.which("sinfo") is None:
        raise ClusterError("--executor slurm: `sinfo` is not on PATH (run snakemake on a SLURM login node)")
    done = subprocess.run(["sinfo", "-h", "-o", "%P"], capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        raise ClusterError(f"--executor slurm: `sinfo` failed: {(done.stderr or done.stdout).strip()[:300]}")
    return [p.rstrip("*") for p in done.stdout.split()]


def check_partitions(asked: dict[str, str], available: list[str]) -> None:
    """A :class:`ClusterError` naming the first partition of ``asked`` that ``available`` lacks."""
    for part, where in asked.items():
        if part not in available:
            raise ClusterError(f"SLURM partition {part!r} ({where}) is not a partition of this cluster; sinfo lists: "
                               f"{', '.join(available) or 'none'}")
