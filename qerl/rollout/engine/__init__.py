"""The rollout engine (CUDA-graph decoding on the trainer's own weights): :class:`RolloutEngine`.

``engine_for(model, tokenizer)`` returns the engine of ``model`` (created on first use and kept with its KV cache
and graphs for the next rollout); :func:`qerl.rollout.generate` calls it. The engines live in this module's
registry, keyed weakly by the model: an engine holds views of the model's parts (never the model object), so a
model that is dropped takes its engine with it. :func:`release_engine` frees an engine's KV cache and graphs,
:func:`cached_engine` looks one up without creating it.
"""
import weakref

from qerl.rollout.engine.model_view import EngineUnsupported, view_model
from qerl.rollout.engine.runner import RolloutEngine

_ENGINES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> RolloutEngine


def engine_for(model, tokenizer, **kwargs) -> RolloutEngine:
    """The engine of ``model`` (kwargs only apply when it is created; a new tokenizer, another ``nf4`` mode, or an
    NVFP4 layer re-laid since, :meth:`qerl.models.nvfp4_linear.NVFP4Linear.set_layout`, makes a new engine)."""
    from qerl.models.nvfp4_linear import LAYOUT_CHANGES

    eng = _ENGINES.get(model)
    if eng is None or eng.tokenizer is not tokenizer or eng.nf4 != kwargs.get("nf4", eng.nf4) or \
            getattr(eng, "layout_changes", 0) != LAYOUT_CHANGES[0]:
        eng = RolloutEngine(model, tokenizer, **kwargs)
        eng.layout_changes = LAYOUT_CHANGES[0]
        _ENGINES[model] = eng
    return eng


def cached_engine(model) -> RolloutEngine | None:
    """The engine of ``model`` if one was made, else None."""
    return _ENGINES.get(model)


def drop_engine(model) -> RolloutEngine | None:
    """Forget ``model``'s engine (the next :func:`engine_for` builds a new one); returns it, or None."""
    return _ENGINES.pop(model, None)


def release_engine(model) -> bool:
    """Free the KV cache and graphs of ``model``'s engine (kept: the engine, its model view and compiled kernels).
    Returns whether there was one."""
    eng = _ENGINES.get(model)
    if eng is None:
        return False
    eng.release()
    return True


__all__ = ["EngineUnsupported", "RolloutEngine", "cached_engine", "drop_engine", "engine_for", "release_engine",
           "view_model"]
