"""Logits and per-token log-probs from final hidden states, never materialising ``[N, T, V]`` logits.

Both rollout paths (the engine and the reference sampler) and the trainer's teacher-forced recomputation
go through :func:`logits_fp32`, so that the sampling policy's log-probs and the trainer's are the same
function of the hidden state: the lm_head product accumulated in fp32 *and kept in fp32* (a bf16 logit
of magnitude 4–8 is rounded to 1/32–1/16, which shows up directly as a log-prob difference).

:func:`token_logprobs` is the trainer's path (paper Eq. 1–3 consume ``log π(o_t | q, o_<t)``): positions
in blocks of about ``chunk`` tokens, each block's fp32 logits recomputed in the backward
(``torch.utils.checkpoint``), so the memory per token is the hidden state, not ``V`` floats. On CUDA with bf16 / fp16
hidden states each block is one autograd node (:class:`_BlockLogprobs`): the fp32-output GEMM, then one Triton pass
for the log-probs and entropies and, in the backward, the GEMM again and one pass writing the gradient of the logits in
the activations' dtype (:mod:`qerl_kernels.token_logprob`; torch's composite, the CPU path, is its reference).
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

CHUNK_TOKENS = 1024  # tokens per logits block: [1024, 152064] fp32 = 0.62 GB
_MM_OUT_DTYPE: dict[int, bool] = {}


def _mm_fp32_ok(device: torch.device) -> bool:
    """Whether ``torch.mm(..., out_dtype=torch.float32)`` runs on this CUDA device (probed once, outside
    any graph capture)."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _MM_OUT_DTYPE:
        try:
            a = torch.ones(2, 16, device=device, dtype=torch.bfloat16)
            _MM_OUT_DTYPE[idx] = torch.mm(a, a.t(), out_dtype=torch.float32).dtype == torch.float32
        except (RuntimeError, TypeError, NotImplementedError):
            _MM_OUT_DTYPE[idx] = False
    return _MM_OUT_DTYPE[idx]


class _LogitsFP32(torch.autograd.Function):
    """``h [n, H]`` (bf16/fp16) · ``W [V, H]ᵀ`` -> fp32 ``[n, V]`` in one cuBLAS call (fp32 accumulate, fp32
    out). Backward: ``dh = dL · W`` in the activation dtype (as any bf16 layer), ``dW = dLᵀ · h`` if needed."""

    @staticmethod
    def forward(ctx, h, w):
        ctx.save_for_backward(h, w)
        return torch.mm(h, w.t(), out_dtype=torch.float32)

    @staticmethod
    def backward(ctx, g):
        h, w = ctx.saved_tensors
        dh = g.to(h.dtype) @ w if ctx.needs_input_grad[0] else None
        dw = g.t().to(h.dtype) @ h if ctx.needs_input_grad[1] else None
        return dh, dw


def logits_fp32(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``h [..., H]`` · ``weight [V, H]ᵀ`` (+ bias) -> fp32 logits ``[..., V]``, never rounded to bf16.

    CUDA bf16/fp16: one fp32-output GEMM. Elsewhere (CPU, fp32 models) the operands are upcast, which
    computes the same exact products with fp32 accumulation."""
    lead = h.shape[:-1]
    if h.is_cuda and h.dtype in (torch.bfloat16, torch.float16) and weight.dtype == h.dtype and _mm_fp32_ok(h.device):
        out = _LogitsFP32.apply(h.reshape(-1, h.shape[-1]), weight).reshape(*lead, weight.shape[0])
    else:
        out = F.linear(h.float(), weight.float())
    return out if bias is None else out + bias.float()


def head_of(model) -> nn.Module:
    """The output projection (lm_head) of a causal LM, PEFT-wrapped or not."""
    head = model.get_output_embeddings()
    if head is None or not hasattr(head, "weight"):
        raise ValueError(f"{type(model).__name__} has no output embedding (lm_head) to compute logits with")
    return head


def module_logits(head: nn.Module, h: torch.Tensor) -> torch.Tensor:
    """fp32 logits of ``h [..., H]`` through the lm_head module ``head``: :func:`logits_fp32` when it is a plain
    linear; a wrapped head (e.g. with an adapter) is called as a module and upcast."""
    if type(head) is nn.Linear:
        return logits_fp32(h, head.weight, head.bias)
    return head(h).float()


def head_logits(model, h: torch.Tensor) -> torch.Tensor:
    """fp32 logits of the hidden states ``h [..., H]`` through ``model``'s lm_head (:func:`module_logits`)."""
    return module_logits(head_of(model), h)


def _chunk_logprobs(h, weight, bias, targets, inv_t: float, with_entropy: bool):
    lg = logits_fp32(h, weight, bias) * inv_t
    lsm = lg.log_softmax(-1)
    lp = lsm.gather(-1, targets[..., None])[..., 0]
    if not with_entropy:
        return lp, None
    return lp, -(lsm.exp() * lsm).sum(-1)


class _BlockLogprobs(torch.autograd.Function):
    """One block of :func:`token_logprobs` on CUDA: ``h [N, t, H]`` bf16/fp16 (a slice of the hidden states: saved
    as the view it is, no copy), ``weight [V, H]``, optional ``bias [V]``, ``targets [N, t]`` -> ``(lp [N, t],
    ent [N, t] or None)`` fp32, the fp32 logits never kept: the backward recomputes them (one GEMM) and
    :func:`qerl_kernels.token_logprob.grad` writes ``∂L/∂logits`` in ``h``'s dtype for ``dh = · W`` and
    ``dW = ·ᵀ h``. The entropy is returned detached."""

    @staticmethod
    def forward(ctx, h, weight, bias, targets, inv_t: float, with_entropy: bool):
        from qerl_kernels import token_logprob

        h2 = h.reshape(-1, h.shape[-1])
        lp, ent, lse = token_logprob.forward(_block_logits(h2, weight, bias), targets.reshape(-1), inv_t,
                                             with_entropy)
        ctx.save_for_backward(h, weight, bias, targets, lse)
        ctx.inv_t = inv_t
        if ent is not None:
            ent = ent.view(targets.shape)
            ctx.mark_non_differentiable(ent)
        return lp.view(targets.shape), ent

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        from qerl_kernels import token_logprob

        h, weight, bias, targets, lse = ctx.saved_tensors
        if g_lp is None:
            return None, None, None, None, None, None
        h2 = h.reshape(-1, h.shape[-1])
        d = token_logprob.grad(_block_logits(h2, weight, bias), targets.reshape(-1), g_lp.reshape(-1).float(), lse,
                               ctx.inv_t, h.dtype)
        dh = (d @ weight).view(h.shape) if ctx.needs_input_grad[0] else None
        dw = d.t() @ h2 if ctx.needs_input_grad[1] else None
        db = d.float().sum(0) if bias is not None and ctx.needs_input_grad[2] else None
        return dh, dw, db, None, None, None


def _block_logits(h, weight, bias):
    """fp32 ``h · weightᵀ (+ bias)``: one fp32-output GEMM on CUDA; the upcast product elsewhere (the interpreter)."""
    out = torch.mm(h, weight.t(), out_dtype=torch.float32) if h.is_cuda else h.float() @ weight.float().t()
    return out if bias is None else out.add_(bias.float())


def _fused_ok(hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :class:`_BlockLogprobs` runs: CUDA, bf16 / fp16 hidden states and weight of one dtype, the
    fp32-output GEMM available (or the Triton interpreter, for the tests)."""
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        return hidden.dtype in (torch.bfloat16, torch.float16) and weight.dtype == hidden.dtype and FUSED[0]
    return (FUSED[0] and hidden.is_cuda and hidden.dtype in (torch.bfloat16, torch.float16)
            and weight.dtype == hidden.dtype and _mm_fp32_ok(hidden.device))


FUSED = [True]  # the fused blocks on where they can run (the checks and the benchmark compare both)


def token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                   bias: torch.Tensor | None = None, with_entropy: bool = False, chunk: int = CHUNK_TOKENS):
    """Per-token ``log softmax(h·Wᵀ / T)[target]`` (and entropies) from hidden states, in blocks of positions.

    hidden ``[N, T, H]`` (the final norm applied), weight ``[V, H]``, targets ``[N, T]`` int64 ->
    (log-probs ``[N, T]`` fp32, entropies ``[N, T]`` fp32 detached, or None). Differentiable in ``hidden``
    (and ``weight`` if it requires grad); under autograd each block's logits are recomputed in the backward,
    so the peak is one ``[N, chunk / N, V]`` fp32 block (about ``chunk`` tokens) instead of ``[N, T, V]``.
    """
    inv_t = 1.0 / (temperature if temperature > 0 else 1.0)
    grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    step = max(1, chunk // max(1, hidden.shape[0]))
    lps, ents = [], []
    fused = _fused_ok(hidden, weight)
    for s in range(0, hidden.shape[1], step):
        args = (hidden[:, s:s + step], weight, bias, targets[:, s:s + step], inv_t, with_entropy)
        if fused:
            lp, ent = _BlockLogprobs.apply(*args)
            lps.append(lp)
            if with_entropy:
                ents.append(ent)
            continue
        if grad:
            lp, ent = checkpoint(_chunk_logprobs, *args, use_reentrant=False)
        else:
            lp, ent = _chunk_logprobs(*args)
        lps.append(lp)
        if with_entropy:
            ents.append(ent.detach())
    return torch.cat(lps, 1), (torch.cat(ents, 1) if with_entropy else None)
