"""``qerl train``: the RL loop, straight-line (config & seed -> tracker -> model & method -> data &
rollout -> optimizer -> for each step: rollout -> reward -> advantage -> loss -> step -> log ->
checkpoint). One copy of the model: the KL reference is the base with adapters disabled, and
AQN noise lives in the norms' forward (see :mod:`qerl.rl.aqn`)."""
from __future__ import annotations

import contextlib
import json
import os
import random
import time
from pathlib import Path

import numpy as np
import torch

from qerl.data.loading import load_train_records
from qerl.rewards.registry import build_reward
from qerl.rl.advantages import group_advantages
from qerl.rl.aqn import AQN, sigma_at
from qerl.rl.losses import LossSettings, mismatch_stats, policy_loss, truncated_is_weights
from qerl.rollout.engine import release_engine
from qerl.rollout.sampler import sequence_logprobs
from qerl.train.config import TrainConfig, to_dict
from qerl.train.methods import METHODS, build_policy, resolve_device
from qerl.train.state import TrainState, load_checkpoint, save_checkpoint
from qerl.train.steps import (
    PromptStream, TrainingError, collect_rollouts, derive_seed, logprobs_no_grad, make_optimizer,
    micro_batches, micro_weight, peak_memory_gb, warmup_cosine,
)

DETERMINISTIC_METRICS = ("reward_mean", "reward_std", "accuracy", "entropy", "kl", "clip_frac", "loss",
                         "mismatch_kl", "response_len_mean", "sigma", "lr", "groups_kept")


def train(cfg: TrainConfig, resume: bool = False, tracker=None, progress: bool = True) -> Path:
    """Run RL training; returns the output directory (metrics.jsonl, checkpoint/, final/)."""
    from tqdm.auto import tqdm

    # config & seed
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(to_dict(cfg), indent=2))
    random.seed(cfg.seed), np.random.seed(cfg.seed % 2**32), torch.manual_seed(cfg.seed)
    device = resolve_device(cfg.device)
    method = METHODS[cfg.method]
    a = cfg.algorithm
    loss_settings = LossSettings(a.name, a.clip_low, a.clip_high, a.kl_coef, cfg.rollout.max_new_tokens)

    # model & method (on a GPU, a configuration that cannot fit is refused before anything loads)
    if device.type == "cuda" and method.lora:
        _check_memory(cfg)
    policy, tokenizer = build_policy(cfg, device)
    aqn = AQN(policy, cfg.aqn) if method.aqn else None

    # data & reward
    stream = PromptStream(load_train_records(cfg.data, cfg.seed), cfg.seed)
    reward = build_reward(cfg.reward)

    # optimizer
    params = [p for p in policy.parameters() if p.requires_grad]
    optimizer = make_optimizer(params, cfg.optim, device)
    scheduler = warmup_cosine(optimizer, cfg.optim.warmup_steps, cfg.steps, cfg.optim.min_lr_ratio)
    state = TrainState()
    if resume:
        state = load_checkpoint(out, policy, optimizer, scheduler)
        stream.pos = state.data_pos
    metrics_path = out / "metrics.jsonl"
    _truncate_metrics(metrics_path, state.step)

    # tracker
    if tracker is None:
        from qerl.train.tracking_setup import make_tracker

        tracker = make_tracker(cfg, out, state.run_id)
    state.run_id = tracker.run_id

    bar = tqdm(total=cfg.steps, initial=state.step, desc=f"train {cfg.method}/{a.name}", disable=not progress)
    try:
        for step in range(state.step, cfg.steps):
            sigma = sigma_at(step, cfg.steps, cfg.aqn) if aqn else 0.0
            policy.eval()
            t0 = time.time()
            try:
                batch, rewards, stats = collect_rollouts(policy, tokenizer, stream, cfg, step, reward, aqn, sigma)
            except torch.cuda.OutOfMemoryError as e:
                raise _oom_error(cfg, step, "rollout", device, out, None, e) from None
            if cfg.rollout.release_cache:
                release_engine(policy)
            t_roll = time.time() - t0
            t1 = time.time()
            try:
                info = _update(policy, batch, rewards, cfg, loss_settings, aqn, sigma, step, optimizer) if batch else {}
            except torch.cuda.OutOfMemoryError as e:
                optimizer.zero_grad(set_to_none=True)
                raise _oom_error(cfg, step, "update", device, out, batch, e) from None
            scheduler.step()
            state.step, state.data_pos = step + 1, stream.pos
            metrics = {"step": step + 1, **stats, **info, "sigma": sigma, "lr": scheduler.get_last_lr()[0],
                       "rollout_seconds": t_roll, "train_seconds": time.time() - t1,
                       "tokens_per_second": stats["generated_tokens"] / max(t_roll, 1e-9),
                       "peak_memory_gb": peak_memory_gb(device)}
            _append_jsonl(metrics_path, metrics)
            tracker.log_metrics(metrics, step=step + 1)
            bar.update(1)
            bar.set_postfix(reward=f"{stats['reward_mean']:.3f}", acc=f"{stats['accuracy']:.2f}")
            if state.step % cfg.checkpoint_every == 0 or state.step == cfg.steps:
                save_checkpoint(out, policy, optimizer, scheduler, state, method.lora)
        _save_final(out, policy, tokenizer, method)
        _write_summary(out, metrics_path, cfg)
        tracker.close("FINISHED")
    except BaseException:
        tracker.close("FAILED")
        raise
    finally:
        bar.close()
        reward.close()
    return out


def _oom_error(cfg: TrainConfig, step: int, phase: str, device, out: Path, batch, err) -> TrainingError:
    """An out-of-memory as a message with the sizes and what to do (the last checkpoint is intact)."""
    rows = cfg.prompts_per_step * cfg.algorithm.group_size
    sizes = f"{rows} sequences, completions up to {cfg.rollout.max_new_tokens} tokens"
    if batch is not None:
        sizes = (f"{len(batch.texts)} sequences, prompts {batch.prompt_ids.shape[1]} + completions "
                 f"{batch.completion_ids.shape[1]} tokens, micro-batch {cfg.micro_batch_size}")
    mem = ""
    if device.type == "cuda":
        mem = (f"; peak {torch.cuda.max_memory_allocated(device) / 1e9:.1f} GB of "
               f"{torch.cuda.get_device_properties(device).total_memory / 1e9:.1f} GB")
    first = str(err).splitlines()[0] if str(err) else type(err).__name__
    ts = out / "checkpoint" / "trainer_state.json"
    last = f"step {json.loads(ts.read_text())['step']}" if ts.exists() else "none yet"
    return TrainingError(
        f"step {step + 1}: out of GPU memory in the {phase} phase ({sizes}{mem}: {first}). The last checkpoint "
        f"({out / 'checkpoint'}, {last}) is intact: lower micro_batch_size or rollout.max_new_tokens, or set "
        "gradient_checkpointing: true (`qerl plan --config ...` estimates it), then rerun with --resume.")


def _check_memory(cfg: TrainConfig) -> None:
    """The memory planner's verdict for a local model directory (a hub id is planned after download only)."""
    from qerl.train.plan import check_fits

    path = Path(cfg.model.path) / "config.json"
    if path.exists():
        check_fits(cfg, path)


def _update(policy, batch, rewards, cfg, loss_settings, aqn, sigma, step, optimizer) -> dict:
    """Advantages, old/ref log-probs, μ policy updates over micro-batches. Returns diagnostics."""
    a = cfg.algorithm
    T = cfg.rollout.temperature
    adv = group_advantages(rewards, a.group_size, a.adv_scale).to(batch.logprobs.device)
    mask = batch.completion_mask.float()
    if a.overlong_mask:
        mask = mask * (~batch.truncated).float()[:, None]
    train_noise = aqn is not None and cfg.aqn.apply_to == "rollout+train" and sigma > 0
    ctx = aqn.noise(sigma, derive_seed(cfg.seed, step, 0, "aqn")) if train_noise else contextlib.nullcontext()
    n, mb = len(batch.texts), cfg.micro_batch_size
    with ctx:
        old_logp = logprobs_no_grad(policy, batch, T, mb)
        mismatch = mismatch_stats(old_logp, batch.logprobs, mask)
        ref_logp = None
        if a.kl_coef > 0:
            with policy.disable_adapter():
                ref_logp = logprobs_no_grad(policy, batch, T, mb)
        is_w = truncated_is_weights(old_logp, batch.logprobs, a.tis_cap) if a.tis_cap else None
        policy.train()
        sums: dict[str, float] = {}
        for update in range(a.updates_per_batch):
            total = 0.0
            for m in micro_batches(n, mb):
                logp, ent = sequence_logprobs(policy, batch.prompt_ids[m], batch.prompt_mask[m], batch.completion_ids[m],
                                              batch.completion_mask[m], T, with_entropy=True)
                loss, info = policy_loss(logp, old_logp[m], adv[m], mask[m], loss_settings,
                                         None if ref_logp is None else ref_logp[m],
                                         None if is_w is None else is_w[m], ent)
                w = micro_weight(a.name, mask, m)
                if not torch.isfinite(loss):
                    raise TrainingError(f"step {step}: loss is {float(loss)}; stopping (the last checkpoint is intact)")
                (loss * w).backward()
                total += loss.item() * w
                if update == 0:
                    for k, v in info.items():
                        sums[k] = sums.get(k, 0.0) + v * w
            params = [p for p in policy.parameters() if p.requires_grad]
            grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.optim.grad_clip)
            if not torch.isfinite(grad_norm):
                raise TrainingError(f"step {step}: gradient norm is {float(grad_norm)}; stopping")
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    policy.eval()
    return {**sums, "loss": total, "grad_norm": float(grad_norm), **mismatch}


def _write_summary(out: Path, metrics_path: Path, cfg: TrainConfig) -> None:
    """``summary.json``: written last, so its presence means the run completed."""
    from qerl.checkpoint import write_json

    rows = [json.loads(x) for x in metrics_path.read_text().splitlines() if x.strip()]
    tail = rows[-max(1, len(rows) // 10):]
    write_json(out / "summary.json", {
        "method": cfg.method, "algorithm": cfg.algorithm.name, "steps": len(rows),
        "reward_first": rows[0]["reward_mean"] if rows else None,
        "reward_last10pct": sum(r["reward_mean"] for r in tail) / len(tail) if rows else None,
        "final": str(out / "final"),
    })


def _append_jsonl(path: Path, row: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _truncate_metrics(path: Path, completed_steps: int) -> None:
    """Drop metric rows past the checkpoint (a resumed run recomputes them)."""
    if not path.exists():
        return
    rows = [line for line in path.read_text().splitlines() if line.strip()]
    keep = [r for r in rows if json.loads(r)["step"] <= completed_steps]
    path.write_text("".join(r + "\n" for r in keep))


def _save_final(out: Path, policy, tokenizer, method) -> None:
    from qerl.checkpoint import atomic_directory

    with atomic_directory(out / "final", force=True) as tmp:
        policy.save_pretrained(str(tmp))  # PEFT adapter for LoRA methods, full model for 'full'
        if not method.lora:
            tokenizer.save_pretrained(str(tmp))
