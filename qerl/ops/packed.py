"""Packed sequences: a micro-batch's rows run as one row of their real tokens, with no padding.

A GRPO batch padded to its longest prompt + completion spends much of its update on padding: log-normal completion
lengths (median 200, capped at 384) with 128-token prompts fill 68% of a ``[64, 512]`` batch, and every GEMM, norm,
rotary product and residual add of the forward and backward runs on all 32,768 positions (reports/step). Packed, the
same micro-batch is one row of the 22,333 real tokens: position ids restart at 0 for each sequence and attention is
causal within each sequence only (``cu_seq_lens``, the cumulative lengths), as in padding-free training elsewhere
(TRL's ``padding_free``, flash-attention's varlen API).

- :func:`plan` turns the masks of a micro-batch (on the CPU: no device sync) into the index tensors of its packed row.
- :func:`packed_attention` is the attention of a packed row: ``torch.nn.attention.varlen.varlen_attn`` (FlashAttention
  on CUDA) where it runs, else :func:`attention_reference` — ``scaled_dot_product_attention`` per sequence, the
  readable reference (CPU, tests).
- :func:`packed_scope` makes a transformers model call it: inside the block its config's attention implementation is
  ``"qerl_packed"`` (registered with transformers' ``AttentionInterface``), which runs :func:`packed_attention` for a
  call that carries ``cu_seq_lens_q`` and transformers' own SDPA attention (and SDPA mask) for any other call. Keep
  the block open until the backward has run: gradient checkpointing recomputes the attention there.

The packed row computes, for every real token, the same function as the padded batch (the same tokens, positions and
causal context); only the float summation order differs (other GEMM shapes, another attention kernel).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools

import torch
import torch.nn.functional as F

NAME = "qerl_packed"
# packed_sequences auto packs a micro-batch whose padded forward runs at least this many times its real tokens. H100
# (reports/step): 0.5B, one micro-batch of 64 at 1.47x: update 0.48 -> 0.37 s (QeRL), 0.51 -> 0.43 (bf16 LoRA); 7B,
# micro-batches of 4 length-sorted rows (little padding): QeRL 3.93 -> 3.87 s, bf16 LoRA 3.98-4.29 ->
# 4.09-4.79 s (no gain: that update waits on its host, not the GPU)
PACK_RATIO = 1.25


@dataclasses.dataclass
class Packing:
    """Where a micro-batch's tokens go in its packed row (``S`` real tokens, ``Nc`` completion tokens).

    ``source [S]``: flat index of each packed token in ``cat([prompt_ids, completion_ids], 1)`` (row-major);
    ``positions [S]``: its position id (0 at each sequence's first real token); ``cu [N + 1]`` int32: cumulative
    sequence lengths (``cu_seq_lens``); ``max_len``: the longest sequence; ``pred [Nc]``: the packed index whose hidden
    state predicts each completion token (the token before it, in the same sequence); ``target [Nc]``: the flat index
    of that completion token; ``rows, cols [Nc]``: its place in the ``[N, T]`` completion grid."""

    source: torch.Tensor
    positions: torch.Tensor
    cu: torch.Tensor
    max_len: int
    pred: torch.Tensor
    target: torch.Tensor
    rows: torch.Tensor
    cols: torch.Tensor

    def to(self, device) -> Packing:
        return Packing(**{f.name: (v.to(device, non_blocking=True) if torch.is_tensor(v) else v)
                          for f in dataclasses.fields(self) for v in [getattr(self, f.name)]})


def plan(prompt_mask: torch.Tensor, completion_mask: torch.Tensor) -> Packing:
    """The packing of rows with masks ``prompt_mask [N, P]`` and ``completion_mask [N, T]`` (1 = a real token; CPU
    tensors: this reads them on the host). A token is in its sequence's context exactly where the padded forward's
    attention mask (the two masks side by side) is 1, and its position id is the padded forward's
    (``cumsum(mask) - 1``). Raises ValueError for a row whose first real token is a completion token (nothing before
    it to predict it from)."""
    if prompt_mask.device.type != "cpu" or completion_mask.device.type != "cpu":
        raise ValueError("packed.plan reads the masks on the host: pass CPU tensors (one copy per batch)")
    N, P = prompt_mask.shape
    attn = torch.cat([prompt_mask.bool(), completion_mask.bool()], 1)
    L = attn.shape[1]
    source = attn.flatten().nonzero().squeeze(1)
    positions = (attn.long().cumsum(1) - 1).flatten()[source]
    lens = attn.sum(1)
    cu = torch.zeros(N + 1, dtype=torch.int32)
    cu[1:] = lens.cumsum(0)
    is_comp = (source % L) >= P
    k = is_comp.nonzero().squeeze(1)  # packed indices of the completion tokens
    row_of = source // L
    orphan = (k == 0) | (row_of[(k - 1).clamp(min=0)] != row_of[k])
    if bool(orphan.any()):
        r = int(row_of[k[orphan][0]])
        raise ValueError(f"packed sequences: row {r} has no prompt token before its first completion token, so "
                         "nothing predicts it (give every row at least one prompt token)")
    target = source[k]
    return Packing(source=source, positions=positions, cu=cu, max_len=int(lens.max()) if N else 0, pred=k - 1,
                   target=target, rows=target // L, cols=target % L - P)


def padding_ratio(prompt_mask: torch.Tensor, completion_mask: torch.Tensor) -> float:
    """Positions the padded forward of these rows runs (rows x their live columns, as
    :func:`qerl.rollout.sampler.live_columns` trims them) over their real tokens (CPU masks; inf for no token)."""
    attn = torch.cat([prompt_mask.bool(), completion_mask.bool()], 1)
    real = int(attn.sum())
    live = attn.any(0).nonzero()
    if not real:
        return float("inf")
    return attn.shape[0] * (int(live[-1]) - int(live[0]) + 1) / real


def attention_reference(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu: torch.Tensor,
                        scale: float | None) -> torch.Tensor:
    """Causal attention within each packed sequence, one ``scaled_dot_product_attention`` per sequence.

    query ``[1, H, S, D]``, key / value ``[1, Hkv, S, D]`` (``H % Hkv == 0``), ``cu [N + 1]`` -> ``[1, S, H, D]``."""
    bounds = cu.tolist()
    gqa = query.shape[1] != key.shape[1]
    outs = [F.scaled_dot_product_attention(query[:, :, s:e], key[:, :, s:e], value[:, :, s:e], is_causal=True,
                                           scale=scale, enable_gqa=gqa)
            for s, e in zip(bounds[:-1], bounds[1:]) if e > s]
    return torch.cat(outs, 2).transpose(1, 2) if outs else query.transpose(1, 2)


@functools.cache
def _varlen():
    """``(varlen_attn, whether it takes window_size, whether it takes enable_gqa)`` where torch has the varlen API
    (torch 2.13 takes both; older versions ``is_causal``, and K / V repeated to the query heads), else None."""
    try:
        import inspect

        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    return varlen_attn, "window_size" in params, "enable_gqa" in params


def varlen_ok(device: torch.device, dtype: torch.dtype | None = None) -> bool:
    """Whether :func:`packed_attention` runs FlashAttention's varlen kernel here: CUDA, torch's varlen API, and
    activations in bf16 / fp16 (``dtype``, when given; fp32 ones take :func:`attention_reference`)."""
    return (torch.device(device).type == "cuda" and _varlen() is not None
            and (dtype is None or dtype in (torch.bfloat16, torch.float16)))


def packed_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None,
                     cu_seq_lens_q=None, max_length_q=None, **kwargs):
    """The ``"qerl_packed"`` attention function (transformers' ``AttentionInterface`` signature): query ``[1, H, S,
    D]``, key / value ``[1, Hkv, S, D]`` of a packed row -> (``[1, S, H, D]``, None). A call without
    ``cu_seq_lens_q`` is an ordinary padded one: transformers' SDPA attention."""
    if cu_seq_lens_q is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      sliding_window=sliding_window, **kwargs)
    if sliding_window is not None:
        raise ValueError("packed sequences do not support sliding-window attention; set packed_sequences: false")
    if dropout and module.training:
        raise ValueError("packed sequences do not support attention dropout; set packed_sequences: false")
    if not varlen_ok(query.device, query.dtype):
        return attention_reference(query, key, value, cu_seq_lens_q, scaling), None
    fn, window, gqa = _varlen()
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [S, H, D]
    if not gqa and k.shape[1] != q.shape[1]:
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    extra = {"window_size": (-1, 0)} if window else {"is_causal": True}
    if gqa:
        extra["enable_gqa"] = True
    out = fn(q, k, v, cu_seq_lens_q, cu_seq_lens_q, max_length_q, max_length_q, scale=scaling, **extra)
    return out[None], None


@functools.cache
def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, packed_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)  # (an unpacked call inside the block: SDPA's own mask)


@contextlib.contextmanager
def packed_scope(model):
    """Inside the block ``model`` (a transformers model, or a PEFT / DDP wrapper of one) can run packed rows (its
    attention implementation is ``"qerl_packed"``; unpacked calls behave as under SDPA). Re-entrant."""
    config = config_of(model)
    old = config._attn_implementation
    if old == NAME:
        yield
        return
    if old not in (None, "sdpa"):
        raise ValueError(f"packed sequences need the model's SDPA attention, got attn_implementation={old!r}; set "
                         "packed_sequences: false")
    _register()
    config._attn_implementation = NAME
    try:
        yield
    finally:
        config._attn_implementation = old


def config_of(model):
    """The transformers config whose attention implementation ``model``'s decoder reads (``model`` may be a PEFT or
    DDP wrapper)."""
    for m in (model, getattr(model, "module", None)):
        dec = getattr(m, "get_decoder", None)
        if dec is not None:
            return dec().config
    raise ValueError(f"packed sequences: {type(model).__name__} has no get_decoder()")


def placeholder_mask(device) -> torch.Tensor:
    """The attention mask a packed forward passes: a 4-D mask, which transformers hands to the attention function as
    it is (no ``[S, S]`` mask is built); empty, so that any attention that would read it fails loudly."""
    return torch.ones(1, 1, 0, 0, dtype=torch.bool, device=device)
