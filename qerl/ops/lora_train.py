"""NVFP4 base + LoRA for training, as one autograd node.

``nvfp4_lora_train(x, packed, scale, global_scale, bias, lora_a, lora_b, lora_scale)`` computes

    y = x · Ŵᵀ + bias + s · (x · Aᵀ) · Bᵀ          (QeRL's LoRA layer on the frozen NVFP4 base Ŵ, paper Eq. 1)

with ``x [..., K]`` bf16/fp16, ``packed uint8 [N, K/2]``, ``scale float8_e4m3fn [N, K/16]``, ``global_scale
float32 [1]``, ``lora_a [R, K]`` and ``lora_b [N, R]`` the trainable masters in any dtype (fp32 for the
optimizer): they are applied in ``x.dtype`` and their gradients arrive in their own dtype. Returns ``y [..., N]``
in ``x.dtype``.

Why one node: the readable definition, :func:`reference_lora_train` (the base through
:func:`qerl.ops.nvfp4_linear`, the adapters through two ``F.linear`` on bf16 casts of the masters), records seven
autograd nodes and ~26 launches per projection in forward + backward; at training micro-batches (M ≈ 2-5 k
rows) the step is then bound by host time, not by the GPU (reports/step/README.md). Here the forward is one
backend call that adds ``s · xa · Bᵀ`` to the base product (the dequantize + cuBLAS path adds it with one
``addmm_``), and the backward

    dX = dY · Ŵ + (s · dY · B) · A        dA = (s · dY · B)ᵀ · X        dB = dYᵀ · (s · X · Aᵀ)

is one backend call for ``dX`` (with the LoRA term) and two small GEMMs. Saved for backward: ``x`` (which the
adapters' ``F.linear`` saves in the reference as well) and ``xa = x · Aᵀ`` ``[..., R]``; never a copy of Ŵ.
Rounding: each product is rounded to ``x.dtype`` once where the reference rounds the base, the delta and
their sum separately, so the two agree to bf16 rounding, not bit for bit (tests/ops/test_lora_train.py).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from qerl.ops.linear import (_tiled_backend, nvfp4_linear, reference_backward_input, reference_forward, rows_of,
                              select_backend)


def reference_lora_train(x, packed, scale, global_scale, bias, lora_a, lora_b, lora_scale, tiled: bool = False):
    """The definition: ``nvfp4_linear(x) + s · (x · A'ᵀ) · B'ᵀ`` with ``A' = A.to(x.dtype)``, ``B'`` likewise,
    all differentiable (PEFT's LoRA layer with its adapters cast to the activation dtype)."""
    base = nvfp4_linear(x, packed, scale, global_scale, bias, tiled=tiled)
    return base + F.linear(F.linear(x, lora_a.to(x.dtype)), lora_b.to(x.dtype)) * lora_scale


def _forward_xa(x2, packed, scale, gs, bias, xa, b, s, a=None, tiled=False):
    """``x2 · Ŵᵀ + bias + s · xa · bᵀ`` (``x2 [M, K]``, ``xa = x2 · aᵀ [M, R]``) on the backend, or the reference.
    With ``a``, a backend with ``forward_lora_xa`` computes it as its no-grad ``forward_lora`` would, bit for bit.
    ``tiled``: weights in the tile-contiguous layout (only where the kernels take them: :func:`nvfp4_lora_train`)."""
    backend = select_backend(x2, packed)
    kw = {"tiled": True} if tiled else {}
    if a is not None and backend is not None and backend.forward_lora_xa is not None:
        return backend.forward_lora_xa(x2, packed, scale, gs, bias, a, xa, b, s, **kw)
    if backend is not None and backend.forward_xa is not None:
        return backend.forward_xa(x2, packed, scale, gs, bias, xa, b, s, **kw)
    return torch.addmm(reference_forward(x2, packed, scale, gs, bias), xa, b.t(), alpha=s)


def _backward_lora(d2, packed, scale, gs, dyb, a, s, tiled=False):
    """``d2 · Ŵ + s · dyb · a`` (``d2 [M, N]``, ``dyb [M, R]``) on the backend, or the reference."""
    backend = select_backend(d2, packed)
    if backend is not None and backend.backward_input_lora is not None:
        return backend.backward_input_lora(d2, packed, scale, gs, dyb, a, s, **({"tiled": True} if tiled else {}))
    return torch.addmm(reference_backward_input(d2, packed, scale, gs), dyb, a, alpha=s)


def _dense_forward(x2, w, bias, xa, b, s):
    """``_forward_xa`` on a dense ``w [N, K]`` (the base dequantized once per update phase): the products of the
    dequantize + cuBLAS path at one window, on the kept weight."""
    out = torch.mm(x2, w.t()) if bias is None else torch.addmm(bias, x2, w.t())
    return out.addmm_(xa, b.t(), alpha=s)


class _NVFP4LoraFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, packed, scale, gs, bias, lora_a, lora_b, lora_scale, casts=None, dense=None, tiled=False):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        a, b = casts if casts is not None else (lora_a.to(x.dtype), lora_b.to(x.dtype))
        xa = x2 @ a.t()  # [M, R]
        bias = None if bias is None else bias.to(x.dtype)
        if dense is not None:
            y = _dense_forward(x2, dense, bias, xa, b, lora_scale)
        else:
            y = _forward_xa(x2, packed, scale, gs, bias, xa, b, lora_scale, a, tiled)
        ctx.save_for_backward(x2, xa, a, b, packed, scale, gs, dense)
        ctx.lora_scale, ctx.shape, ctx.tiled = lora_scale, shape, tiled
        ctx.dtypes = (lora_a.dtype, lora_b.dtype)
        return y.reshape(*shape[:-1], packed.shape[0])

    @staticmethod
    def backward(ctx, dy):
        x2, xa, a, b, packed, scale, gs, dense = ctx.saved_tensors
        s = ctx.lora_scale
        d2 = dy.reshape(-1, dy.shape[-1]).contiguous()
        dyb = d2 @ b  # [M, R]: dY · B
        grad_x = grad_a = grad_b = grad_bias = None
        if ctx.needs_input_grad[0]:
            if dense is not None:
                grad_x = torch.mm(d2, dense).addmm_(dyb, a, alpha=s).reshape(ctx.shape)
            else:
                grad_x = _backward_lora(d2, packed, scale, gs, dyb, a, s, ctx.tiled).reshape(ctx.shape)
        if ctx.needs_input_grad[4]:  # a bias is frozen in every method, but stay correct if not
            grad_bias = d2.sum(0)
        # s folded into the GEMMs (beta = 0: the first operand only gives shape and dtype)
        if ctx.needs_input_grad[5]:
            grad_a = torch.addmm(a, dyb.t(), x2, beta=0, alpha=s).to(ctx.dtypes[0])  # [R, K] = s · (dY·B)ᵀ · X
        if ctx.needs_input_grad[6]:
            grad_b = torch.addmm(b, d2.t(), xa, beta=0, alpha=s).to(ctx.dtypes[1])  # [N, R] = s · dYᵀ · (X·Aᵀ)
        return grad_x, None, None, None, grad_bias, grad_a, grad_b, None, None, None, None


def nvfp4_lora_train(x, packed, scale, global_scale, bias, lora_a, lora_b, lora_scale: float,
                     casts: tuple[torch.Tensor, torch.Tensor] | None = None,
                     dense: torch.Tensor | None = None, *, tiled: bool = False) -> torch.Tensor:
    """``x · Ŵᵀ + bias + s · (x · Aᵀ) · Bᵀ`` as one autograd node (module docstring: shapes, dtypes, the
    backward). ``casts``: ``(A, B)`` already in ``x.dtype`` (detached; the LoRA layer keeps them for a whole
    optimizer step), else cast here on every call. ``dense``: ``Ŵ [N, K]`` in ``x.dtype``, dequantized once and
    kept by the caller (:func:`qerl.models.nvfp4_linear.dense_base`: the update phase with memory to spare) — the
    forward and ``dX`` then multiply it directly instead of dequantizing per call (the same products as the
    dequantize + cuBLAS path). Falls back to :func:`reference_lora_train` for fp32 activations (CPU training),
    where the one-node path has nothing to save. ``tiled``: the weight in the tile-contiguous layout (the kernels read
    it as it lies; any other path computes on a row-major copy)."""
    if x.shape[-1] != packed.shape[1] * 2 or lora_a.shape[-1] != x.shape[-1] or tuple(lora_b.shape) != (
            packed.shape[0], lora_a.shape[0]):
        raise ValueError(
            f"nvfp4_lora_train: input K = {x.shape[-1]}, packed weight {tuple(packed.shape)}, lora_a "
            f"{tuple(lora_a.shape)}, lora_b {tuple(lora_b.shape)}: expected lora_a [R, K] and lora_b [N, R]")
    if tiled and dense is None and _tiled_backend(x, packed) is None:
        packed, scale = rows_of(packed, scale, True)
        tiled = False
    if x.dtype not in (torch.bfloat16, torch.float16):
        return reference_lora_train(x, packed, scale, global_scale, bias, lora_a, lora_b, lora_scale, tiled)
    if dense is not None and (dense.dtype != x.dtype or tuple(dense.shape) != (packed.shape[0], x.shape[-1])):
        raise ValueError(f"nvfp4_lora_train: dense weight {dense.dtype} {tuple(dense.shape)}, expected {x.dtype} "
                         f"{(packed.shape[0], x.shape[-1])}")
    return _NVFP4LoraFn.apply(x, packed, scale, global_scale, bias, lora_a, lora_b, float(lora_scale), casts, dense,
                              tiled and dense is None)
