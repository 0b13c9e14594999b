"""Rollouts: :func:`generate` samples completions with the engine or the reference sampler.

``SamplingSettings.engine``: ``auto`` runs :mod:`qerl.rollout.engine` on CUDA when it supports the model
(architecture, module types) and :mod:`qerl.rollout.sampler` otherwise, saying once in the log why it fell
back; ``engine`` requires the engine (an unsupported model is an error); ``reference`` never uses it.
"""
from __future__ import annotations

import logging

from qerl.rollout.sampler import Rollout, sequence_logprobs
from qerl.rollout.sampling import SamplingSettings

log = logging.getLogger(__name__)
_WARNED: set = set()


def generate(model, tokenizer, prompts: list[str], settings: SamplingSettings, seed: int = 0,
             num_samples: int = 1, first_row: int = 0, eos_at=None) -> Rollout:
    """Sample ``num_samples`` completions per prompt (groups contiguous), see :mod:`qerl.rollout.sampler`.
    ``first_row``: the global index of this call's first row (its rows draw with those rows' seeds).
    ``eos_at`` (benchmarks): one length per row at which it ends as if it had sampled EOS."""
    from qerl.rollout import sampler

    mode = settings.engine
    if mode == "reference" or (mode == "auto" and next(model.parameters()).device.type != "cuda"):
        return sampler.generate(model, tokenizer, prompts, settings, seed, num_samples, first_row, eos_at)
    from qerl.rollout.engine import EngineUnsupported, engine_for

    try:
        eng = engine_for(model, tokenizer, nf4=settings.nf4_weights)
    except EngineUnsupported as e:
        if mode == "engine":
            raise
        if str(e) not in _WARNED:
            _WARNED.add(str(e))
            log.warning("rollout engine not used (%s): falling back to the reference sampler", e)
        return sampler.generate(model, tokenizer, prompts, settings, seed, num_samples, first_row, eos_at)
    return eng.generate(prompts, settings, seed, num_samples, first_row, eos_at)


__all__ = ["Rollout", "SamplingSettings", "generate", "sequence_logprobs"]
