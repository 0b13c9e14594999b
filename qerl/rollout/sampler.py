"""Reference rollout engine: batched autoregressive sampling with a KV cache on the policy model.

``generate(model, tokenizer, prompts, settings, seed, num_samples)`` samples ``num_samples``
completions per prompt (groups contiguous: rows ``i*G .. i*G+G-1`` belong to prompt i) and
returns tokens, masks and the per-token log-probs of the *sampling* policy (AQN noise included
when active), ``log softmax(logits / T)`` of the chosen token over the full vocabulary (top-k/top-p
change which tokens can be drawn, not the reported log-prob, as in vLLM/TRL). T = 0 is greedy.

This is the readable reference and the judge of the fast engine (:mod:`qerl.rollout.engine`), which runs
behind the same signature; :func:`qerl.rollout.generate` picks one (``SamplingSettings.engine``).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from qerl.rollout.sampling import SamplingSettings, row_budget, row_seeds, sample


@dataclass
class Rollout:
    """``N = len(prompts) * G`` samples. Tensors are on the model's device."""

    prompt_ids: torch.Tensor  # [N, P] left-padded
    prompt_mask: torch.Tensor  # [N, P]
    completion_ids: torch.Tensor  # [N, T] right-padded with pad id
    completion_mask: torch.Tensor  # [N, T] 1 for generated tokens (EOS included)
    logprobs: torch.Tensor  # [N, T] fp32 sampling-policy log-probs (0 on padding)
    truncated: torch.Tensor  # [N] bool: hit max_new_tokens without EOS / stop string
    texts: list[str] = field(default_factory=list)

    @property
    def lengths(self) -> torch.Tensor:
        return self.completion_mask.sum(1)


def encode_prompts(tokenizer, prompts: list[str], num_samples: int):
    """``(eos id, pad id, ids [N, P], mask [N, P])``: the prompts left-padded, each repeated ``num_samples``
    times in a row (groups contiguous), on the CPU. Shared by this sampler and the engine."""
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    old_side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    try:
        enc = tokenizer(list(prompts), return_tensors="pt", padding=True, add_special_tokens=False)
    finally:
        tokenizer.padding_side = old_side
    return (eos, pad, enc.input_ids.repeat_interleave(num_samples, 0),
            enc.attention_mask.repeat_interleave(num_samples, 0))


@torch.no_grad()
def generate(model, tokenizer, prompts: list[str], settings: SamplingSettings, seed: int = 0,
             num_samples: int = 1, first_row: int = 0, eos_at=None) -> Rollout:
    """Sample ``num_samples`` completions per prompt (see module docstring). Row ``i`` draws with the seed of
    global row ``first_row + i`` (:func:`qerl.rollout.sampling.row_seeds`: Gumbel-max on counter-based
    uniforms, the engine's draw), so a row's tokens do not depend on which other rows share the call. The
    adapters do not change during a rollout: their activation-dtype copies are made once
    (:func:`qerl.lora.frozen_adapters`). ``eos_at`` (benchmarks): one length per row at which the row ends as if
    it had sampled EOS (as in the engine)."""
    from qerl.lora import frozen_adapters

    with frozen_adapters(model):
        return _generate(model, tokenizer, prompts, settings, seed, num_samples, first_row, eos_at)


def _generate(model, tokenizer, prompts, settings, seed, num_samples, first_row, eos_at=None) -> Rollout:

    from transformers import DynamicCache

    from qerl.ops.logits import head_logits

    device = next(model.parameters()).device
    eos, pad, ids, mask = encode_prompts(tokenizer, prompts, num_samples)
    ids, mask = ids.to(device), mask.to(device)
    n = ids.shape[0]
    seeds = row_seeds(seed, first_row, n).to(device)
    cache = DynamicCache()
    attn = mask.clone()
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    decoder = model.get_decoder()
    out = decoder(input_ids=ids, attention_mask=attn, position_ids=pos, past_key_values=cache, use_cache=True)
    logits = head_logits(model, out.last_hidden_state[:, -1, :])
    next_pos = pos[:, -1] + 1
    tokens, logps, alive_cols = [], [], []
    finished = torch.zeros(n, dtype=torch.bool, device=device)
    stop_hit = torch.zeros(n, dtype=torch.bool, device=device)
    budget = torch.tensor(row_budget(eos_at, n, settings.max_new_tokens), device=device)
    max_stop = max((len(tokenizer.encode(x, add_special_tokens=False)) for x in settings.stop), default=0)
    for step in range(settings.max_new_tokens):
        tok, lp = sample(logits, settings, seeds, torch.tensor(step, device=device))
        alive = ~finished
        tok = torch.where(alive, tok, torch.full_like(tok, pad))
        tokens.append(tok)
        logps.append(torch.where(alive, lp, torch.zeros_like(lp)))
        alive_cols.append(alive)
        finished = finished | (tok == eos)
        if settings.stop:
            for i in torch.nonzero(alive & ~finished).flatten().tolist():
                tail = tokenizer.decode(torch.stack(tokens[-(max_stop + 2):])[:, i].tolist())
                if any(s_ in tail for s_ in settings.stop):
                    stop_hit[i] = True
            finished = finished | stop_hit
        if eos_at is not None:  # a row at its eos_at length ends as with an EOS (below the max: not truncated)
            at = alive & ~finished & (budget == step + 1)
            stop_hit = stop_hit | (at & (budget < settings.max_new_tokens))
            finished = finished | at
        if bool(finished.all()) or step == settings.max_new_tokens - 1:
            break
        attn = torch.cat([attn, alive.to(attn.dtype)[:, None]], dim=1)
        out = decoder(input_ids=tok[:, None], attention_mask=attn, position_ids=next_pos[:, None],
                      past_key_values=cache, use_cache=True)
        logits = head_logits(model, out.last_hidden_state[:, -1, :])
        next_pos = next_pos + 1
    comp = torch.stack(tokens, 1)
    cmask = torch.stack(alive_cols, 1).to(torch.long)
    ended = (comp == eos).any(1) | stop_hit
    texts = [tokenizer.decode(comp[i][cmask[i].bool()].tolist(), skip_special_tokens=True) for i in range(n)]
    return Rollout(ids, mask, comp, cmask, torch.stack(logps, 1), ~ended, texts)


def live_columns(prompt_mask: torch.Tensor, completion_mask: torch.Tensor) -> tuple[int, int]:
    """``(p0, c1)``: the first prompt column (prompts are left-padded) and one past the last completion column
    (completions right-padded) that hold a real token in any row of these masks ``[N, P]`` / ``[N, T]`` — the
    columns outside are padding in every row, so the model need not run on them (keeps >= 1 column of each)."""
    return columns_of(row_spans(prompt_mask, completion_mask), slice(None), prompt_mask.shape[1])


def row_spans(prompt_mask: torch.Tensor, completion_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row (on the CPU, one host sync for a whole batch): its first prompt column (``P`` if none) and one past
    its last completion column (0 if none) — :func:`live_columns` of any set of rows is then
    ``(min(first[rows]), max(end[rows]))`` clamped as there, with no further sync (:func:`columns_of`)."""
    P, T = prompt_mask.shape[1], completion_mask.shape[1]
    first = torch.where(prompt_mask.bool(), torch.arange(P, device=prompt_mask.device), P).amin(1)
    end = torch.where(completion_mask.bool(), torch.arange(1, T + 1, device=completion_mask.device), 0).amax(1)
    return torch.stack([first, end]).cpu().unbind(0) if P and T else (torch.zeros(len(prompt_mask), dtype=torch.long),
                                                                      torch.full((len(prompt_mask),), T))


def columns_of(spans: tuple[torch.Tensor, torch.Tensor], rows, P: int) -> tuple[int, int]:
    """:func:`live_columns` of ``rows`` (a slice or CPU index tensor) from :func:`row_spans` of their batch."""
    first, end = spans
    return min(int(first[rows].min()), P - 1), max(int(end[rows].max()), 1)


def sequence_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask,
                      temperature: float = 1.0, with_entropy: bool = False, chunk: int = 1024,
                      columns: tuple[int, int] | None = None, packing=None):
    """Teacher-forced per-token log-probs ``[N, T]`` (fp32) of the completion tokens under
    ``model`` (and per-token entropies if asked). Same temperature scaling and fp32 lm_head as
    :func:`generate`. Differentiable; the logits exist only about ``chunk`` tokens at a time, forward and
    backward (:func:`qerl.ops.logits.token_logprobs`). The model runs only on the :func:`live_columns` of these
    rows — a micro-batch of a batch padded to its longest completion (a log-normal length distribution: most
    of it) costs its own longest row, not the batch's; the padded positions come back as 0 (one host sync, none when
    the caller passes them as ``columns``: :func:`columns_of`). ``packing``: a :class:`qerl.ops.packed.Packing` of
    these rows (on their device), or True to plan one here: the rows then run as one packed row of their real tokens
    (no padding; inside :func:`qerl.ops.packed.packed_scope`, which this enters if the caller has not). Rows without
    any completion token run padded (the output stays connected to the graph, as the padded path's is)."""
    from qerl.ops.logits import head_of, token_logprobs

    if packing is True:
        from qerl.ops.packed import plan

        packing = plan(prompt_mask.cpu(), completion_mask.cpu()).to(prompt_ids.device)
    if packing is not None and packing is not False and packing.pred.numel():  # (no completion token: padded)
        return _packed_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask, temperature,
                                with_entropy, chunk, packing)
    T = completion_ids.shape[1]
    p0, c1 = live_columns(prompt_mask, completion_mask) if columns is None else columns
    prompt_ids, prompt_mask = prompt_ids[:, p0:], prompt_mask[:, p0:]
    completion_ids, completion_mask = completion_ids[:, :c1], completion_mask[:, :c1]
    ids = torch.cat([prompt_ids, completion_ids], 1)
    attn = torch.cat([prompt_mask, completion_mask.to(prompt_mask.dtype)], 1)
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    p = prompt_ids.shape[1]
    hidden = model.get_decoder()(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=False).last_hidden_state
    head = head_of(model)
    if type(head) is not torch.nn.Linear:
        raise ValueError(f"sequence_logprobs needs a plain nn.Linear lm_head, got {type(head).__name__} "
                         "(an adapter on the lm_head is not supported)")
    logp, ent = token_logprobs(hidden[:, p - 1: -1], head.weight, completion_ids, temperature, head.bias,
                               with_entropy, chunk)
    logp = torch.nn.functional.pad(logp * completion_mask, (0, T - c1))
    if with_entropy:
        return logp, torch.nn.functional.pad(ent * completion_mask, (0, T - c1))
    return logp


def _packed_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask, temperature, with_entropy,
                     chunk, packing):
    """:func:`sequence_logprobs` of the rows run as one packed row (:mod:`qerl.ops.packed`)."""
    from qerl.ops import packed
    from qerl.ops.logits import head_of, token_logprobs

    N, T = completion_ids.shape
    flat = torch.cat([prompt_ids, completion_ids], 1).flatten()
    head = head_of(model)
    if type(head) is not torch.nn.Linear:
        raise ValueError(f"sequence_logprobs needs a plain nn.Linear lm_head, got {type(head).__name__} "
                         "(an adapter on the lm_head is not supported)")
    with packed.packed_scope(model):
        hidden = model.get_decoder()(
            input_ids=flat[packing.source][None], attention_mask=packed.placeholder_mask(flat.device),
            position_ids=packing.positions[None], use_cache=False, cu_seq_lens_q=packing.cu, cu_seq_lens_k=packing.cu,
            max_length_q=packing.max_len, max_length_k=packing.max_len).last_hidden_state
        lp, ent = token_logprobs(hidden[:, packing.pred], head.weight, flat[packing.target][None], temperature,
                                 head.bias, with_entropy, chunk)
    logp = lp.new_zeros(N, T).index_put((packing.rows, packing.cols), lp[0])
    if with_entropy:
        return logp, ent.new_zeros(N, T).index_put((packing.rows, packing.cols), ent[0])
    return logp
