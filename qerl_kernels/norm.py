"""A decoder layer's elementwise parts as Triton launches that can join the decode step's launch chain
(:func:`qerl_kernels.launch.chain`): RMSNorm, residual add + RMSNorm (each optionally with AQN noise) and the SiLU
gate. Compiled by ``torch.compile`` these were Inductor kernels, which a programmatic dependent launch cannot follow
into: every one of them ended the chain, three times per layer.

Definitions (transformers' Qwen2 / Llama eager forward, :mod:`qerl.rollout.engine.forward`; rows of ``x [M, H]``):

    s = x + d                                          (add: in fp32, rounded to x's dtype; stored)
    x̂ = (s · rsqrt(mean(s²) + eps)).to(dtype)          (fp32 statistics)
    y = w · x̂                                          (stock: the product in fp32, rounded to y's dtype)
    y = ((w + Z) · s · rsqrt(...)).to(dtype)           (AQN noise Z [H] fp32, paper Eq. 7: one rounding)
    silu_mul(g, u) = silu(g).to(dtype) · u             (SiLU in fp32, each product rounded as eager torch)

Shapes / dtypes: ``x``, ``d`` ``[M, H]`` (unit last stride, any row stride), ``w [H]``, ``Z [H]`` fp32; ``y``
``[M, H]`` contiguous in ``torch.promote_types(w, x)`` (stock) or x's dtype (noisy); ``g``, ``u [M, I]`` (views of
the fused gate/up output) -> ``[M, I]`` contiguous. One program per row (norms) or per (row, 1024-wide block)
(gate). ``pdl``: launched as a programmatic dependent — it releases the next launch at its start, loads ``w`` and
``Z`` (constants), then waits for the previous grid before reading ``x``. The readable references are
:func:`rms_reference` and :func:`silu_mul_reference`; the statistics' summation order differs from Inductor's and
eager torch's by rounding (the tests bound it).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.language.extra import libdevice
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from qerl_kernels import launch

GATE_BLOCK = 1024  # SiLU gate columns per program


def rms_reference(x, w, eps: float, d=None, z=None):
    """The definition in torch: ``y`` (and ``(s, y)`` with the residual ``d``)."""
    s = x if d is None else x + d
    sf = s.float()
    sf = sf * torch.rsqrt(sf.pow(2).mean(-1, keepdim=True) + eps)
    y = ((w.float() + z) * sf).to(s.dtype) if z is not None else w * sf.to(s.dtype)
    return y if d is None else (s, y)


def silu_mul_reference(g, u):
    return F.silu(g) * u


@triton.jit
def _rsqrt(v, FAST: tl.constexpr):
    if FAST:  # (libdevice, what Inductor calls; the CPU interpreter has no libdevice)
        return libdevice.rsqrt(v)
    return 1.0 / tl.sqrt(v)


@triton.jit
def _rms_kernel(x_ptr, d_ptr, w_ptr, z_ptr, s_ptr, y_ptr, H, stride_x, stride_d, stride_s, stride_y, eps,
                BLOCK: tl.constexpr, ADD: tl.constexpr, NOISY: tl.constexpr, PDL: tl.constexpr,
                FAST: tl.constexpr):
    """Row ``program_id(0)``: ``s = x + d`` (``ADD``; stored), ``y = w · x̂`` or ``(w + Z) · x̂`` (``NOISY``)."""
    if PDL:
        gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    if NOISY:
        z = tl.load(z_ptr + cols, mask=mask, other=0.0)
    if PDL:  # x (and d) come from the launches before this one
        gdc_wait()
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if ADD:
        d = tl.load(d_ptr + row * stride_d + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + d.to(tl.float32)).to(x.dtype)
        tl.store(s_ptr + row * stride_s + cols, x, mask=mask)
    xf = x.to(tl.float32)
    xn = xf * _rsqrt(tl.sum(xf * xf, 0) / H + eps, FAST)
    if NOISY:
        y = (w.to(tl.float32) + z) * xn
    else:
        y = w.to(tl.float32) * xn.to(x.dtype).to(tl.float32)
    tl.store(y_ptr + row * stride_y + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_mul_kernel(g_ptr, u_ptr, y_ptr, I, stride_g, stride_u, stride_y, BLOCK: tl.constexpr,
                     PDL: tl.constexpr):
    """Row ``program_id(0)``, columns ``program_id(1) · BLOCK …``: ``y = silu(g).to(dtype) · u``."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    g = tl.load(g_ptr + row * stride_g + cols, mask=mask, other=0.0)
    u = tl.load(u_ptr + row * stride_u + cols, mask=mask, other=0.0)
    gf = g.to(tl.float32)
    a = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
    tl.store(y_ptr + row * stride_y + cols, (a.to(tl.float32) * u.to(tl.float32)).to(g.dtype), mask=mask)


def _rows(t: torch.Tensor, name: str) -> torch.Tensor:
    """``t [..., H]`` as ``[M, H]`` (a view; the last stride must be 1)."""
    if t.stride(-1) != 1:
        raise ValueError(f"qerl_kernels.norm: {name} must have a unit last stride, got strides {t.stride()}")
    return t.reshape(-1, t.shape[-1])


def _pdl(x: torch.Tensor) -> bool:
    return launch.chained() and x.is_cuda


def _run(kernel, grid, args: tuple, kw: dict) -> None:
    """``launch.run`` inside a scope keyed on what the launch specialises on (the tensors' dtypes and 16-byte
    alignment, the integer arguments, the keywords), so that a repeated eager call (the engine's prefill, a decode step
    without graphs) takes the direct launch."""
    key = (kernel, tuple((a.dtype, a.data_ptr() % 16) if isinstance(a, torch.Tensor) else
                         (a if isinstance(a, int) else type(a)) for a in args), tuple(sorted(kw.items())))
    prev = launch.scope(key)
    try:
        launch.run(kernel, grid, args, kw)
    finally:
        launch.restore(prev)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, d: torch.Tensor | None = None,
             z: torch.Tensor | None = None):
    """RMSNorm of ``x [..., H]`` (module docstring): ``y``, or ``(s, y)`` with ``s = x + d`` when the residual ``d``
    is given; ``z`` (fp32 ``[H]``): AQN noise on the weight. One launch; a programmatic dependent inside
    :func:`qerl_kernels.launch.chain`."""
    H = x.shape[-1]
    if w.shape != (H,) or (d is not None and d.shape != x.shape) or (z is not None and z.shape != (H,)):
        raise ValueError(f"rms_norm: x {tuple(x.shape)} needs w [{H}], d like x and z [{H}]; got w {tuple(w.shape)}, "
                         f"d {None if d is None else tuple(d.shape)}, z {None if z is None else tuple(z.shape)}")
    x2 = _rows(x, "x")
    M = x2.shape[0]
    dtype = x.dtype if z is not None else torch.promote_types(w.dtype, x.dtype)
    y = torch.empty((M, H), device=x.device, dtype=dtype)
    s = torch.empty((M, H), device=x.device, dtype=x.dtype) if d is not None else y
    d2 = _rows(d, "d") if d is not None else x2
    pdl = _pdl(x)
    if M:
        _run(_rms_kernel, (M,), (x2, d2, w, z if z is not None else w, s, y, H, x2.stride(0), d2.stride(0),
                                       s.stride(0), y.stride(0), float(eps)),
                   dict(BLOCK=triton.next_power_of_2(H), ADD=d is not None, NOISY=z is not None, PDL=pdl,
                        FAST=x.is_cuda, num_warps=4 if H <= 4096 else 8, **({"launch_pdl": True} if pdl else {})))
    y = y.view(x.shape)
    return y if d is None else (s.view(x.shape), y)


def silu_mul(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """``silu(g) · u`` of ``g``, ``u [..., I]`` (same shape and dtype) in one launch (module docstring)."""
    if g.shape != u.shape or g.dtype != u.dtype:
        raise ValueError(f"silu_mul: g and u must match, got {tuple(g.shape)} {g.dtype} and {tuple(u.shape)} "
                         f"{u.dtype}")
    g2, u2 = _rows(g, "g"), _rows(u, "u")
    M, I = g2.shape
    y = torch.empty((M, I), device=g.device, dtype=g.dtype)
    pdl = _pdl(g)
    if M:
        _run(_silu_mul_kernel, (M, launch.cdiv(I, GATE_BLOCK)),
                   (g2, u2, y, I, g2.stride(0), u2.stride(0), y.stride(0)),
                   dict(BLOCK=GATE_BLOCK, PDL=pdl, num_warps=4, **({"launch_pdl": True} if pdl else {})))
    return y.view(g.shape)
