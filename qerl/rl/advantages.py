"""Group-relative advantages and DAPO's batch filters (pure tensor functions).

GRPO (paper §2): rewards come in groups of G completions per prompt;
``A_i = (r_i - mean(r_group)) / (std(r_group) + eps)`` (``scale="std"``) or
``A_i = r_i - mean(r_group)`` (``scale="none"``, Dr. GRPO). ``std`` is the unbiased sample std,
as TRL and verl use.
"""
from __future__ import annotations

import torch


def group_advantages(rewards: torch.Tensor, group_size: int, scale: str = "std", eps: float = 1e-6) -> torch.Tensor:
    """``rewards [N]`` (N = n_groups * G, groups contiguous) -> advantages ``[N]`` (fp32)."""
    if group_size < 2:
        raise ValueError(f"group_size must be >= 2 (got {group_size}): one sample has no baseline")
    if rewards.ndim != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards must be 1-D with a multiple of group_size={group_size} entries, got {tuple(rewards.shape)}")
    r = rewards.float().reshape(-1, group_size)
    centered = r - r.mean(dim=1, keepdim=True)
    if scale == "std":
        centered = centered / (r.std(dim=1, keepdim=True) + eps)
    elif scale != "none":
        raise ValueError(f"advantage scale must be 'std' or 'none', got {scale!r}")
    return centered.reshape(-1)


def informative_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """DAPO dynamic sampling: ``[n_groups]`` bool, True where the group's rewards are not all equal
    (a group with equal rewards has zero advantage everywhere and carries no gradient)."""
    r = rewards.reshape(-1, group_size)
    return (r.amax(dim=1) - r.amin(dim=1)) > 0


def overlong_penalty(lengths: torch.Tensor, max_len: int, cache_len: int) -> torch.Tensor:
    """DAPO soft overlong punishment ``[N]``: 0 up to ``max_len - cache_len`` tokens, then linear
    down to -1 at ``max_len`` (and -1 beyond)."""
    if not 0 < cache_len <= max_len:
        raise ValueError(f"overlong cache_len must be in (0, max_len={max_len}], got {cache_len}")
    start = max_len - cache_len
    pen = (start - lengths.float()) / cache_len
    return torch.where(lengths.float() <= start, torch.zeros_like(pen), pen.clamp(min=-1.0))
