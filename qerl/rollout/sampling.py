"""Sampling: the settings, and the draw both engines use — on the device, without host syncs and without a
torch.Generator (so it can live in a CUDA graph).

Each row ``b`` at generation step ``t`` draws its token with the Gumbel-max trick from counter-based
uniforms ``u = hash(seed_b, t, vocab index)`` (a 32-bit integer hash, :func:`uniform`):

    token = argmax_v( filtered(logits / T)_v + g_v ),   g_v = -log(-log u_v)

which is an exact draw from ``softmax(filtered(logits / T))`` (Gumbel 1954; the filters are top-k and
top-p, :func:`filter_logits`). A row's tokens depend only on its own seed, step and
logits — not on which other rows share the batch — so compacting finished rows away changes nothing, and
the same seed reproduces the same rollout. The reported log-prob is ``log_softmax(logits / T)`` of the
chosen token over the full vocabulary (the sampling policy's, as the reference sampler and vLLM report it);
T = 0 is greedy.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

ENGINES = ("auto", "engine", "reference")
NF4_WEIGHTS = ("eager", "dense")  # how the engine runs an NF4 (QLoRA) base: SamplingSettings.nf4_weights


@dataclass(frozen=True)
class SamplingSettings:
    """temperature (paper: 1.0 for rollouts, 0.6 for evaluation; 0 = greedy), top_p, top_k
    (0 = off), max_new_tokens, stop strings (generation ends once one appears; it is kept).
    engine: ``auto`` (the rollout engine, :mod:`qerl.rollout.engine`, on CUDA for models it runs; this
    reference sampler otherwise), ``engine`` (always the engine; on CPU without CUDA graphs) or
    ``reference``. release_cache (training): ``true`` frees the engine's KV cache and graphs after each rollout
    so the update has that memory (they are captured again at the next rollout, ~0.2–0.7 s); ``false`` keeps
    them; ``auto`` keeps them when the memory planner says the update fits beside them
    (:func:`qerl.train.plan.keep_engine_cache`). nf4_weights (a QLoRA base in the engine): ``eager`` runs each
    bitsandbytes NF4 projection through its own forward (dequantized on every call, no CUDA graphs: ~18x the
    rollout time of a bf16 base at 0.5B on an H200,
    reports/step/evidence/0.5B_b64_g768_qlora_eager_nf4_vs_lora_NVIDIA_H200.csv); ``dense`` dequantizes the frozen base once, by
    bitsandbytes' own dequantization, and runs it like a bf16 base (CUDA graphs, fused q/k/v and gate/up) — the
    values the eager path multiplies by, for the memory of a bf16 copy of the base beside the NF4 one."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 256
    stop: tuple[str, ...] = ()
    engine: str = "auto"
    release_cache: bool | str = "auto"
    nf4_weights: str = "eager"

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {ENGINES}, got {self.engine!r}")
        if self.nf4_weights not in NF4_WEIGHTS:
            raise ValueError(f"nf4_weights must be one of {NF4_WEIGHTS}, got {self.nf4_weights!r}")
        if self.release_cache not in (True, False, "auto"):
            raise ValueError(f"release_cache must be true, false or auto, got {self.release_cache!r}")


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (set to -inf) tokens outside top-k / the top-p nucleus; always keeps the best one."""
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, idx = torch.sort(logits, descending=True, dim=-1)
        probs = sorted_logits.softmax(-1)
        cum = probs.cumsum(-1)
        remove = (cum - probs) >= top_p  # tokens whose preceding mass already reaches p
        remove[..., 0] = False
        logits = logits.masked_fill(torch.zeros_like(remove).scatter(-1, idx, remove), float("-inf"))
    return logits


_M1, _M2 = 0x7FEB352D, 0x5BD1E995  # odd multipliers < 2^31: products stay inside int64
_MASK = 0xFFFFFFFF


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche hash (int64 tensor holding values in [0, 2^32))."""
    x = x ^ (x >> 16)
    x = (x * _M1) & _MASK
    x = x ^ (x >> 15)
    x = (x * _M2) & _MASK
    return x ^ (x >> 16)


def uniform(seed: torch.Tensor, step: torch.Tensor, vocab: int) -> torch.Tensor:
    """``[B, vocab]`` fp32 uniforms from ``seed [B]`` int64 and ``step`` (int64, 0-d or ``[B]``): the hash's top
    23 bits, ``(x >> 9 + 0.5) · 2^-23`` — exact in fp32, in ``[2^-24, 1 - 2^-24]``. (All 32 bits rounded to fp32
    gave ``u = 1`` for 127 of 2^32 values, i.e. ``g = +inf``: at V = 152k a uniformly random token on 0.45% of
    draws.)"""
    idx = torch.arange(vocab, device=seed.device, dtype=torch.int64)
    key = _mix((seed & _MASK) ^ _mix((step * 0x9E37 + 0x632B) & _MASK))  # [B]
    return unit(_mix((idx[None, :] + key[:, None] * 0x10001) & _MASK))


def unit(x: torch.Tensor) -> torch.Tensor:
    """32-bit hash values (int64 in ``[0, 2^32)``) -> fp32 ``(x >> 9 + 0.5) · 2^-23`` in ``[2^-24, 1 - 2^-24]``,
    every value exact (24 significant bits at most: with 24 bits of x, ``2^24 - 0.5`` would round up to 1)."""
    return ((x >> 9).to(torch.float32) + 0.5) * (1.0 / 8388608.0)


def row_seeds(seed: int, first_row: int, n: int) -> torch.Tensor:
    """``[n]`` int64 per-row seeds of rows ``first_row .. first_row + n - 1`` of a rollout seeded ``seed`` (any
    Python int). A row's seed depends on its global index only, so a rollout split over calls (DAPO refills
    aside) or over ranks (``qerl train`` under torchrun: each rank generates its share) draws the same tokens
    as one call over all rows; the engine and the reference sampler use the same seeds."""
    base = ((int(seed) & 0xFFFFFFFFFFFFFFFF) * 0x9E3779B1 + 0x7F4A7C15) & _MASK
    return (base + torch.arange(first_row, first_row + n, dtype=torch.long) * 0x632BE5AB) & _MASK


def sample(logits: torch.Tensor, s: SamplingSettings, seed: torch.Tensor, step: torch.Tensor):
    """``logits [B, V]`` fp32 -> (tokens [B] int64, log-probs [B] fp32); see module docstring."""
    if s.temperature == 0:
        tok = logits.argmax(-1)
        return tok, logits.log_softmax(-1).gather(-1, tok[:, None])[:, 0]
    scaled = logits * (1.0 / s.temperature)  # by float32(1 / T) on every device (CUDA divides by a scalar so anyway)
    filtered = filter_logits(scaled, s.top_k, s.top_p)
    g = -torch.log(-torch.log(uniform(seed, step, logits.shape[-1])))
    tok = (filtered + g).argmax(-1)
    return tok, scaled.log_softmax(-1).gather(-1, tok[:, None])[:, 0]


def row_budget(eos_at, n: int, G: int) -> list[int]:
    """Each row's last token count: ``G``, or its ``eos_at`` length (checked: one per row, 1 … G)."""
    if eos_at is None:
        return [G] * n
    out = [int(x) for x in eos_at]
    if len(out) != n or not all(1 <= x <= G for x in out):
        raise ValueError(f"rollout: eos_at needs one length in 1 … max_new_tokens {G} per row ({n} rows), got "
                         f"{len(out)} values in [{min(out, default=0)}, {max(out, default=0)}]")
    return out
