"""Launching a Triton / Gluon kernel without Triton's per-call work, for eager calls (``ops._launch``).

``kernel[grid](*args, **kw)`` binds every argument, specialises each one (dtype, 16-byte alignment, ``== 1``), hashes
the result and looks the compiled kernel up: 25-40 µs of host time per launch on the H100 machines' CPUs, paid by
every projection called eagerly (prefill, the update's forward and backward, evaluation, anyone's own loop), two or
three times for routes with a pre-pass or a LoRA primary. :func:`run` pays it once per *scope*: the caller (``ops``)
opens a scope keyed on everything that decides the launches of one call — shapes, dtypes, alignments, the resolved
config, which optional tensors are given — and inside it the first launch of each kernel goes through Triton and
remembers the compiled kernel and the constexpr values; later launches in the same scope call the compiled kernel's
launcher directly with the runtime arguments.

Contract for callers: inside one scope the arguments that vary between calls (tensors, runtime sizes) are passed
positionally; every keyword argument has the same value every time the scope recurs (the scope key must imply it:
constexprs, launch options, a runtime count such as the MMV kernel's ``XP``). A launch that leaves a parameter out
which has no default is never remembered: it always takes Triton's path.
Outside a scope (``scope(None)``, the default) every launch takes Triton's path. ``DIRECT[0] = False`` turns the
direct path off (the checks compare both).

:func:`chain` (the rollout engine's decode step): inside it the kernels that can — the decode step's own Triton
kernels (:mod:`qerl_kernels.norm`, rotary, attention) and the warpgroup-MMA projections with their pre-passes — are
launched as programmatic dependents (``launch_pdl``) of the launch before them. Each such kernel releases the next launch at its start
(``griddepcontrol.launch_dependents``) and waits for the previous grid (``griddepcontrol.wait``) before its first
read of that grid's results and before its first global write; what it may do before the wait reads only constant
data (a projection's weights). Every kernel of the chain waits, so a wait returns only once *every* earlier launch
has completed: the chain is as ordered as a plain stream, but each launch, its programs' start and its weight
prefetch overlap the kernel before it.
"""
from __future__ import annotations

import contextlib
import threading

from qerl_kernels import interpreter_compat

interpreter_compat.patch()  # Triton 3.6's interpreter under NumPy >= 2.4

DIRECT = [True]  # direct launches on (tests and experiments turn it off)
_TLS = threading.local()  # per thread (autograd runs CUDA backward on its own thread): .key (the current call's scope,
# None outside), .n (its launches so far)
_HITS: dict = {}  # (scope, launch ordinal) -> (kernel, number of positional args, compiled kernel, constexpr values,
# the launch function and its leading arguments: _launcher)
_MAX = 8192  # remembered launches before the memo is cleared (training Ms vary per micro-batch)
_MEMO: dict = {}  # (scope, builder) -> what the builder returned (see memo)
_STATS = {"direct": 0, "triton": 0}
_TRITON: list = []  # (triton.knobs, the active driver's module-level handle), imported on the first direct launch
_CHAIN = [False]  # inside chain(): the chain-aware kernels launch as programmatic dependents (see module docstring)


@contextlib.contextmanager
def chain(on: bool = True):
    """Launch the chain-aware kernels as programmatic dependents inside the block (module docstring); ``on=False``
    turns it off inside an outer one. Callers that memoise launches include :func:`chained` in their scope key."""
    prev, _CHAIN[0] = _CHAIN[0], bool(on)
    try:
        yield
    finally:
        _CHAIN[0] = prev


def chained() -> bool:
    """Whether :func:`chain` is on."""
    return _CHAIN[0]


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for host-side grid sizes. ``triton.cdiv`` is a JIT-callable: called from Python it unwraps its
    arguments as constexprs, ~4 µs per call on the H100 machines' CPUs, four of them per launch."""
    return -(-a // b)


def scope(key) -> tuple:
    """Enter the scope ``key`` (None: no scope); returns the previous state for :func:`restore`. A scope's launches
    are told apart by their order: the code path of one call is a function of its key (the contract)."""
    prev = (getattr(_TLS, "key", None), getattr(_TLS, "n", 0))
    _TLS.key, _TLS.n = key, 0
    return prev


def in_scope() -> bool:
    """Whether a scope is open on this thread."""
    return getattr(_TLS, "key", None) is not None


def restore(prev: tuple) -> None:
    """Leave the current scope for the one :func:`scope` returned."""
    _TLS.key, _TLS.n = prev


def clear() -> None:
    """Forget every remembered launch and memo (e.g. after the tuned tables changed) and the imported driver handle."""
    _HITS.clear()
    _MEMO.clear()
    _TRITON.clear()


def memo(build, *args):
    """``build(*args)``, computed once per scope and remembered: a launcher's static part (grid, constexprs, scratch
    sizes, the keyword arguments of its launches), which the contract makes a function of the scope key. Outside a
    scope, or with the direct launches off, computed on every call. The result is shared: treat it as read-only."""
    key = getattr(_TLS, "key", None)
    if key is None or not DIRECT[0]:
        return build(*args)
    k = (key, build)
    hit = _MEMO.get(k)
    if hit is None:
        if len(_MEMO) >= _MAX:
            _MEMO.clear()
        hit = _MEMO[k] = build(*args)
    return hit


def _constexpr_tail(kernel, n_pos: int, kw: dict) -> tuple | None:
    """The values of ``kernel``'s parameters after the first ``n_pos`` — given by keyword, else their defaults — in
    order, or None when one has neither (then the launch is not remembered). Keywords are constant within a scope
    (the contract), constexprs or not."""
    out = []
    for p in kernel.params[n_pos:]:
        if p.name in kw:
            out.append(kw[p.name])
        elif p.has_default:
            out.append(p.default)
        else:
            return None
    return tuple(out)


def _triton() -> list:
    """``[triton.knobs, triton's driver config]``, imported once (an import statement costs ~1 µs per call)."""
    from triton import knobs
    from triton.runtime.driver import driver

    _TRITON[:] = [knobs, driver]
    return _TRITON


def _no_hooks(knobs) -> bool:
    """Whether no launch hook is installed (Triton 3.6 keeps empty hook chains; a profiler adds to them)."""
    h, g = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
    return (h is None or not getattr(h, "calls", True)) and (g is None or not getattr(g, "calls", True))


def run(kernel, grid, args: tuple, kw: dict):
    """``kernel[grid](*args, **kw)``; inside a scope, the compiled kernel's launcher directly when this scope
    launched ``kernel`` before (see module docstring) and no launch hook is installed (hooks — profilers — get
    Triton's own path, which calls them). ``grid`` is a 1-3 tuple."""
    key = getattr(_TLS, "key", None)
    if key is not None:
        key = (key, _TLS.n)
        _TLS.n += 1
        if DIRECT[0]:
            hit = _HITS.get(key)
            if hit is not None and hit[0] is kernel and hit[1] == len(args):
                knobs, driver = _TRITON or _triton()
                if _no_hooks(knobs):
                    active = driver.active
                    stream = active.get_current_stream(active.get_current_device())
                    hit[4](grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1, stream,
                           *hit[5], *args, *hit[3])
                    _STATS["direct"] += 1
                    return hit[2]
    compiled = kernel[grid](*args, **kw)
    _STATS["triton"] += 1
    if key is not None and compiled is not None and hasattr(compiled, "packed_metadata"):
        tail = _constexpr_tail(kernel, len(args), kw)
        if tail is not None:
            if len(_HITS) >= _MAX:
                _HITS.clear()
            _HITS[key] = (kernel, len(args), compiled, tail, *_launcher(compiled))
    return compiled


def _launcher(compiled) -> tuple:
    """``(fn, head)``: the direct launch is ``fn(gx, gy, gz, stream, *head, *args, *constexprs)``. Where the compiled
    kernel's launcher is Triton's ``CudaLauncher`` and the kernel needs no global or profile scratch (ours do not),
    ``fn`` is its C ``launch`` with what ``CudaLauncher.__call__`` would pass it fixed in ``head`` (the cooperative-
    grid and PDL flags, no scratch, the packed metadata and no launch metadata or hooks): the Python frame of
    ``__call__`` and its two scratch closures are ~2 µs of each launch on the H100 machines' CPUs. Else the launcher
    itself, as :meth:`CompiledKernel.run` is called."""
    run = compiled.run
    fn = getattr(run, "launch", None)
    if fn is not None and getattr(run, "global_scratch_size", 1) == 0 and getattr(run, "profile_scratch_size", 1) == 0 \
            and hasattr(run, "launch_cooperative_grid") and hasattr(run, "launch_pdl"):
        return fn, (compiled.function, run.launch_cooperative_grid, run.launch_pdl, None, None,
                    compiled.packed_metadata, None, None, None)
    return run, (compiled.function, compiled.packed_metadata, None, None, None)
