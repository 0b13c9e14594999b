"""Pieces of one RL step, kept out of the loop so that it reads like pseudocode."""
from __future__ import annotations

import contextlib
import hashlib
import math
import random
import time

import torch

from qerl.data.tasks import format_prompt
from qerl.rl.advantages import informative_groups, overlong_penalty
from qerl.rollout import Rollout, generate, sequence_logprobs
from qerl.rollout.engine.runner import SPLIT
from qerl.train.dist import Dist, gather, share


from qerl.errors import TrainingError  # re-exported: qerl.train.steps.TrainingError


def derive_seed(*parts) -> int:
    """A stable 63-bit seed from any parts (run seed, step, round, purpose)."""
    h = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return int.from_bytes(h[:8], "little") >> 1


class PromptStream:
    """Endless, seeded stream of records: a fresh permutation per epoch; ``pos`` is resumable."""

    def __init__(self, records: list[dict], seed: int, pos: int = 0):
        if not records:
            raise ValueError("the training set is empty")
        self.records, self.seed, self.pos = records, seed, pos

    def take(self, n: int) -> list[dict]:
        out = []
        for _ in range(n):
            epoch, i = divmod(self.pos, len(self.records))
            order = list(range(len(self.records)))
            random.Random(derive_seed(self.seed, "epoch", epoch)).shuffle(order)
            out.append(self.records[order[i]])
            self.pos += 1
        return out


def _pad_cat(tensors: list[torch.Tensor], value: int, left: bool) -> torch.Tensor:
    width = max(t.shape[1] for t in tensors)
    padded = []
    for t in tensors:
        extra = width - t.shape[1]
        pad = t.new_full((t.shape[0], extra), value)
        padded.append(torch.cat([pad, t] if left else [t, pad], 1))
    return torch.cat(padded, 0)


def merge(parts: list[Rollout], pad_id: int) -> Rollout:
    """Concatenate rollouts (re-padding prompts on the left and completions on the right)."""
    if len(parts) == 1:
        return parts[0]
    return Rollout(
        _pad_cat([p.prompt_ids for p in parts], pad_id, True),
        _pad_cat([p.prompt_mask for p in parts], 0, True),
        _pad_cat([p.completion_ids for p in parts], pad_id, False),
        _pad_cat([p.completion_mask for p in parts], 0, False),
        _pad_cat([p.logprobs for p in parts], 0, False),
        torch.cat([p.truncated for p in parts]),
        [t for p in parts for t in p.texts],
    )


def select(r: Rollout, rows: torch.Tensor) -> Rollout:
    return Rollout(r.prompt_ids[rows], r.prompt_mask[rows], r.completion_ids[rows], r.completion_mask[rows],
                   r.logprobs[rows], r.truncated[rows], [r.texts[i] for i in rows.tolist()])


def rollout_to(r: Rollout, device) -> Rollout:
    return Rollout(r.prompt_ids.to(device), r.prompt_mask.to(device), r.completion_ids.to(device),
                   r.completion_mask.to(device), r.logprobs.to(device), r.truncated.to(device), list(r.texts))


ENGINE_SPLIT = {k: f"rollout_{k[:-2]}_seconds" for k in SPLIT}  # RolloutEngine.last_stats -> the step's metrics


def _engine_split(policy, before) -> dict:
    """The rollout engine's split of the generation just run (``ENGINE_SPLIT``), or {} when it did not run
    (``before``: its ``last_stats`` object before the call; the engine replaces it on every ``generate``)."""
    from qerl.rollout.engine import cached_engine

    eng = cached_engine(policy)
    if eng is None or eng.last_stats is before or not eng.last_stats:
        return {}
    return {name: float(eng.last_stats.get(k, 0.0)) for k, name in ENGINE_SPLIT.items()}


def _generate_share(policy, tokenizer, records, cfg, step, rounds, reward, aqn, sigma, d: Dist):
    """This rank's groups of one round (all of them on one process), generated and scored, then every rank's
    gathered in rank order: ``(rollout of the round's groups, [(reward, correct)] per row, generation seconds
    per rank, the engine's split of this round — the slowest rank's per part — or {})``. Rows draw with their
    global rows' seeds, so the result does not depend on the world size."""
    from qerl.rollout.engine import cached_engine

    G = cfg.algorithm.group_size
    mine = share(len(records), d)
    seed = derive_seed(cfg.seed, step, rounds, "rollout")
    t0 = time.perf_counter()
    ro, scores, split = None, [], {}
    if len(mine):
        prompts = [format_prompt(records[i]["prompt"], tokenizer, cfg.data.template) for i in mine]
        noise = aqn.noise(sigma, derive_seed(cfg.seed, step, rounds, "aqn")) if aqn else contextlib.nullcontext()
        eng = cached_engine(policy)
        before = None if eng is None else eng.last_stats
        with noise:
            ro = generate(policy, tokenizer, prompts, cfg.rollout, seed=seed, num_samples=G, first_row=mine.start * G)
        split = _engine_split(policy, before)
        scores = [reward.score(text, records[mine.start + i // G]["answer"]) for i, text in enumerate(ro.texts)]
    seconds = time.perf_counter() - t0
    if not d.on:
        return ro, scores, [seconds], split
    device = next(policy.parameters()).device
    parts = gather(d, (None if ro is None else rollout_to(ro, "cpu"), scores, seconds, split),
                   f"gathering the rollouts of step {step + 1}")
    ro = merge([rollout_to(p[0], device) for p in parts if p[0] is not None], tokenizer.pad_token_id)
    split = {k: max(p[3].get(k, 0.0) for p in parts) for k in set().union(*(p[3] for p in parts))}
    return ro, [sc for p in parts for sc in p[1]], [p[2] for p in parts], split


def collect_rollouts(policy, tokenizer, stream: PromptStream, cfg, step: int, reward, aqn, sigma: float,
                     d: Dist = Dist()):
    """Generate G completions for ``prompts_per_step`` prompts, score them, and (DAPO dynamic
    sampling) drop groups whose rewards are all equal, refilling with fresh prompts for up to
    ``max_refill_rounds`` extra rounds. Returns ``(rollout, rewards, stats)``; ``stats`` covers
    every sample generated this step. Under torchrun each rank generates its share of every round's groups
    and all ranks continue on the gathered round (:mod:`qerl.train.dist`): the same batch on every rank."""
    a = cfg.algorithm
    G, want = a.group_size, cfg.prompts_per_step
    kept, kept_rewards = [], []
    all_rewards, all_correct, all_len, all_trunc = [], [], [], []
    nll, n_tok = 0.0, 0
    rounds, groups_seen, gen_max, idle, split = 0, 0, 0.0, 0.0, {}
    while True:
        n_prompts = want - sum(len(k.texts) // G for k in kept) if rounds else want
        records = stream.take(n_prompts)
        ro, scores, seconds, part = _generate_share(policy, tokenizer, records, cfg, step, rounds, reward, aqn, sigma,
                                                    d)
        gen_max, idle = gen_max + max(seconds), idle + max(seconds) - min(seconds)
        split = {k: split.get(k, 0.0) + v for k, v in part.items()}
        rewards = torch.tensor([s[0] for s in scores], dtype=torch.float32)
        if a.overlong_penalty:
            rewards = rewards + overlong_penalty(ro.lengths.cpu(), cfg.rollout.max_new_tokens, a.overlong_cache)
        if not torch.isfinite(rewards).all():
            raise TrainingError(f"step {step}: non-finite reward from the reward function")
        all_rewards.append(rewards)
        all_correct.append(torch.tensor([s[1] for s in scores]))
        all_len.append(ro.lengths.cpu().float())
        all_trunc.append(ro.truncated.cpu().float())
        m = ro.completion_mask.bool()
        nll, n_tok = nll - float(ro.logprobs[m].double().sum()), n_tok + int(m.sum())
        groups_seen += n_prompts
        keep = informative_groups(rewards, G) if a.dynamic_sampling else torch.ones(n_prompts, dtype=torch.bool)
        rows = torch.nonzero(keep.repeat_interleave(G)).flatten()
        if len(rows):
            kept.append(select(ro, rows.to(ro.prompt_ids.device)))
            kept_rewards.append(rewards[rows])
        rounds += 1
        have = sum(len(k.texts) // G for k in kept)
        if not a.dynamic_sampling or have >= want or rounds > a.max_refill_rounds:
            break
    rewards_all = torch.cat(all_rewards)
    stats = {
        "reward_mean": float(rewards_all.mean()),
        "reward_std": float(rewards_all.std()) if rewards_all.numel() > 1 else 0.0,
        "accuracy": float(torch.cat(all_correct).float().mean()),
        "response_len_mean": float(torch.cat(all_len).mean()),
        "response_len_max": float(torch.cat(all_len).max()),
        "truncated_frac": float(torch.cat(all_trunc).mean()),
        # the rollout policy's own entropy, estimated by Monte Carlo: -mean log pi(sampled token) over the generated
        # tokens of every sample (an unbiased estimate of the sampling distribution's per-token entropy; the
        # trainer's "entropy" is the exact one of its recomputation on the kept batch)
        "rollout_entropy": nll / max(1, n_tok),
        "groups_generated": groups_seen,
        "rollout_rounds": rounds,
        "generated_tokens": int(torch.cat(all_len).sum()),
        "rollout_gen_seconds": gen_max,  # the slowest rank's generation + scoring, summed over rounds
        "rank_idle_seconds": idle,  # the fastest rank's wait for the slowest (0 on one process)
        **split,  # rollout engine only: its prefill / graph-capture / host-check seconds inside rollout_gen_seconds
    }
    if not kept:
        stats["groups_kept"] = 0
        return None, None, stats
    batch = merge(kept, tokenizer.pad_token_id)
    batch_rewards = torch.cat(kept_rewards)
    n_keep = min(want, len(batch.texts) // G) * G
    batch, batch_rewards = select(batch, torch.arange(n_keep, device=batch.prompt_ids.device)), batch_rewards[:n_keep]
    stats["groups_kept"] = n_keep // G
    return batch, batch_rewards, stats


def micro_batches(n: int, size: int):
    for s in range(0, n, size):
        yield slice(s, min(n, s + size))


@torch.no_grad()
def logprobs_no_grad(model, batch: Rollout, temperature: float, micro: int, rows: list[slice] | None = None,
                     packings: list | None = None, modules: list | None = None) -> torch.Tensor:
    """Log-probs ``[rows, T]`` of ``batch``'s completions in micro-batches of ``micro`` rows (or of the given
    row slices, concatenated in order); ``packings``: per micro-batch a :class:`qerl.ops.packed.Packing` (one packed
    row of its real tokens) or None (padded); ``modules``: ``list(model.modules())`` where walked already."""
    from qerl.lora import frozen_adapters
    from qerl.ops.packed import packed_scope

    rows = list(micro_batches(len(batch.texts), micro)) if rows is None else rows
    packings = packings or [None] * len(rows)
    scope = packed_scope(model) if any(p is not None for p in packings) else contextlib.nullcontext()
    with frozen_adapters(model, modules), scope:
        return torch.cat([sequence_logprobs(model, batch.prompt_ids[m], batch.prompt_mask[m], batch.completion_ids[m],
                                            batch.completion_mask[m], temperature, packing=pk)
                          for m, pk in zip(rows, packings)])


def warmup_cosine(optimizer, warmup: int, total: int, min_ratio: float):
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / max(1, warmup)
        t = (step - warmup) / max(1, total - warmup)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, t)))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def eight_bit(mode, device: str) -> str:
    """``optim.eight_bit`` as the run applies it, ``"true"`` / ``"false"``: ``auto`` is bitsandbytes' 8-bit AdamW on
    a GPU where bitsandbytes is installed. The one rule (:func:`qerl.train.runplan.resolve` writes it into a run's
    config; :func:`make_optimizer` applies it)."""
    import importlib.util

    if str(mode).lower() != "auto":
        return str(mode).lower()
    return "true" if device == "cuda" and importlib.util.find_spec("bitsandbytes") is not None else "false"


def make_optimizer(params, o, device: torch.device, shard: bool = False, foreach: bool | None = None):
    """AdamW (bitsandbytes' 8-bit one where ``o.eight_bit`` says so) over ``params`` (tensors, or param-group
    dicts). ``shard``: under torch.distributed, wrapped in :class:`torch.distributed.optim.ZeroRedundancyOptimizer`
    — each rank keeps and updates the states of its partition of ``params`` and broadcasts the updated values (the
    same step as one AdamW over all of them). ``foreach``: torch AdamW's multi-tensor path (default: on CUDA)."""
    eight = eight_bit(o.eight_bit, device.type) == "true"  # (a run's config arrives resolved: qerl.train.runplan)
    if eight:
        import bitsandbytes as bnb

        cls = bnb.optim.AdamW8bit
    else:
        cls = torch.optim.AdamW
    kw = dict(lr=o.lr, betas=(o.beta1, o.beta2), weight_decay=o.weight_decay)
    if foreach is not None and not eight:
        kw["foreach"] = foreach
    if shard:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(list(params), optimizer_class=cls, **kw)
    return cls(params, **kw)


def peak_memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
