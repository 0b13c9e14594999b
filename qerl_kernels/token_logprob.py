"""Per-token log-probs (and entropies) of fp32 logits, and their gradient, in one pass each: the trainer's
``log π(o_t | q, o_<t)`` (paper Eq. 1–3) without the ~15 passes torch makes over a ``[n, V]`` block.

The definition (torch's composite, :func:`qerl.ops.logits._chunk_logprobs`: the CPU path and the reference), with
``z = logits · τ``, ``τ = float32(1 / T)``:

    lse = log Σ_v exp(z_v)            lp = z_target - lse          ent = lse - Σ_v softmax(z)_v · z_v
    ∂lp / ∂logits_v = τ · (1[v = target] - exp(z_v - lse))       (the entropy is not differentiated: the trainer
                                                                  logs it, detached)

:func:`_forward_kernel`: one program per row streams the row once with an online log-sum-exp (running max ``m``,
``s = Σ exp(z - m)``, ``w = Σ exp(z - m) · z``, rescaled whenever ``m`` grows) -> ``lp``, ``ent`` and ``lse`` (kept for
the backward). :func:`_grad_kernel`: programs over (row, vocabulary block) write ``g · ∂lp / ∂logits`` straight in the
activations' dtype (bf16), the operand of the lm_head's backward GEMM. torch's composite (``logits · τ``,
``log_softmax``, ``gather``, ``exp · lsm`` for the entropy, and in the backward the recomputation, the gather's
scatter into zeros, ``log_softmax``'s backward, the scaling and a cast) reads or writes the fp32 block ~15 times; at
V = 151,936 one 1,024-token block is 0.62 GB, so the 0.5B update's ~14 k tokens spent ~150 ms of its ~540 ms of GPU
time there (H100 profile, reports/step). The sums run in a different order from torch's: ``lp`` differs from
``log_softmax`` by a few fp32 ulps (as :mod:`qerl_kernels.sample`'s, the rollout engine's, does).

Shapes / dtypes: ``logits [n, V]`` fp32 (unit column stride), ``targets [n]`` int64 (any strides; clamped to ``[0, V)``: masked
positions may hold any id), ``g [n]`` fp32 -> ``lp, ent, lse [n]`` fp32; ``dlogits [n, V]`` in ``dtype``. Runs in the
CPU interpreter (``TRITON_INTERPRET=1``; the tests).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from qerl_kernels import launch

BLOCK = 2048  # vocabulary entries per loop iteration of the forward program
GRAD_BLOCK = 4096  # vocabulary entries per backward program


@triton.jit
def _forward_kernel(logits_ptr, stride_n, tgt_ptr, lp_ptr, ent_ptr, lse_ptr, V, inv_t, ENTROPY: tl.constexpr,
                    BLOCK: tl.constexpr):
    """Row ``program_id(0)``: online log-sum-exp of ``z = logits · τ`` (and ``Σ exp(z - m) · z``) -> lp, ent, lse."""
    r = tl.program_id(0)
    row = logits_ptr + r.to(tl.int64) * stride_n
    m = tl.full([], float("-inf"), tl.float32)
    s = tl.full([], 0.0, tl.float32)
    w = tl.full([], 0.0, tl.float32)
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < V
        z = tl.load(row + offs, mask=mask, other=float("-inf")) * inv_t
        m_new = tl.maximum(m, tl.max(z, axis=0))
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        scale = tl.exp(m - shift)
        e = tl.exp(z - shift)
        s = s * scale + tl.sum(e, axis=0)
        if ENTROPY:
            w = w * scale + tl.sum(tl.where(mask, e * z, 0.0), axis=0)
        m = m_new
    lse = m + tl.log(s)
    t = tl.minimum(tl.maximum(tl.load(tgt_ptr + r), 0), V - 1)
    tl.store(lp_ptr + r, tl.load(row + t) * inv_t - lse)
    tl.store(lse_ptr + r, lse)
    if ENTROPY:
        tl.store(ent_ptr + r, lse - w / s)


@triton.jit
def _grad_kernel(logits_ptr, stride_n, tgt_ptr, g_ptr, lse_ptr, out_ptr, stride_on, V, inv_t, BLOCK: tl.constexpr):
    """Program (row r, block b): ``out[r, v] = g_r · τ · (1[v = target_r] - exp(logits[r, v] · τ - lse_r))``."""
    r = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < V
    z = tl.load(logits_ptr + r.to(tl.int64) * stride_n + offs, mask=mask, other=0.0) * inv_t
    lse = tl.load(lse_ptr + r)
    gt = tl.load(g_ptr + r) * inv_t
    t = tl.minimum(tl.maximum(tl.load(tgt_ptr + r), 0), V - 1)
    d = gt * (tl.where(offs == t, 1.0, 0.0) - tl.exp(z - lse))
    tl.store(out_ptr + r.to(tl.int64) * stride_on + offs, d.to(out_ptr.dtype.element_ty), mask=mask)


def forward(logits: torch.Tensor, targets: torch.Tensor, inv_t: float, entropy: bool):
    """``(lp, ent or None, lse)`` of ``logits [n, V]`` fp32 at ``targets [n]`` (see module docstring)."""
    n, V = logits.shape
    lp = torch.empty(n, device=logits.device, dtype=torch.float32)
    lse = torch.empty_like(lp)
    ent = torch.empty_like(lp) if entropy else lp
    if n:
        launch.run(_forward_kernel, (n,), (logits, logits.stride(0), targets.contiguous(), lp, ent, lse, V,
                                           float(inv_t)),
                   dict(ENTROPY=bool(entropy), BLOCK=BLOCK, num_warps=8))
    return lp, (ent if entropy else None), lse


def grad(logits: torch.Tensor, targets: torch.Tensor, g: torch.Tensor, lse: torch.Tensor, inv_t: float,
         dtype: torch.dtype) -> torch.Tensor:
    """``dlogits [n, V]`` in ``dtype``: ``g · ∂lp / ∂logits`` (see module docstring)."""
    n, V = logits.shape
    out = torch.empty(n, V, device=logits.device, dtype=dtype)
    if n:
        launch.run(_grad_kernel, (n, launch.cdiv(V, GRAD_BLOCK)),
                   (logits, logits.stride(0), targets.contiguous(), g.contiguous(), lse, out, out.stride(0), V,
                    float(inv_t)),
                   dict(BLOCK=GRAD_BLOCK, num_warps=8))
    return out

