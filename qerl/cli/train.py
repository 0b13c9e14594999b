"""``qerl train | plan``: RL training of one config (single process or relaunched under torchrun) and its memory
plan."""
from __future__ import annotations

import json
import os
from pathlib import Path

from qerl.argtypes import MAX_GPUS, float_in, int_at_least
from qerl.cli.common import overrides
from qerl.models.shapes import QWEN25


def add_train(sub) -> None:
    r = sub.add_parser("train", help="RL training (GRPO/DAPO) of one method",
                       description="Train a policy with GRPO / DAPO / Dr. GRPO using one of the methods "
                                   "full, lora, qlora, nvfp4_lora, qerl. Writes metrics.jsonl, checkpoints "
                                   "and the final adapter under the config's output_dir.")
    r.add_argument("--config", required=True, type=Path, help="YAML training config")
    how = r.add_mutually_exclusive_group()
    how.add_argument("--resume", action="store_true", help="continue the run in output_dir from its checkpoint")
    how.add_argument("--auto-resume", action="store_true",
                     help="resume if output_dir has a checkpoint, start if it holds no run, else refuse (never "
                          "restarts over logged steps; what the workflow uses)")
    how.add_argument("--rerun", action="store_true",
                     help="what a workflow job does: continue output_dir's checkpoint when it is of this very run (a "
                          "killed job), else start over as --overwrite does (a changed config, a run stopped before "
                          "its first checkpoint), saying why")
    how.add_argument("--overwrite", action="store_true",
                     help="delete the run in output_dir (metrics, checkpoint, final/, summary) and start over")
    r.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="override a config value, e.g. --set steps=10 --set algorithm.name=dapo")
    r.add_argument("--no-progress", action="store_true",
                   help="no progress bar: one log line per step (reward, accuracy, time) instead (workflow jobs)")
    r.add_argument("--nproc", type=int_at_least(1, MAX_GPUS), default=1,
                   help="data-parallel processes (one per GPU): relaunches itself under torchrun; each rank "
                        "generates and trains on its share of every step's prompts")
    r.add_argument("--nnodes", type=int_at_least(1, MAX_GPUS), default=1,
                   help="nodes of a SLURM allocation (srun + torchrun, --nproc per node)")
    r.add_argument("--dry-run", action="store_true", help="print the torchrun / srun command instead of running it")
    r.set_defaults(func=run_train)


def _train_mode(args) -> str:
    return ("resume" if args.resume else "auto" if args.auto_resume else "rerun" if args.rerun else
            "overwrite" if args.overwrite else "new")


def run_train(args) -> int:
    from qerl import outputs
    from qerl.train import ownership
    from qerl.train.config import load_config, to_dict
    from qerl.train.methods import resolve_device

    cfg = load_config(args.config, overrides(args.set))  # a bad config fails here, before any process starts
    if cfg.tracking.backend == "mlflow":
        from qerl.tracking import check_reachable

        check_reachable(cfg.tracking.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI"),
                        what="tracking.tracking_uri")
    out = Path(cfg.output_dir)
    launching = (args.nproc > 1 or args.nnodes > 1 or args.dry_run) and "WORLD_SIZE" not in os.environ
    if not launching and os.environ.get("RANK", "0") != "0":  # a rank of a run started by torchrun itself
        return _train_rank(args, cfg, args.resume or ((args.auto_resume or args.rerun) and
                                                      ownership.status(out).checkpoint_step is not None))
    if not launching and outputs.held_by_parent(out):  # rank 0 of our own launcher (it holds the lock)
        return _train_rank(args, cfg, args.resume)
    resolve_device(cfg.device)  # (a device this machine lacks is named now)
    if launching:
        _check_launch(args, cfg)
    if args.dry_run:
        return _launch(args, cfg, resume=args.resume or args.auto_resume or args.rerun)
    outputs.check_dir_writable(out, "output_dir")
    with outputs.hold(out, "train"):
        resume = ownership.prepare(out, _train_mode(args), to_dict(cfg))
        if resume:
            ckpt = out / ownership.CHECKPOINT
            print(f"resuming from {ckpt} (step {ownership.checkpoint_step(ckpt)})", flush=True)
        if launching:
            return _launch(args, cfg, resume)
        return _train_rank(args, cfg, resume)


def _check_launch(args, cfg) -> None:
    """Before any process starts or anything is written: the prompts split over the ranks, one GPU per rank."""
    from qerl.train.dist import Dist, check_divisible

    check_divisible(cfg.prompts_per_step, Dist(world=args.nproc * args.nnodes))
    import torch

    if (cfg.device != "cpu" and args.nnodes == 1 and torch.cuda.is_available()
            and torch.cuda.device_count() < args.nproc and not os.environ.get("QERL_DIST_BACKEND")):
        raise ValueError(f"--nproc {args.nproc}: this machine has {torch.cuda.device_count()} GPU(s) (one process "
                         "per GPU; set device: cpu to run the processes on the CPU)")


def _launch(args, cfg, resume: bool) -> int:
    """``--nproc`` / ``--nnodes``: torchrun (+ srun) starts the ranks; they inherit the lock and the decision."""
    from qerl.train.launch import launch, strip_launch_args

    train_args = [a for a in strip_launch_args(args.argv[args.argv.index("train") + 1:])
                  if a not in ("--resume", "--auto-resume", "--rerun", "--overwrite")]
    return launch(args.nproc, args.nnodes, train_args + (["--resume"] if resume else []), args.dry_run)


def _train_rank(args, cfg, resume: bool) -> int:
    from qerl.train.loop import train

    out = train(cfg, resume=resume, progress=not args.no_progress)
    if os.environ.get("RANK", "0") == "0":
        print(f"done: metrics in {out / 'metrics.jsonl'}, final weights in {out / 'final'}")
    return 0


def add_plan(sub) -> None:
    pl = sub.add_parser("plan", help="estimate a training config's peak GPU memory before loading anything",
                        description="Estimate the peak GPU memory of `qerl train --config FILE` (weights, LoRA and "
                                    "optimizer states, rollout KV cache, update activations; qerl.train.plan) from "
                                    "the model's config.json (or --shape for a Qwen2.5 size) and say whether it fits.")
    pl.add_argument("--config", required=True, type=Path, help="YAML training config")
    pl.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config value (as in train)")
    pl.add_argument("--shape", choices=list(QWEN25), default=None,
                    help="use Qwen2.5 shapes instead of reading model.path's config.json")
    pl.add_argument("--gpu-gb", type=float_in(0.0, lo_open=True), default=None,
                    help="memory to plan for (default: this GPU, else 80)")
    pl.add_argument("--json", action="store_true", help="JSON instead of Markdown")
    pl.add_argument("--nproc", type=int_at_least(1, MAX_GPUS), default=1, help="data-parallel processes sharing each step (per-process plan)")
    pl.add_argument("--cost", action="store_true",
                    help="also project the run's GPU time on an H100 from the measured rates "
                         "(qerl.bench.projection; needs --shape): every completion at the cap, and completions drawn "
                         "from --lengths")
    pl.add_argument("--lengths", default=None, metavar="SPEC",
                    help="assumed completion lengths for --cost (fixed | lognormal:median=M,sigma=S | "
                         "uniform:low=A,high=B; default lognormal:median=300,sigma=0.9)")
    pl.set_defaults(func=run_plan)


def run_plan(args) -> int:
    from qerl.bench.lengths import REALISTIC, parse
    from qerl.train.config import load_config
    from qerl.train.plan import plan_config

    if args.lengths is not None and not args.cost:
        raise ValueError("--lengths: used only with --cost (the projected GPU time); the memory plan takes every "
                         "completion at rollout.max_new_tokens")
    args.lengths = args.lengths or REALISTIC
    parse(args.lengths)  # (a bad spec is one line before any planning)

    cfg = load_config(args.config, overrides(args.set))
    if args.nproc > 1:  # the split qerl train --nproc refuses, refused here too (a plan must not say it fits)
        from types import SimpleNamespace

        from qerl.train.dist import check_divisible

        check_divisible(cfg.prompts_per_step, SimpleNamespace(on=True, world=args.nproc))
    resolved = _run_plan(cfg, args)
    run_plan = None
    if resolved is not None:  # the plan qerl train would resolve here: its memory verdict is printed as it is
        cfg, run_plan, memory = resolved
    if resolved is not None and memory is not None and args.shape is None:
        res = memory
    else:
        res = plan_config(cfg, shape=args.shape, available=None if args.gpu_gb is None else args.gpu_gb * 1e9,
                          world=args.nproc)
    if run_plan is not None:
        res["run_plan"] = run_plan.lines()
        if not args.json:
            print("\n".join(run_plan.lines()))
    if args.cost:
        res["cost"] = _plan_cost(args, cfg)
    print(json.dumps(res, default=float) if args.json else res["markdown"] + res.get("cost", {}).get("markdown", ""),
          end="\n" if args.json else "")
    return 0 if res["fits"] else 3


def _run_plan(cfg, args):
    """``(resolved config, RunPlan, memory plan)``: what ``qerl train --config`` would resolve on this machine
    (:mod:`qerl.train.runplan`, the same call), for a local model on
    the config's device; None for a hub id (planned after download) or a GPU config on a machine without one (the
    memory plan below still answers for ``--gpu-gb``)."""
    from pathlib import Path

    from qerl.train.methods import resolve_device
    from qerl.train.runplan import resolve

    if not (Path(cfg.model.path) / "config.json").exists():
        return None
    try:
        device = resolve_device(cfg.device)
    except Exception:  # (a CUDA config planned on a CPU machine)
        return None
    if device.type == "cuda" and args.gpu_gb is not None:
        return None  # the plan for another GPU's memory is the estimate below, not this machine's
    return resolve(cfg, device.type, args.nproc)


def _plan_cost(args, cfg) -> dict:
    """``qerl plan --cost``: the run's projected hours at the cap and with ``--lengths``
    (:func:`qerl.bench.projection.run_cost`)."""
    from qerl.bench.lengths import parse
    from qerl.train.config import ConfigError
    from qerl.bench.projection import DEVICE, run_cost

    if args.shape is None:
        raise ConfigError("qerl plan --cost: pass --shape 3B|7B|14B|32B (the measured rates are per Qwen2.5 shape)")
    spec = parse(args.lengths)  # (a bad spec: a clear error naming it)
    gb = 80.0 if args.gpu_gb is None else args.gpu_gb
    cap = run_cost(cfg, args.shape, None, gb)
    real = None if spec.fixed else run_cost(cfg, args.shape, str(spec), gb)
    out = {"device": DEVICE, "cap": cap, "assumed": real}
    lines = [f"\nProjected time on one {DEVICE} ({cfg.steps} steps, {cap['rows']} sequences × {cap['cap']} tokens, "
             f"μ = {cfg.algorithm.updates_per_batch}; qerl.bench.projection):"]
    for name, c in (("every completion at the cap", cap), (f"completions `{spec}`", real)):
        if c is not None:
            lines.append(f"- {name}: {c['step_s']:.0f} s per step (rollout {c['rollout_s']:.0f} s, log-prob + update "
                         f"{c['update_s']:.0f} s) → **{c['hours']:.1f} GPU-hours**")
    out["markdown"] = "\n".join(lines) + "\n"
    return out
