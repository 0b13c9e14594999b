"""The update phase of one RL step: old (and reference) log-probs, then μ policy updates over micro-batches.

:func:`update_policy` is what ``qerl train`` runs after each rollout and what ``qerl bench step`` times, so the
benchmark measures the trainer's own code. Under torchrun each rank runs its share of the micro-batches
(:func:`rank_micro_batches`); the strategy object of :mod:`qerl.train.sharding` decides how gradients meet.

Paper (QeRL eq. 2-3, GRPO / DAPO): advantages ``Â_i = (r_i - mean(r)) / std(r)`` within each group of G; the
clipped surrogate ``min(ρ Â, clip(ρ, 1-ε_low, 1+ε_high) Â)`` with ``ρ = π_θ / π_old`` per token
(:func:`qerl.rl.losses.policy_loss`).
"""
from __future__ import annotations

import contextlib
import math

import torch

from qerl.errors import TrainingError
from qerl.lora import frozen_adapters
from qerl.models.nvfp4_linear import dense_base
from qerl.ops.packed import packed_scope
from qerl.rl.advantages import group_advantages
from qerl.rl.losses import LossSettings, micro_weight, mismatch_stats, policy_loss, truncated_is_weights
from qerl.rollout.sampler import columns_of, row_spans, sequence_logprobs
from qerl.train import dist, sharding
from qerl.train.fused import fused_elementwise
from qerl.train.modes import set_training
from qerl.train.plan import update_tokens
from qerl.train.steps import derive_seed, logprobs_no_grad


def _no_phase(name: str):
    return contextlib.nullcontext()


class LogprobModule(torch.nn.Module):
    """The update's forward as a module (what DDP wraps under torchrun): teacher-forced log-probs and entropies
    of completions under ``policy`` (:func:`qerl.rollout.sequence_logprobs`)."""

    def __init__(self, policy, with_entropy: bool = True):
        super().__init__()
        self.policy, self.with_entropy = policy, with_entropy

    def forward(self, prompt_ids, prompt_mask, completion_ids, completion_mask, temperature: float = 1.0,
                columns: tuple[int, int] | None = None, packing=None):
        return sequence_logprobs(self.policy, prompt_ids, prompt_mask, completion_ids, completion_mask, temperature,
                                 with_entropy=self.with_entropy, columns=columns, packing=packing)


class Diagnostics:
    """The loss diagnostics of the first update pass (:func:`qerl.rl.losses.policy_loss`'s ``info``), combined over
    micro-batches so that they are the whole batch's however it is cut: ``pg_loss`` by each micro-batch's loss weight
    (as the loss), the token means (``clip_frac``, ``ratio_mean``, ``kl``, ``entropy``) by its share of the batch's
    loss tokens, ``ratio_min`` / ``ratio_max`` as the extremes over micro-batches with tokens (1 where none has any).
    The values stay on the device until :meth:`result`."""

    EXTREMES = {"ratio_min": (torch.amin, min), "ratio_max": (torch.amax, max)}

    def __init__(self):
        self.sums: dict = {}
        self.extremes: dict = {}

    def add(self, info: dict, weight: float, token_share: float) -> None:
        for key, v in info.items():
            if key in self.EXTREMES:
                if token_share > 0:
                    self.extremes.setdefault(key, []).append(v)
            else:
                self.sums[key] = self.sums.get(key, 0.0) + v.double() * (weight if key == "pg_loss" else token_share)

    def result(self, d: dist.Dist, loss: float, what: str) -> dict:
        """Every rank's diagnostics combined (sums over ranks, extremes over ranks; one gather) and the batch ``loss``
        summed."""
        keys = list(self.sums)
        sums = dict(zip(keys, torch.stack([torch.as_tensor(self.sums[k], dtype=torch.float64) for k in keys]).tolist()
                        )) if keys else {}
        mine = {"sums": {**sums, "loss": loss},
                "extremes": {k: float(self.EXTREMES[k][0](torch.stack(v))) for k, v in self.extremes.items()}}
        parts = dist.gather(d, mine, what)
        out = {k: sum(p["sums"][k] for p in parts) for k in mine["sums"]}
        if keys:
            for k, (_, pick) in self.EXTREMES.items():
                got = [p["extremes"][k] for p in parts if k in p["extremes"]]
                out[k] = pick(got) if got else 1.0
        return out


def packing_mode(cfg, policy) -> str:
    """``cfg.packed_sequences`` for ``policy``: "on", "off", or "auto" — every micro-batch whose padded forward runs at
    least :data:`qerl.ops.packed.PACK_RATIO` times its real tokens is packed (:func:`micro_packings`), where the packed
    row runs FlashAttention's varlen kernel (the policy on CUDA in bf16 / fp16, torch's varlen API, SDPA attention, no
    sliding window); elsewhere auto is "off" (an fp32 policy would take the per-sequence reference)."""
    from qerl.ops import packed

    want = getattr(cfg, "packed_sequences", False)
    if want != "auto":
        return "on" if want is True else "off"
    try:
        emb = policy.get_input_embeddings().weight
    except (AttributeError, NotImplementedError):
        return "off"
    if not packed.varlen_ok(emb.device, emb.dtype):
        return "off"
    try:
        config = packed.config_of(policy)
    except ValueError:
        return "off"
    ok = config._attn_implementation in (None, "sdpa") and not getattr(config, "use_sliding_window", False)
    return "auto" if ok else "off"


def micro_packings(mode: str, batch, micro: list) -> list:
    """Per micro-batch ``(rows, real)`` of ``batch``: its :class:`qerl.ops.packed.Packing` on the batch's device, or
    None where it runs padded (``mode`` from :func:`packing_mode`). Reads the masks on the host once."""
    from qerl.ops import packed

    if mode == "off" or not micro:
        return [None] * len(micro)
    pm, cm = batch.prompt_mask.cpu(), batch.completion_mask.cpu()
    dev = batch.completion_ids.device
    return [packed.plan(pm[m], cm[m]).to(dev)
            if mode == "on" or packed.padding_ratio(pm[m], cm[m]) >= packed.PACK_RATIO else None for m, _ in micro]


def rank_micro_batches(n: int, G: int, mb: int, d: dist.Dist) -> list[tuple[slice, bool]]:
    """This rank's micro-batches of the global batch's ``n`` rows: ``(rows, real)``. Every rank runs the same
    number (DDP all-reduces at the last one): a rank with fewer rows (DAPO kept a group count that does not
    divide) repeats a micro-batch with ``real = False`` (its loss weighted 0)."""
    groups = n // G
    mine = dist.share(groups, d)
    lo, hi = mine.start * G, mine.stop * G
    own = [slice(s, min(hi, s + mb)) for s in range(lo, hi, mb)]
    most = -(-(-(-groups // d.world) * G) // mb)
    filler = own[0] if own else slice(0, min(n, mb))
    return [(m, True) for m in own] + [(filler, False)] * (most - len(own))


def token_micro_batches(prompt_mask: torch.Tensor, completion_mask: torch.Tensor, G: int, budget: int, d: dist.Dist,
                        packed: bool = True) -> list[tuple[torch.Tensor, bool]]:
    """This rank's micro-batches of a batch of ``n`` rows (masks ``[n, P]`` / ``[n, T]``, the same on every rank) cut by
    tokens (``micro_batch_tokens``): ``(rows, real)`` with ``rows`` an index tensor in row order. Each holds at most
    ``budget`` tokens as its forward runs them — its real tokens where it is ``packed`` (:mod:`qerl.ops.packed`),
    else rows x (longest prompt + longest completion) — and a row longer than that alone. The rank's rows (its whole
    groups, :func:`qerl.train.dist.share`) go first-fit, longest first (ties in row order), into as few micro-batches
    as that finds: fewer, fuller forward / backward passes where the rollout stopped early. Every rank runs as many as
    the rank with the most (computed from the whole batch, no communication); the rest repeat one with ``real =
    False`` (weight 0), as :func:`rank_micro_batches`."""
    n = completion_mask.shape[0]
    p_len, c_len = prompt_mask.cpu().sum(1).tolist(), completion_mask.cpu().sum(1).tolist()

    def cost(rows: int, tokens: int, p: int, c: int) -> int:  # a micro-batch's forward positions
        return tokens if packed else rows * (p + c)

    def cut(rank: int) -> list[torch.Tensor]:
        mine = dist.share(n // G, dist.Dist(rank, d.world))
        bins: list[list] = []  # [rows, tokens, longest prompt, longest completion]
        for r in sorted(range(mine.start * G, mine.stop * G), key=lambda r: (-(p_len[r] + c_len[r]), r)):
            for b in bins:
                p, c = max(b[2], p_len[r]), max(b[3], c_len[r])
                if cost(len(b[0]) + 1, b[1] + p_len[r] + c_len[r], p, c) <= budget:
                    b[0].append(r)
                    b[1:] = [b[1] + p_len[r] + c_len[r], p, c]
                    break
            else:
                bins.append([[r], p_len[r] + c_len[r], p_len[r], c_len[r]])
        return [torch.tensor(sorted(b[0])) for b in bins]

    cuts = [cut(r) for r in range(d.world)]
    own, most = cuts[d.rank], max(len(c) for c in cuts)
    filler = own[0] if own else torch.arange(min(n, 1))
    return [(m, True) for m in own] + [(filler, False)] * (most - len(own))


def by_length(micro: list, completion_mask: torch.Tensor, G: int) -> list:
    """The micro-batches with each group's ``G`` rows sorted by completion length (longest first, ties in row order):
    a real micro-batch ``rows`` becomes the index tensor ``perm[rows]`` (``perm`` keeps every group on its own rows;
    the weight-0 fillers unchanged). Micro-batches smaller than a group then hold rows of similar lengths, so running
    each on its live columns (:func:`qerl.rollout.sampler.sequence_logprobs`) wastes little on padding — with
    log-normal lengths a micro-batch is otherwise about as wide as the longest of its few rows. Within groups only, so
    the micro-batches are the same whatever the number of processes (ranks own whole groups); the loss is the same
    sum over rows (its float summation order changes)."""
    n = completion_mask.shape[0]
    if G < 2 or n % G or not any(r for _, r in micro):
        return micro
    lengths = completion_mask.sum(1).cpu().view(n // G, G)
    perm = (torch.argsort(-lengths, dim=1, stable=True) + torch.arange(0, n, G)[:, None]).flatten()
    return [(perm[m], True) if r else (m, False) for m, r in micro]


def _rows(m) -> torch.Tensor:
    return torch.arange(m.start, m.stop) if isinstance(m, slice) else m


def in_row_order(parts: list) -> torch.Tensor | None:
    """``[(rows, values [len(rows), ...]), …]`` of micro-batches (slices or index tensors covering a contiguous
    range of rows) -> the values stacked in row order."""
    if not parts:
        return None
    rows = torch.cat([_rows(m) for m, _ in parts])
    return torch.cat([v for _, v in parts])[torch.argsort(rows).to(parts[0][1].device)]


def logprobs_global(policy, batch, T: float, micro: list, d: dist.Dist, what: str, lockstep: bool = False,
                    packings: list | None = None, modules: list | None = None) -> torch.Tensor:
    """Log-probs ``[n, T]`` of the whole batch without grad, each rank computing its own rows' micro-batches
    (``lockstep``, under FSDP2 whose forwards all-gather: the fillers too, so every rank runs as many); ``packings``:
    each micro-batch's :func:`micro_packings` entry (as the update runs it); ``modules``: ``list(policy.modules())``
    (:mod:`qerl.train.modes`)."""
    packings = packings or [None] * len(micro)
    run = [(m, real, pk) for (m, real), pk in zip(micro, packings) if real or lockstep]
    outs = [(m, logprobs_no_grad(policy, batch, T, 0, [m], packings=[pk], modules=modules), real)
            for m, real, pk in run]
    part = in_row_order([(m, p) for m, p, real in outs if real])
    if not d.on:
        return part
    parts = dist.gather(d, None if part is None else part.cpu(), what)
    return torch.cat([p for p in parts if p is not None]).to(batch.logprobs.device)


def nonfinite_grads(policy) -> str:
    """Which trainable parameters hold a non-finite gradient on this process: their count and the first and last in
    model order, for a non-finite gradient norm's message. A nan born in one layer's backward reaches every layer below
    it and none above, so the last one named is the layer nearest the loss where it appeared."""
    bad = [n for n, p in policy.named_parameters()
           if p.grad is not None and not bool(torch.isfinite(getattr(p.grad, "_local_tensor", p.grad)).all())]
    if not bad:
        return "no gradient on this process is non-finite"
    return f"non-finite in {len(bad)} parameter(s) on this process, from {bad[0]} to {bad[-1]}"


def update_policy(policy, scorer, batch, rewards, cfg, aqn, sigma: float, step: int, optimizer,
                  d: dist.Dist = dist.Dist(), shards: sharding.Replicated = sharding.Replicated(),
                  phase=_no_phase, may_skip: int = 0) -> dict:
    """Advantages, old/ref log-probs, ``μ = cfg.algorithm.updates_per_batch`` optimizer steps over micro-batches
    of ``batch`` (a :class:`~qerl.rollout.Rollout` of ``n`` rows, the same on every rank) scored by ``rewards
    [n]``. ``scorer``: :class:`LogprobModule` of ``policy`` (DDP-wrapped under torchrun: one gradient all-reduce
    per optimizer step; under FSDP2 its hooks reduce-scatter at the last micro-batch). ``phase(name)``: a context
    entered around the ``logprob`` and ``update`` phases (the step benchmark times them). With μ = 1 (and
    ``algorithm.old_logprob_pass`` off) the old log-probs are the update's forward detached — ``ρ = exp(log π_θ -
    sg(log π_θ)) = 1``, ``∇ρ = ∇ log π_θ``: the loss and gradient of the two-pass update without its no-grad pass
    — and the mismatch statistics and TIS weights come from them. Returns the loss diagnostics summed over ranks,
    the gradient norm (of the last update; None where it was not finite) and the rollout / trainer mismatch
    statistics. ``may_skip``: how many updates whose gradient norm is not finite may be dropped (no optimizer step)
    instead of stopping the run with :class:`TrainingError` (what is left of ``optim.skip_nonfinite``); the dropped
    ones are counted in ``skipped_updates``."""
    a = cfg.algorithm
    T = cfg.rollout.temperature
    settings = LossSettings(a.name, a.clip_low, a.clip_high, a.kl_coef, cfg.rollout.max_new_tokens, a.aggregation,
                            a.ratio_level)
    adv = group_advantages(rewards, a.group_size, a.adv_scale).to(batch.logprobs.device)
    mask = batch.completion_mask.float()
    if a.overlong_mask:
        mask = mask * (~batch.truncated).float()[:, None]
    train_noise = aqn is not None and cfg.aqn.apply_to == "rollout+train" and sigma > 0
    ctx = aqn.noise(sigma, derive_seed(cfg.seed, step, 0, "aqn")) if train_noise else contextlib.nullcontext()
    mode = packing_mode(cfg, policy)
    budget = update_tokens(cfg)
    if budget is None:  # micro_batch_size rows each, sorted by length within groups
        micro = by_length(rank_micro_batches(len(batch.texts), a.group_size, cfg.micro_batch_size, d),
                          batch.completion_mask, a.group_size)
    else:  # micro_batch_tokens: every micro-batch packed where packing runs (its budget counts real tokens)
        mode = "on" if mode == "auto" else mode
        micro = token_micro_batches(batch.prompt_mask, batch.completion_mask, a.group_size, budget, d, mode == "on")
    one_pass = a.updates_per_batch == 1 and not a.old_logprob_pass  # old log-probs = the update's forward
    packings = micro_packings(mode, batch, micro)  # a row of real tokens (qerl.ops.packed)
    scope = packed_scope(policy) if any(p is not None for p in packings) else contextlib.nullcontext()
    mods = list(policy.modules())  # one walk, for every switch below (qerl.train.modes)
    # (the scope stays open through the backward: gradient checkpointing recomputes the attention there)
    with ctx, fused_elementwise(policy, modules=mods), scope:  # RMSNorm and the SiLU gate as fused kernels (CUDA)
        with phase("logprob"):
            old_logp = mismatch = is_w = ref_logp = None
            if not one_pass:
                old_logp = logprobs_global(policy, batch, T, micro, d,
                                           f"gathering the old log-probs of step {step + 1}", shards.lockstep, packings,
                                           mods)
                mismatch = mismatch_stats(old_logp, batch.logprobs, mask)
                is_w = truncated_is_weights(old_logp, batch.logprobs, a.tis_cap) if a.tis_cap else None
            if a.kl_coef > 0:
                with policy.disable_adapter():
                    ref_logp = logprobs_global(policy, batch, T, micro, d,
                                               f"gathering the reference log-probs of step {step + 1}",
                                               packings=packings, modules=mods)
        with phase("update"), dense_base(policy, enabled=getattr(cfg, "dense_update", False) is True, modules=mods):
            set_training(policy, mods, True)
            # Everything the loop needs from the host is read here, once: each micro-batch's weight, live columns
            # and rows on the device. The loop itself never waits for the GPU (losses, diagnostics and the finite
            # check stay on the device until the micro-batches are all launched), so the host queues a micro-batch's
            # backward while the GPU still runs its forward (measured at 7B batch 64 / 128: no change in the update's
            # time: the GPU stayed busy through the ~20 syncs per micro-batch this removed, reports/step).
            weights = [micro_weight(settings.aggregation, mask, m) if real else 0.0 for m, real in micro]
            tokens = mask.cpu()
            shares = [float(tokens[m].sum()) / max(float(tokens.sum()), 1.0) if real else 0.0 for m, real in micro]
            spans = row_spans(batch.prompt_mask, batch.completion_mask)
            cols = [columns_of(spans, m, batch.prompt_mask.shape[1]) for m, _ in micro]
            dev = batch.completion_ids.device
            on_dev = [m.to(dev) if torch.is_tensor(m) else m for m, _ in micro]
            diag = Diagnostics()
            skipped = 0  # updates of this step dropped for a non-finite gradient norm
            own_old = []  # one pass: this rank's (rows, detached log-probs) of its real micro-batches
            for update in range(a.updates_per_batch):
                total, losses = 0.0, []
                with frozen_adapters(policy, mods):  # (the adapters change at the optimizer step, after this block)
                    for k, ((m, real), md) in enumerate(zip(micro, on_dev)):
                        sync = k == len(micro) - 1 or not d.on
                        w = weights[k]
                        with contextlib.nullcontext() if sync else shards.accumulating(policy, scorer):
                            logp, ent = scorer(batch.prompt_ids[md], batch.prompt_mask[md], batch.completion_ids[md],
                                               batch.completion_mask[md], T, columns=cols[k], packing=packings[k])
                            if one_pass:
                                old_m = logp.detach()
                                w_m = truncated_is_weights(old_m, batch.logprobs[md], a.tis_cap) if a.tis_cap else None
                                if real:
                                    own_old.append((m, old_m))
                            else:
                                old_m, w_m = old_logp[md], None if is_w is None else is_w[md]
                            loss, info = policy_loss(logp, old_m, adv[md], mask[md], settings,
                                                     None if ref_logp is None else ref_logp[md], w_m, ent, sync=False)
                            if not loss.requires_grad:
                                raise TrainingError(
                                    f"step {step + 1}: the update's loss does not depend on any trainable parameter (a "
                                    "forward-only kernel or a detach inside the policy's forward?); no optimizer step "
                                    "was taken, the last checkpoint is intact")
                            (loss * (w * d.world)).backward()  # DDP averages over ranks: x world = the one-process sum
                        losses.append(loss.detach())
                        total = total + loss.detach().double() * w  # (float64, as the Python floats they replace)
                        if update == 0:
                            diag.add(info, w, shares[k])
                    values = torch.stack(losses).tolist() if losses else []  # (the loop's one wait for the GPU)
                    bad = [(k, v) for k, v in enumerate(values) if not math.isfinite(v)]
                    if bad:  # before the optimizer step: nothing applied
                        raise TrainingError(f"step {step + 1}: loss is {bad[0][1]} (micro-batch {bad[0][0] + 1} of "
                                            f"{len(micro)}); stopping (the last checkpoint is intact)")
                    total = float(total)
                params = [p for p in policy.parameters() if p.requires_grad]
                if any(p.grad is None for p in params):  # a path cut inside the forward: those would never train
                    cut = [n for n, p in policy.named_parameters() if p.requires_grad and p.grad is None]
                    raise TrainingError(
                        f"step {step + 1}: {len(cut)} of {len(params)} trainable parameters got no gradient (e.g. "
                        f"{', '.join(cut[:3])}): a forward-only kernel or a detach inside the policy's forward; "
                        "no optimizer step was taken, the last checkpoint is intact")
                grad_norm = shards.clip(policy, params, cfg.optim.grad_clip, d.world)  # (global: every rank agrees)
                if torch.isfinite(grad_norm):
                    optimizer.step()
                elif skipped < may_skip:  # dropped, as verl drops it (optim.skip_nonfinite)
                    skipped += 1
                    if d.main:
                        print(f"step {step + 1}: gradient norm is {float(grad_norm)} ({nonfinite_grads(policy)}); "
                              f"this update is skipped (no optimizer step; {may_skip - skipped} more may be, "
                              "optim.skip_nonfinite)", flush=True)
                else:
                    raise TrainingError(
                        f"step {step + 1}: gradient norm is {float(grad_norm)} ({nonfinite_grads(policy)}); stopping "
                        f"(optim.skip_nonfinite = {cfg.optim.skip_nonfinite}: "
                        f"{cfg.optim.skip_nonfinite - may_skip + skipped} update(s) of this run skipped already; "
                        "the last checkpoint is intact)")
                optimizer.zero_grad(set_to_none=True)
            set_training(policy, mods, False)
    if one_pass:  # the rollout / trainer mismatch over the whole batch, from the update's own log-probs
        part = in_row_order(own_old)
        if d.on:
            parts = dist.gather(d, None if part is None else part.cpu(), f"gathering the log-probs of step {step + 1}")
            part = torch.cat([p for p in parts if p is not None]).to(batch.logprobs.device)
        mismatch = mismatch_stats(part, batch.logprobs, mask)
    summed = diag.result(d, total, f"combining the loss diagnostics of step {step + 1}")
    norm = float(grad_norm)
    return {**summed, "grad_norm": norm if math.isfinite(norm) else None, "skipped_updates": skipped, **mismatch}
