"""The one seam through which every use of an NVFP4 base weight goes.

``nvfp4_linear(x, packed, scale, global_scale, bias)`` computes ``y = x · dequant(W)ᵀ + b`` with
``x [..., K]`` (bf16/fp16/fp32), ``packed uint8 [N, K/2]``, ``scale float8_e4m3fn [N, K/16]``,
``global_scale float32 [1]``, ``bias [N] | None``; it returns ``y [..., N]`` in ``x.dtype``.

Autograd: gradients flow to ``x`` only (the base is frozen): ``dX = dY · dequant(W)``. The backward
recomputes the dequantized weight instead of saving it, so no bf16 copy of W outlives a call.

``nvfp4_lora_linear(x, packed, scale, global_scale, bias, lora_a, lora_b, lora_scale)`` adds a LoRA
branch ``s · (x · Aᵀ) · Bᵀ`` (``lora_a [R, K]``, ``lora_b [N, R]``) the way PEFT computes it; without
autograd (rollouts, evaluation) a backend may run it in the same launch as the base product.

Layout: ``tiled=True`` (keyword of every op here) says ``packed`` / ``scale`` are in the tile-contiguous layout the
rollout engine decodes from (:mod:`qerl_kernels.layout`: the same bytes, each 64-row tile's 128-wide K steps one
after another); the kernels then read it directly and route each call by M as on row-major weights
(:func:`qerl_kernels.ops.tiled_config`: the decode kernels that cannot read tiles step to the warpgroup-MMA or tile
kernels), every other path computes on a row-major copy (:func:`rows_of`). A module that keeps its weights tiled:
:meth:`qerl.models.nvfp4_linear.NVFP4Linear.set_layout`.

Backends: the pure-torch reference below (dequantize, then ``F.linear``) is the readable
definition and the CPU path. On CPU the dequantized weight is cached per packed weight (:func:`dequantized_weight`:
LRU, ``QERL_CPU_WEIGHT_CACHE_MB``, default 4096, 0 = off; valid while the packed tensors are the same objects,
unmodified), so generation does not rebuild every weight at every token. The GPU kernels (``qerl_kernels``, which
import nothing from ``qerl``) become a backend here (:func:`kernel_backend`, on the first call, unless ``QERL_KERNELS=off``); setting the environment
variable ``QERL_FORCE_REFERENCE=1`` forces the reference everywhere for debugging.
"""
from __future__ import annotations

import os
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from qerl.quant.nvfp4 import dequantize


@dataclass(frozen=True)
class Backend:
    """A fast implementation: ``supports(x, packed)`` gates it; ``forward``/``backward_input``/
    ``forward_lora`` have the signatures of :func:`reference_forward` / :func:`reference_backward_input`
    / :func:`reference_lora_forward` (``forward_lora`` optional: base + LoRA in one call, no autograd).
    Optional, for :mod:`qerl.ops.lora_train`: ``forward_xa(x, packed, scale, gs, bias, xa, lora_b, s)`` =
    ``x · Ŵᵀ + bias + s · xa · lora_bᵀ``, ``forward_lora_xa(x, packed, scale, gs, bias, lora_a, xa, lora_b, s)``
    = the same given both ``lora_a`` and ``xa = x · lora_aᵀ``, equal bit for bit to ``forward_lora`` (the training
    forward then matches the no-grad pass), and ``backward_input_lora(dy, packed, scale, gs, dyb, lora_a, s)`` =
    ``dy · Ŵ + s · dyb · lora_a`` (``xa``/``dyb`` ``[M, R]``, 2-D ``x``/``dy``)."""

    name: str
    supports: Callable[[torch.Tensor, torch.Tensor], bool]
    forward: Callable[..., torch.Tensor]
    backward_input: Callable[..., torch.Tensor]
    forward_lora: Callable[..., torch.Tensor] | None = None
    forward_xa: Callable[..., torch.Tensor] | None = None
    forward_lora_xa: Callable[..., torch.Tensor] | None = None
    backward_input_lora: Callable[..., torch.Tensor] | None = None


_BACKENDS: list[Backend] = []
KERNELS = "triton-nvfp4"  # the name of the qerl_kernels backend (:func:`kernel_backend`)


def register_backend(backend: Backend) -> None:
    """Register a fast backend (tried in registration order, newest first)."""
    _BACKENDS.insert(0, backend)


def use_reference() -> bool:
    """True when ``QERL_FORCE_REFERENCE`` is set to a true value (1/true/yes)."""
    return os.environ.get("QERL_FORCE_REFERENCE", "").lower() in ("1", "true", "yes")


_CPU_CACHE: OrderedDict = OrderedDict()  # (id(packed), dtype) -> (weakref(packed), stamp, dense W); LRU order
_CPU_CACHE_BYTES = [0]


def _cpu_cache_limit() -> int:
    try:
        return int(float(os.environ.get("QERL_CPU_WEIGHT_CACHE_MB", "4096")) * 2 ** 20)
    except ValueError:
        raise ValueError(f"QERL_CPU_WEIGHT_CACHE_MB={os.environ['QERL_CPU_WEIGHT_CACHE_MB']!r}: expected a number "
                         "of MB (0 = no cache)") from None


def _drop(key) -> None:
    entry = _CPU_CACHE.pop(key, None)
    if entry is not None:
        _CPU_CACHE_BYTES[0] -= entry[2].numel() * entry[2].element_size()


def dequantized_weight(packed, scale, global_scale, dtype) -> torch.Tensor:
    """``dequant(W)`` ``[N, K]`` in ``dtype`` (:func:`qerl.quant.nvfp4.dequantize`). On CPU the result is kept
    (LRU within ``QERL_CPU_WEIGHT_CACHE_MB``) and reused while ``packed``, ``scale`` and ``global_scale`` are the
    same tensors at the same in-place versions — an overwritten or replaced weight is dequantized again; an entry
    goes when its packed tensor is freed. Elsewhere (the GPU reference path) nothing is kept: a dense copy would
    undo the 4-bit memory saving."""
    limit = _cpu_cache_limit() if packed.device.type == "cpu" else 0
    if limit <= 0:
        return dequantize(packed, scale, global_scale, dtype=dtype)
    try:
        stamp = (packed._version, id(scale), scale._version, id(global_scale), global_scale._version)
    except RuntimeError:  # inference-mode tensors carry no version counter: do not cache them
        return dequantize(packed, scale, global_scale, dtype=dtype)
    key = (id(packed), dtype)
    entry = _CPU_CACHE.get(key)
    if entry is not None and entry[0]() is packed and entry[1] == stamp:
        _CPU_CACHE.move_to_end(key)
        return entry[2]
    _drop(key)
    w = dequantize(packed, scale, global_scale, dtype=dtype)
    size = w.numel() * w.element_size()
    if size > limit:
        return w
    while _CPU_CACHE and _CPU_CACHE_BYTES[0] + size > limit:
        _drop(next(iter(_CPU_CACHE)))
    _CPU_CACHE[key] = (weakref.ref(packed, lambda _, k=key: _drop(k)), stamp, w)
    _CPU_CACHE_BYTES[0] += size
    return w


def dense_weight(packed, scale, global_scale, dtype, tiled: bool = False) -> torch.Tensor:
    """``dequant(W)`` ``[N, K]`` in ``dtype``, kept by the caller: on CUDA with the kernels, one pass of
    ``qerl_kernels.nvfp4_dequant`` (bit-exact with the reference, ~copy bandwidth), else
    :func:`qerl.quant.nvfp4.dequantize`. ``tiled``: the weight in the tile-contiguous layout (untiled first)."""
    packed, scale = rows_of(packed, scale, tiled)
    if packed.is_cuda and dtype in (torch.bfloat16, torch.float16) and not use_reference():
        try:
            from qerl_kernels.nvfp4_dequant import dequantize_into
        except ImportError:
            pass
        else:
            out = torch.empty(packed.shape[0], packed.shape[1] * 2, dtype=dtype, device=packed.device)
            return dequantize_into(out, packed, scale.view(torch.uint8), global_scale)
    return dequantize(packed, scale, global_scale, dtype=dtype)


def reference_forward(x, packed, scale, global_scale, bias):
    """``x [..., K] · dequant(W)ᵀ [K, N] + bias`` in ``x.dtype`` (dequantize, then matmul)."""
    w = dequantized_weight(packed, scale, global_scale, x.dtype)
    return F.linear(x, w, bias)


def reference_backward_input(grad_out, packed, scale, global_scale):
    """``dX [..., K] = dY [..., N] · dequant(W) [N, K]`` in ``grad_out.dtype``."""
    w = dequantized_weight(packed, scale, global_scale, grad_out.dtype)
    return grad_out @ w


def reference_lora_forward(x, packed, scale, global_scale, bias, lora_a, lora_b, lora_scale):
    """PEFT's LoRA forward over the reference base, op for op: ``base = x · dequant(W)ᵀ + bias`` in
    ``x.dtype``, the branch ``(x · Aᵀ) · Bᵀ · s`` in the adapters' dtype (fp32 for PEFT's upcast
    adapters), their sum rounded once to ``x.dtype``."""
    base = reference_forward(x, packed, scale, global_scale, bias)
    xl = x.to(lora_a.dtype)
    return (base + F.linear(F.linear(xl, lora_a), lora_b) * lora_scale).to(x.dtype)


def rows_of(packed: torch.Tensor, scale: torch.Tensor, tiled: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(packed, scale)`` in the checkpoint's row-major layout: as they are, or (``tiled``) untiled copies
    (:func:`qerl_kernels.layout.untile`) — the reference and any backend but the kernels compute on these."""
    if not tiled:
        return packed, scale
    from qerl_kernels.layout import untile

    return untile(packed, scale)


def _tiled_backend(x: torch.Tensor, packed: torch.Tensor) -> Backend | None:
    """The backend that takes this call on tiled weights as they lie (the kernels, ``tiled=True``), or None: the
    caller computes on a row-major copy (:func:`rows_of`)."""
    backend = select_backend(x, packed)
    return backend if backend is not None and backend.name == KERNELS else None


def _maybe_register_kernels() -> None:
    """``QERL_KERNELS`` picks the CUDA path (``qerl_kernels``; CPU always uses the reference):

    * ``auto`` (default) / ``triton``: every forward and backward on the kernels, whose tuned tables
      pick the path per call (decode kernels, tensor-core tiles, or dequantize-windows + cuBLAS for
      large M). Measured on an H200 (reports/kernels/): 1.5–50x faster than this reference at every
      shape and M, which pays ~15x the copy time to dequantize through fp32 temporaries;
    * ``reference`` / ``off``: never (``QERL_FORCE_REFERENCE=1`` also forces it, for debugging)."""
    mode = os.environ.get("QERL_KERNELS", "auto").lower()
    if mode in ("triton", "auto"):
        if not any(b.name == KERNELS for b in _BACKENDS):
            register_backend(kernel_backend())
    elif mode not in ("reference", "off"):
        raise ValueError(f"QERL_KERNELS={mode!r}: expected auto, triton, reference or off")


def kernel_backend() -> Backend:
    """The Triton kernels (``qerl_kernels``, the floor below this seam) as a backend, built from their public
    functions: forward and backward of every call their ``supports`` accepts (CUDA, or the interpreter on CPU;
    bf16/fp16 activations); each call's path (MMV / GEMV / tile / DQ) comes from their tuned tables."""
    from qerl_kernels.ops import nvfp4_matmul, nvfp4_matmul_t, supports

    return Backend(  # (each takes tiled=True for weights in the tile-contiguous layout: module docstring)
        KERNELS, supports, lambda x, p, s, g, b, tiled=False: nvfp4_matmul(x, p, s, g, b, tiled=tiled),
        lambda dy, p, s, g, tiled=False: nvfp4_matmul_t(dy, p, s, g, tiled=tiled),
        lambda x, p, s, g, b, la, lb, sc, tiled=False: nvfp4_matmul(x, p, s, g, b, None, lb, sc, lora_a=la,
                                                                     tiled=tiled),
        forward_xa=lambda x, p, s, g, b, xa, lb, sc, tiled=False: nvfp4_matmul(x, p, s, g, b, xa, lb, sc, tiled=tiled),
        forward_lora_xa=lambda x, p, s, g, b, la, xa, lb, sc, tiled=False: nvfp4_matmul(
            x, p, s, g, b, xa, lb, sc, lora_a=la, tiled=tiled),
        backward_input_lora=lambda dy, p, s, g, dyb, la, sc, tiled=False: nvfp4_matmul_t(dy, p, s, g, dyb, la, sc,
                                                                                         tiled=tiled),
    )


def select_backend(x: torch.Tensor, packed: torch.Tensor) -> Backend | None:
    """The first registered backend that supports these tensors, or None for the reference."""
    if use_reference():
        return None
    if not _BACKENDS:
        _maybe_register_kernels()
    for backend in _BACKENDS:
        if backend.supports(x, packed):
            return backend
    return None


class _NVFP4LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, packed, scale, global_scale, bias, tiled=False):
        backend = select_backend(x, packed)
        fwd = backend.forward if backend else reference_forward
        ctx.save_for_backward(packed, scale, global_scale)
        ctx.backend = backend
        ctx.x_dtype = x.dtype
        ctx.tiled = tiled  # (only with the kernels: every other path was handed row-major weights)
        return fwd(x, packed, scale, global_scale, bias, tiled=True) if tiled else fwd(x, packed, scale,
                                                                                        global_scale, bias)

    @staticmethod
    def backward(ctx, grad_out):
        packed, scale, global_scale = ctx.saved_tensors
        grad_x = None
        if ctx.needs_input_grad[0]:
            bwd = ctx.backend.backward_input if ctx.backend else reference_backward_input
            dy = grad_out.contiguous()
            grad_x = (bwd(dy, packed, scale, global_scale, tiled=True) if ctx.tiled
                      else bwd(dy, packed, scale, global_scale)).to(ctx.x_dtype)
        grad_bias = None
        if ctx.needs_input_grad[4]:  # a bias is frozen in every method, but stay correct if not
            grad_bias = grad_out.reshape(-1, grad_out.shape[-1]).sum(0)
        return grad_x, None, None, None, grad_bias, None


def nvfp4_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    global_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    tiled: bool = False,
) -> torch.Tensor:
    """``y = x · dequant(W)ᵀ + bias`` on an NVFP4 weight (see module docstring for shapes; ``tiled``: the weight in
    the tile-contiguous layout)."""
    if x.shape[-1] != packed.shape[1] * 2:
        raise ValueError(
            f"nvfp4_linear: input has K = {x.shape[-1]} features but the packed weight "
            f"{tuple(packed.shape)} holds K = {packed.shape[1] * 2}"
        )
    no_grad = not torch.is_grad_enabled() or not (x.requires_grad or (bias is not None and bias.requires_grad))
    backend = select_backend(x, packed) if no_grad or tiled else None  # (the autograd node looks it up itself)
    if tiled and (backend is None or backend.name != KERNELS):  # only the kernels read tiles as they lie
        packed, scale = rows_of(packed, scale, True)
        tiled = False
    if no_grad:  # nothing to differentiate: skip the autograd node (host time)
        if tiled:
            return backend.forward(x, packed, scale, global_scale, bias, tiled=True)
        return (backend.forward if backend else reference_forward)(x, packed, scale, global_scale, bias)
    return _NVFP4LinearFn.apply(x, packed, scale, global_scale, bias, tiled)


def nvfp4_lora_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    global_scale: torch.Tensor,
    bias: torch.Tensor | None,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    lora_scale: float,
    *,
    tiled: bool = False,
) -> torch.Tensor:
    """``y = x · dequant(W)ᵀ + bias + s · (x · Aᵀ) · Bᵀ`` (``lora_a [R, K]``, ``lora_b [N, R]``; ``tiled``: the
    weight in the tile-contiguous layout).

    With autograd recording (training) it is the composition PEFT runs — the base through
    :func:`nvfp4_linear`, the LoRA branch as two ``F.linear`` — so every gradient is the usual one.
    Without (``torch.no_grad`` / inference mode: rollouts, evaluation) a backend's ``forward_lora``
    computes it in one launch (on the H200 decode kernels ``x · Aᵀ`` runs inside the same launch,
    reports/kernels/README.md), else :func:`reference_lora_forward`."""
    if x.shape[-1] != packed.shape[1] * 2 or lora_a.shape[-1] != x.shape[-1] or lora_b.shape != (
            packed.shape[0], lora_a.shape[0]):
        raise ValueError(
            f"nvfp4_lora_linear: input K = {x.shape[-1]}, packed weight {tuple(packed.shape)}, lora_a "
            f"{tuple(lora_a.shape)}, lora_b {tuple(lora_b.shape)}: expected lora_a [R, K] and lora_b [N, R]")
    if torch.is_grad_enabled() and (x.requires_grad or lora_a.requires_grad or lora_b.requires_grad):
        base = nvfp4_linear(x, packed, scale, global_scale, bias, tiled=tiled)
        return (base + F.linear(F.linear(x.to(lora_a.dtype), lora_a), lora_b) * lora_scale).to(x.dtype)
    if tiled:
        backend = _tiled_backend(x, packed)
        if backend is not None:
            return backend.forward_lora(x, packed, scale, global_scale, bias, lora_a, lora_b, lora_scale, tiled=True)
        packed, scale = rows_of(packed, scale, True)
    backend = select_backend(x, packed)
    if backend is None or backend.forward_lora is None:
        return reference_lora_forward(x, packed, scale, global_scale, bias, lora_a, lora_b, lora_scale)
    return backend.forward_lora(x, packed, scale, global_scale, bias, lora_a, lora_b, lora_scale)
