"""Policy-gradient losses as one pure function: ``policy_loss(...) -> (loss, info)``.

Per token t of completion i, with ratio ``ρ = exp(logp - old_logp)`` and advantage ``A_i``::

    ℓ_it = max(-A_i ρ, -A_i clip(ρ, 1 - ε_low, 1 + ε_high))          (PPO clipped surrogate)
           · w_it                                                   (optional truncated IS weight)
           + β · k3_it,  k3 = exp(ref - logp) - (ref - logp) - 1     (optional KL, GRPO only)

Aggregation and ratio level are the axes of :mod:`qerl.rl.algorithms` (its table holds each algorithm's values):

* ``sequence-mean`` (GRPO, GSPO) — mean over each sequence's tokens, then mean over sequences (paper §2, TRL "grpo").
* ``token-mean`` (DAPO) — sum over all completion tokens / number of tokens (token-level; clip-higher).
* ``constant`` (Dr. GRPO) — sum over all tokens / (n_sequences · max_len): a constant normaliser, no length bias.
* ``ratio_level: sequence`` (GSPO eq. 7) — every token of completion i carries the sequence ratio
  ``s_i = exp(mean_t (logp_it − old_logp_it))`` in place of ``ρ_it``: the clip acts on whole completions, and with
  sequence-mean aggregation ``ℓ_i = max(−A_i s_i, −A_i clip(s_i, 1 − ε_low, 1 + ε_high))``.

Truncated importance sampling (TIS): rollouts come from the noisy sampling policy (AQN) while
``old_logp`` is the trainer's noise-free log-prob; ``w = min(exp(old_logp - rollout_logp), C)``
(detached) reweights tokens by how much more likely the trainer finds them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from qerl.rl.algorithms import NAMES as ALGORITHMS, check_axes, preset


@dataclass(frozen=True)
class LossSettings:
    """Loss hyperparameters: ``algorithm`` (a preset of :mod:`qerl.rl.algorithms`) gives the defaults of every
    setting left None. Paper Table 4: GRPO ε = 0.2 both sides, no KL; DAPO ε_low 0.2, ε_high 0.28, no KL."""

    algorithm: str = "grpo"
    clip_low: float | None = None
    clip_high: float | None = None
    kl_coef: float = 0.0
    max_len: int | None = None  # the constant aggregation's normaliser (max new tokens)
    aggregation: str | None = None
    ratio_level: str | None = None

    def __post_init__(self):
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {self.algorithm!r}")
        p = preset(self.algorithm)
        for name in ("clip_low", "clip_high", "aggregation", "ratio_level"):
            if getattr(self, name) is None:
                object.__setattr__(self, name, getattr(p, name))
        check_axes(self.aggregation, self.ratio_level, where="LossSettings")
        if self.clip_low < 0 or self.clip_high < 0:
            raise ValueError(f"clip ε must be >= 0, got low={self.clip_low}, high={self.clip_high}")
        if self.kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0, got {self.kl_coef}")
        if self.aggregation == "constant" and not self.max_len:
            raise ValueError(f"{self.algorithm} (aggregation 'constant') needs max_len (the max completion length) as "
                             "its normaliser")


def micro_weight(aggregation: str, mask: torch.Tensor, m: slice | torch.Tensor) -> float:
    """Share of micro-batch ``m`` (a slice or an index tensor of rows of ``mask [B, T]``) in the batch-level loss
    under ``aggregation``, so that summing micro losses times these weights equals the loss of the whole batch:
    its share of the batch's tokens (token-mean), of its sequences with tokens (sequence-mean), or of its rows
    (constant)."""
    if aggregation == "token-mean":
        return float(mask[m].sum() / mask.sum().clamp(min=1))
    if aggregation == "sequence-mean":
        has = mask.sum(1) > 0
        return float(has[m].sum() / has.sum().clamp(min=1))
    if aggregation == "constant":
        return ((m.stop - m.start) if isinstance(m, slice) else len(m)) / mask.shape[0]
    raise ValueError(f"aggregation {aggregation!r} is not one of sequence-mean, token-mean, constant")


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1)


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    settings: LossSettings,
    ref_logp: torch.Tensor | None = None,
    is_weights: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    sync: bool = True,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The clipped policy-gradient loss.

    Args:
        logp, old_logp: ``[B, T]`` per-token log-probs of the sampled completion tokens under the
            current policy (with grad) and the policy that generated the batch (no grad).
        advantages: ``[B]`` per sequence or ``[B, T]`` per token.
        mask: ``[B, T]`` 1 for completion tokens that count, 0 for padding / masked sequences.
        ref_logp: ``[B, T]`` reference-policy log-probs (needed when ``kl_coef > 0``).
        is_weights: ``[B, T]`` truncated importance weights (detached), or None.
        entropy: ``[B, T]`` per-token policy entropy, only reported in ``info``.

        sync: ``info`` as Python floats (one host sync); ``False``: as detached 0-dim tensors on the loss's
            device, so that a training loop can launch the backward without waiting for the forward.

    Returns:
        ``(loss, info)``; ``info`` holds detached floats (or tensors, ``sync=False``): clip_frac,
        ratio_mean/min/max, kl, entropy, pg_loss.
    """
    mask = mask.to(logp.dtype)
    adv = advantages.to(logp.dtype)
    if adv.ndim == 1:
        adv = adv.unsqueeze(1)
    if settings.ratio_level == "sequence":  # GSPO: one length-normalised ratio a completion, on each of its tokens
        log_s = ((logp - old_logp) * mask).sum(1) / mask.sum(1).clamp(min=1)
        ratio = torch.exp(log_s).unsqueeze(1).expand_as(logp)
    else:
        ratio = torch.exp(logp - old_logp)
    clipped = torch.clamp(ratio, 1 - settings.clip_low, 1 + settings.clip_high)
    per_token = torch.maximum(-adv * ratio, -adv * clipped)
    if is_weights is not None:
        per_token = per_token * is_weights.detach()
    kl = None
    if settings.kl_coef > 0:
        if ref_logp is None:
            raise ValueError("kl_coef > 0 needs ref_logp")
        d = ref_logp - logp
        kl = torch.exp(d) - d - 1
        per_token = per_token + settings.kl_coef * kl
    if settings.aggregation == "sequence-mean":
        per_seq = (per_token * mask).sum(1) / mask.sum(1).clamp(min=1)
        has_tokens = (mask.sum(1) > 0).to(per_seq.dtype)
        loss = (per_seq * has_tokens).sum() / has_tokens.sum().clamp(min=1)
    elif settings.aggregation == "token-mean":
        loss = (per_token * mask).sum() / mask.sum().clamp(min=1)
    else:  # constant
        loss = (per_token * mask).sum() / (mask.shape[0] * settings.max_len)
    with torch.no_grad():  # (no data-dependent shapes: nothing here waits for the GPU unless ``sync``)
        is_clipped = ((ratio < 1 - settings.clip_low) & (adv < 0)) | ((ratio > 1 + settings.clip_high) & (adv > 0))
        m = mask > 0
        any_m, one = m.any(), ratio.new_ones(())
        n_m = m.sum().clamp(min=1).to(ratio.dtype)
        info = {
            "pg_loss": loss.detach(),
            "clip_frac": _masked_mean(is_clipped.to(mask.dtype), mask),
            "ratio_mean": torch.where(any_m, torch.where(m, ratio, 0).sum() / n_m, one),
            "ratio_min": torch.where(any_m, torch.where(m, ratio, torch.inf).amin(), one),
            "ratio_max": torch.where(any_m, torch.where(m, ratio, -torch.inf).amax(), one),
            "kl": _masked_mean(kl, mask) if kl is not None else ratio.new_zeros(()),
            "entropy": _masked_mean(entropy, mask) if entropy is not None else ratio.new_full((), float("nan")),
        }
        info = {k: v.reshape(()).to(torch.float32) for k, v in info.items()}
        if sync:
            info = dict(zip(info, torch.stack(list(info.values())).tolist()))
    return loss, info


def truncated_is_weights(old_logp: torch.Tensor, rollout_logp: torch.Tensor, cap: float) -> torch.Tensor:
    """TIS weights ``min(exp(old_logp - rollout_logp), cap)`` (detached)."""
    if cap <= 0:
        raise ValueError(f"TIS cap must be > 0, got {cap}")
    return torch.exp(old_logp - rollout_logp).clamp(max=cap).detach()


def mismatch_stats(old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """Rollout-vs-trainer mismatch over completion tokens (sampled from the rollout policy):
    ``mismatch_kl`` = k3 estimate of KL(rollout ‖ trainer), importance-ratio mean/min/max."""
    m = mask > 0
    if not bool(m.any()):
        return {"mismatch_kl": 0.0, "is_ratio_mean": 1.0, "is_ratio_min": 1.0, "is_ratio_max": 1.0}
    log_r = (old_logp - rollout_logp)[m].double()
    r = log_r.exp()
    return {
        "mismatch_kl": float((r - 1 - log_r).mean()),
        "is_ratio_mean": float(r.mean()),
        "is_ratio_min": float(r.min()),
        "is_ratio_max": float(r.max()),
    }
