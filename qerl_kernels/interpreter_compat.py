"""Triton 3.6's interpreter (``TRITON_INTERPRET=1``, the CPU tests) under NumPy >= 2.4.

In the interpreter every scalar is a one-element 1-d array, and ``tl.tensor.__index__`` — what a loop bound such
as ``range(pid_s * per_split, tl.minimum(k_tiles, ...))`` calls — converts it with ``int(self.handle.data)``.
NumPy 1.25 deprecated converting an array of ``ndim > 0`` to a scalar and NumPy 2.4 made it a ``TypeError`` ("only
0-dimensional arrays can be converted to Python scalars"), so every kernel whose loop bounds come from
``tl.program_id`` fails under the interpreter with a NumPy of 2.4 or later (the GPU image's 2.5, say; this project
pins 2.3). Triton fixed it upstream after 3.6 (triton-lang/triton#9171: ``int(self.handle.data.squeeze())``).

:func:`patch` makes ``__index__`` take the one element explicitly — the same fix — and only on a Triton whose
interpreter still has the bug (its source is read to tell). Compiled kernels never reach this code.
"""
from __future__ import annotations

import inspect

_BUGGY = "int(self.handle.data))"  # triton 3.6's interpreter: ``lambda self: int(self.handle.data)``


def _index(self) -> int:
    data = self.handle.data
    return int(data.reshape(-1)[0]) if data.size == 1 else int(data)


def patch() -> bool:
    """Fix ``tl.tensor.__index__`` in Triton's interpreter where it needs it (idempotent); returns whether this
    Triton needed it."""
    try:
        from triton.runtime import interpreter
    except ImportError:  # no triton, or one without an interpreter
        return False
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None:
        return False
    if getattr(original, "qerl_index_fix", False):
        return True
    try:
        source = inspect.getsource(original)
    except (OSError, TypeError):
        return False
    if _BUGGY not in source:
        return False

    def _patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", _index)  # restored after the kernel, in reverse order, as Triton's own

    _patch_lang_tensor.qerl_index_fix = True
    interpreter._patch_lang_tensor = _patch_lang_tensor
    return True
