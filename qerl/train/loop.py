"""``qerl train``: the RL loop, straight-line (config & seed -> tracker -> model & method -> data &
rollout -> optimizer -> for each step: rollout -> reward -> advantage -> loss -> step -> log ->
checkpoint). One copy of the model: the KL reference is the base with adapters disabled, and
AQN noise lives in the norms' forward (see :mod:`qerl.rl.aqn`). Under ``torchrun`` the same loop runs on
every rank, each with its share of the rollouts and of the update (:mod:`qerl.train.dist`)."""
from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path

import numpy as np
import torch

from qerl.checkpoint import write_json
from qerl.data.context import fit_records, model_context
from qerl.data.loading import load_train_records
from qerl.models.source import resolve_model_dir
from qerl.rewards.registry import build_reward
from qerl.rl.aqn import AQN, sigma_at
from qerl.rollout.engine import release_engine
from qerl.train import dist, ownership, sharding
from qerl.train.config import TrainConfig, to_dict
from qerl.train.methods import METHODS, build_policy, load_tokenizer, resolve_device
from qerl.train.offload import StateOffload
from qerl.train.state import TrainState, save_checkpoint
from qerl.train.steps import (
    PromptStream, TrainingError, collect_rollouts, peak_memory_gb, warmup_cosine,
)
from qerl.train.update import LogprobModule
from qerl.train.update import update_policy as _update  # (a module attribute: the tests inject failures here)
from qerl.errors import TrainingInterrupted

DETERMINISTIC_METRICS = ("reward_mean", "reward_std", "accuracy", "entropy", "kl", "clip_frac", "loss",
                         "mismatch_kl", "response_len_mean", "sigma", "lr", "groups_kept")


def train(cfg: TrainConfig, resume: bool = False, tracker=None, progress: bool = True) -> Path:
    """Run RL training; returns the output directory (metrics.jsonl, checkpoint/, final/)."""
    # config & seed; the process group under torchrun (rank 0 writes every file)
    out = Path(cfg.output_dir)
    device = resolve_device(cfg.device)
    d = dist.from_env(device)
    try:
        return _train(cfg, resume, tracker, progress, out, dist.rank_device(device, d), d)
    finally:
        dist.close(d)


def _train(cfg: TrainConfig, resume: bool, tracker, progress: bool, out: Path, device, d: dist.Dist) -> Path:
    from tqdm.auto import tqdm

    dist.check_divisible(cfg.prompts_per_step, d)
    dist.check_same_config(d, to_dict(cfg))
    held = ownership.status(out) if d.main and not resume else None  # (the CLI decides; a library call too)
    if held is not None and not held.empty:
        raise ownership.OwnershipError(f"output_dir {out} holds {held.describe()}: resume it (resume=True) or "
                                       "choose another output_dir")
    out.mkdir(parents=True, exist_ok=True)
    random.seed(cfg.seed), np.random.seed(cfg.seed % 2**32), torch.manual_seed(cfg.seed)
    method = METHODS[cfg.method]
    a = cfg.algorithm

    # data (before the model: prompts that cannot fit the model's context are found without loading weights)
    src = resolve_model_dir(cfg.model.path, cfg.model.revision)
    tokenizer = load_tokenizer(src)
    records, note = fit_records(load_train_records(cfg.data, cfg.seed), tokenizer, cfg.data.template,
                                cfg.rollout.max_new_tokens, model_context(src), f"data.task {cfg.data.task}")
    if note and d.main:
        print(note, flush=True)

    # every auto setting resolved once (qerl.train.runplan; `qerl plan` prints the same plan); on a GPU a
    # configuration that cannot fit is refused here, before anything loads
    from qerl.train.runplan import resolve as resolve_plan

    cfg, run_plan, plan = resolve_plan(cfg, device.type, d.world, src)
    if d.main:
        print("\n".join(run_plan.lines()), flush=True)
    shards = sharding.strategy(run_plan.sharding)  # none | optimizer (ZeRO-1) | fsdp (FSDP2)
    keep_cache = run_plan.keep_engine_cache
    policy, tokenizer = build_policy(cfg, device, d.world, src, tokenizer)
    aqn = AQN(policy, cfg.aqn) if run_plan.aqn else None
    scorer = LogprobModule(policy)  # DDP-wrapped under torchrun (below): the update's forward goes through it

    # data & reward
    stream = PromptStream(records, cfg.seed)
    reward = build_reward(cfg.reward)

    # optimizer (after sharding: FSDP2 turns the weights into DTensor shards)
    dist.check_same_weights(d, policy)
    shards.prepare(policy, device, d.world)
    params = [p for p in policy.parameters() if p.requires_grad]
    optimizer = shards.make_optimizer(policy, cfg, device)
    said = shards.note(optimizer, params, d.world)
    if said and d.main:
        print(said, flush=True)
    scheduler = warmup_cosine(optimizer, cfg.optim.warmup_steps, cfg.steps, cfg.optim.min_lr_ratio)
    state = TrainState(world_size=d.world)
    if resume:
        state = shards.load(out, policy, optimizer, scheduler)
        if state.world_size != d.world:
            raise TrainingError(
                f"{out / 'checkpoint'} was written by a run on {state.world_size} process(es); this one has {d.world}: "
                f"resume with --nproc {state.world_size} (or start a new output_dir)")
        stream.pos = state.data_pos
    scorer = shards.wrap(scorer, d, device)
    parking = StateOffload(optimizer) if run_plan.offload else None
    if parking is not None and d.main:
        print("optimizer states parked in host memory during each rollout (optim.offload)", flush=True)
    metrics_path = out / "metrics.jsonl"
    if d.main:  # (after the checkpoint loaded: a resume that fails changes nothing)
        resolved = to_dict(cfg)
        write_json(out / "config.json", resolved)
        if state.step == 0:
            from qerl.train.ownership import record_inputs

            record_inputs(out, resolved)
        _truncate_metrics(metrics_path, state.step)

    # tracker (rank 0)
    if tracker is None:
        from qerl.train.tracking_setup import make_tracker
        from qerl.tracking import NullTracker

        tracker = make_tracker(cfg, out, state.run_id) if d.main else NullTracker()
    state.run_id = tracker.run_id

    bar = tqdm(total=cfg.steps, initial=state.step, desc=f"train {cfg.method}/{a.name}",
               disable=not (progress and d.main))
    log_line = StepLog(cfg.steps, enabled=d.main and not progress)
    saved = state.step if resume else None  # the step of the intact checkpoint
    step = state.step
    try:
        for step in range(state.step, cfg.steps):
            dist.maybe_fault(d, step + 1)
            sigma = sigma_at(step, cfg.steps, cfg.aqn) if aqn else 0.0
            policy.eval()
            t0 = time.time()
            parked = parking.park() if parking is not None else 0  # (none before the first optimizer step)
            try:
                with shards.gathered(policy):
                    batch, rewards, stats = collect_rollouts(policy, tokenizer, stream, cfg, step, reward, aqn, sigma, d)
                    if not keep_cache:
                        release_engine(policy)  # (before FSDP reshards: the engine holds views of the weights)
            except torch.cuda.OutOfMemoryError as e:
                raise _oom_error(cfg, step, "rollout", device, out, None, e) from None
            t_roll = time.time() - t0
            t1 = time.time()
            if parking is not None:
                parking.restore()
            try:
                info = _update(policy, scorer, batch, rewards, cfg, aqn, sigma, step, optimizer, d, shards,
                               may_skip=cfg.optim.skip_nonfinite - state.skipped_updates) if batch else {}
            except torch.cuda.OutOfMemoryError as e:
                optimizer.zero_grad(set_to_none=True)
                raise _oom_error(cfg, step, "update", device, out, batch, e) from None
            scheduler.step()
            state.step, state.data_pos = step + 1, stream.pos
            state.skipped_updates += info.get("skipped_updates", 0)
            metrics = {"step": step + 1, **stats, **info, "sigma": sigma, "lr": scheduler.get_last_lr()[0],
                       "rollout_seconds": t_roll, "train_seconds": time.time() - t1,
                       **({"offload_seconds": parking.seconds, "offload_gb": parked / 1e9} if parking else {}),
                       "tokens_per_second": stats["generated_tokens"] / max(t_roll, 1e-9),
                       "peak_memory_gb": max(dist.gather(d, peak_memory_gb(device), "comparing peak memory"))}
            if d.main:
                _append_jsonl(metrics_path, metrics)
                tracker.log_metrics(metrics, step=step + 1)
            bar.update(1)
            bar.set_postfix(reward=f"{stats['reward_mean']:.3f}", acc=f"{stats['accuracy']:.2f}")
            log_line(metrics)
            if state.step % cfg.checkpoint_every == 0 or state.step == cfg.steps:
                staged = shards.stage_checkpoint(out, policy, optimizer, state.step, d)
                if d.main:
                    save_checkpoint(out, policy, optimizer, scheduler, state, method.lora, sharded=staged)
                dist.barrier(d, f"writing the checkpoint of step {state.step}")
                saved = state.step
        weights = shards.final_weights(policy, d)
        if d.main:
            _save_final(out, policy, tokenizer, method, weights)
            _write_summary(out, metrics_path, cfg, tracker.run_id)
            if tracker.run_id is not None:
                from qerl.train.tracking_setup import log_run_files

                try:  # (the run's files are written: a store that refuses artifacts does not fail the run)
                    log_run_files(tracker, out)
                except Exception as e:
                    print(f"MLflow: the run's files could not be logged as artifacts ({type(e).__name__}: {e})",
                          flush=True)
        tracker.close("FINISHED")
    except KeyboardInterrupt:
        tracker.close("KILLED")
        raise TrainingInterrupted(f"interrupted at step {step + 1}; {_intact(out, saved)}") from None
    except OSError as e:
        tracker.close("FAILED")
        from qerl.outputs import describe_os_error

        raise TrainingError(f"step {step + 1}: cannot write {describe_os_error(e)}; {_intact(out, saved)}") from None
    except BaseException:
        tracker.close("FAILED")
        raise
    finally:
        bar.close()
        reward.close()
    return out


def _intact(out: Path, saved: int | None) -> str:
    """What the run leaves behind: the complete checkpoint on disk (an interrupt after a checkpoint was swapped in but
    before the loop recorded it must name that one), else the last one the loop recorded."""
    try:
        on_disk = ownership.checkpoint_step(out / "checkpoint")
    except (OSError, ownership.CheckpointError):
        on_disk = None
    saved = on_disk if on_disk is not None else saved
    if saved is None:
        return "no checkpoint was written yet (rerun with --overwrite to start over)"
    return f"the checkpoint of step {saved} ({out / 'checkpoint'}) is intact: rerun with --resume to continue"


class StepLog:
    """Without a progress bar (``--no-progress``, a workflow job's log): one line per step with the step, reward,
    accuracy, the step's seconds and the elapsed time, so a long job is never silent."""

    def __init__(self, steps: int, enabled: bool):
        self.steps, self.enabled, self.t0 = steps, enabled, time.time()

    def __call__(self, m: dict) -> None:
        if not self.enabled:
            return
        took = m.get("rollout_seconds", 0.0) + m.get("train_seconds", 0.0)
        el = int(time.time() - self.t0)
        print(f"step {m['step']}/{self.steps}  reward {m.get('reward_mean', float('nan')):.3f}  "
              f"accuracy {m.get('accuracy', float('nan')):.2f}  {took:.1f}s/step  elapsed "
              f"{el // 3600}:{el // 60 % 60:02d}:{el % 60:02d}", flush=True)


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


def _write_summary(out: Path, metrics_path: Path, cfg: TrainConfig, run_id: str | None = None) -> None:
    """``summary.json``: written last, so its presence means the run completed. ``mlflow_run_id``: the run that
    logged it (an evaluation of its adapters is nested under that run and logs its pass@1 there)."""
    from qerl.checkpoint import write_json

    rows = [json.loads(x) for x in metrics_path.read_text().splitlines() if x.strip()]
    steps = max((r["step"] for r in rows), default=0)
    rows = [r for r in rows if "reward_mean" in r]  # (a row marked metrics_lost holds no numbers)
    tail = rows[-max(1, len(rows) // 10):]
    write_json(out / "summary.json", {
        "method": cfg.method, "algorithm": cfg.algorithm.name, "steps": steps,
        "reward_first": rows[0]["reward_mean"] if rows else None,
        "reward_last10pct": sum(r["reward_mean"] for r in tail) / len(tail) if rows else None,
        "final": str(out / "final"),
        **({"mlflow_run_id": run_id} if run_id else {}),
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
    from qerl.train.ownership import cut_off_tail

    rows = [line for line in path.read_text().splitlines() if line.strip()]
    cut = bool(rows) and cut_off_tail(path)
    if cut:
        rows = rows[:-1]  # a row a kill cut off mid-write: recomputed with its step
    keep = [r for r in rows if json.loads(r)["step"] <= completed_steps]
    have = {json.loads(r)["step"] for r in keep}
    if lost := [s for s in range(1, completed_steps + 1) if s not in have]:
        # a step the checkpoint holds whose row was cut by a kill: its update is kept (the weights have it) but its
        # numbers are gone; a marked row keeps the steps whole, so a report names it instead of shifting the rest
        import sys

        print(f"qerl train: {path}: the row of step(s) {', '.join(map(str, lost))} was cut by an interrupted write; "
              "the checkpoint holds their updates, so the run resumes after them and marks the rows "
              '("metrics_lost": true)', file=sys.stderr)
        keep = sorted(keep + [json.dumps({"step": s, "metrics_lost": True}) for s in lost],
                      key=lambda r: json.loads(r)["step"])
    if len(keep) != len(rows) or cut or lost:  # (atomically: a kill now leaves the old rows or the kept ones)
        from qerl.files import write_jsonl

        write_jsonl(path, keep)


def _save_final(out: Path, policy, tokenizer, method, weights: dict | None = None) -> None:
    """``final/``: the PEFT adapter (LoRA methods) or the whole model (``weights``: its gathered state dict under
    FSDP2)."""
    from qerl.checkpoint import atomic_directory

    with atomic_directory(out / "final", force=True) as tmp:
        policy.save_pretrained(str(tmp), **({"state_dict": weights} if weights is not None else {}))
        if not method.lora:
            tokenizer.save_pretrained(str(tmp))
        else:  # the base it was trained on, so another base is refused when it is loaded (qerl.lora.load_adapter)
            from qerl.lora import BASE_RECORD, base_record

            base = policy.get_base_model() if hasattr(policy, "get_base_model") else policy
            write_json(tmp / BASE_RECORD, base_record(base))
