"""Fused elementwise kernels for the update phase: RMSNorm and the SiLU gate through ``torch.compile``.

The update's forward and backward run transformers' eager decoder layers. At small models their elementwise work
is as large as their GEMMs: an RMSNorm is ~7 kernels forward (the fp32 upcast, ``pow``, ``mean``, ``rsqrt``, two
products, the cast) and more backward over ``[tokens, hidden]`` fp32 tensors, the MLP gate two more over
``[tokens, intermediate]`` (0.5B, 14 k tokens: ~150 ms of the update's ~360 ms of GPU time, reports/step).
:func:`fused_elementwise` routes, inside its block, every RMSNorm's forward and every SiLU-gated MLP's product through
the rollout engine's own elementwise functions (:class:`qerl.rollout.engine.forward.Elementwise`, compiled: one
fused Triton kernel each way, dynamic shapes): the same operations in the same dtypes — ``w · (x̂ in fp32, cast)``
and ``silu(g) · u`` — as transformers' eager forward, the reductions summed in another order. AQN's patched norms
keep their noisy path and get the fused forward where no noise is drawn. The functions are the Inductor kernels, never
:mod:`qerl_kernels.norm`'s launches (the engine's, forward-only). Only on CUDA (``torch.compile`` needs its
Triton backend); elsewhere, or with ``enabled=False``, nothing changes.
"""
from __future__ import annotations

import contextlib
import functools
import types

import torch
from torch import nn

FUSED = [True]  # the fused update on where it can run (benchmarks compare both)
_MISSING = object()


@functools.cache
def _compiled():
    from qerl.rollout.engine.forward import Elementwise

    return Elementwise(compiled=True, norm_kernels=False)  # differentiable, and the same kernels with or without grad


def _rms_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    return self._qerl_ew.rms(self.weight, hidden_states, self.variance_epsilon)


def _mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    return self.down_proj(self._qerl_ew.silu_mul(self.gate_proj(x), self.up_proj(x)))


def _is_rmsnorm(mod: nn.Module) -> bool:
    return type(mod).__name__.endswith("RMSNorm") and isinstance(getattr(mod, "weight", None), torch.Tensor) \
        and isinstance(getattr(mod, "variance_epsilon", None), float)


def _is_silu_mlp(mod: nn.Module) -> bool:
    return all(a in mod._modules for a in ("gate_proj", "up_proj", "down_proj")) \
        and getattr(getattr(mod, "config", None), "hidden_act", None) in ("silu", "swish")


@contextlib.contextmanager
def fused_elementwise(model: nn.Module, enabled: bool = True, ew=None, modules: list | None = None):
    """Inside the block the RMSNorm and SiLU-gated MLP modules of ``model`` compute through ``ew`` (default: the
    compiled :class:`~qerl.rollout.engine.forward.Elementwise`; only when ``model`` is on CUDA and
    :data:`FUSED` is on). Yields the number of modules routed; the original forwards come back when it ends.
    ``modules``: ``list(model.modules())`` where the caller walked them already."""
    params = next(model.parameters(), None)
    if ew is None and (not enabled or not FUSED[0] or params is None or params.device.type != "cuda"):
        yield 0
        return
    ew = ew if ew is not None else _compiled()
    patched = []
    for mod in model.modules() if modules is None else modules:
        if _is_rmsnorm(mod):  # an AQN-patched norm calls _aqn_original_forward when no noise is drawn
            attr, fn = ("_aqn_original_forward" if hasattr(mod, "_aqn_original_forward") else "forward"), _rms_forward
        elif _is_silu_mlp(mod):
            attr, fn = "forward", _mlp_forward
        else:
            continue
        patched.append((mod, attr, mod.__dict__.get(attr, _MISSING)))
        mod._qerl_ew = ew
        setattr(mod, attr, types.MethodType(fn, mod))
    try:
        yield len(patched)
    finally:
        for mod, attr, old in reversed(patched):
            if old is _MISSING:
                delattr(mod, attr)
            else:
                setattr(mod, attr, old)
            mod.__dict__.pop("_qerl_ew", None)
