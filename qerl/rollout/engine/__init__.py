"""The rollout engine (CUDA-graph decoding on the trainer's own weights): :class:`RolloutEngine`.

``engine_for(model, tokenizer)`` returns the engine attached to ``model`` (created on first use and kept
with its KV cache and graphs for the next rollout); :func:`qerl.rollout.generate` calls it.
"""
from qerl.rollout.engine.model_view import EngineUnsupported, view_model
from qerl.rollout.engine.runner import RolloutEngine


def engine_for(model, tokenizer, **kwargs) -> RolloutEngine:
    """The engine cached on ``model`` (kwargs only apply when it is created)."""
    eng = model.__dict__.get("_qerl_engine")
    if eng is None or eng.tokenizer is not tokenizer:
        eng = RolloutEngine(model, tokenizer, **kwargs)
        model.__dict__["_qerl_engine"] = eng
    return eng


def release_engine(model) -> bool:
    """Free the KV cache and graphs of the engine attached to ``model`` (kept: the engine, its model view and
    compiled kernels). Returns whether there was one."""
    eng = model.__dict__.get("_qerl_engine")
    if eng is None:
        return False
    eng.release()
    return True


__all__ = ["EngineUnsupported", "RolloutEngine", "engine_for", "release_engine", "view_model"]
