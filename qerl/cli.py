"""The ``qerl`` command line: the only module that parses argv.

Verbs (each has ``--help``):
  build-tiny     build a seeded tiny Qwen2/Llama model + tokenizer offline
  quantize       bf16 checkpoint -> compressed-tensors NVFP4 checkpoint (+ error report)
  export-merged  merge a PEFT adapter into its (dequantized) base and save a bf16 model
  sft            supervised warm-start on the synthetic task
  train          RL training (GRPO / DAPO) with one of the five methods
  evaluate       pass@1 over k samples on a benchmark
  report         paper-shaped tables, figures and index.md from results/
  download       hub snapshot at a pinned revision
  plan           estimate a training config's peak GPU memory (before loading anything)
  bench          GPU benchmarks: kernels, rollout, step
  resolve-config / mlflow-init   workflow helpers
Heavy imports happen inside each verb so ``qerl --help`` stays fast.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from qerl import __version__
from qerl.argtypes import POSITIVE, HelpFormatter, float_in as _float_in, int_at_least as _int_at_least


def _cmd_build_tiny(args) -> int:
    from qerl.models.tiny import TinySpec, save_tiny_model

    spec = TinySpec(arch=args.arch, hidden_size=args.hidden_size, intermediate_size=args.intermediate_size,
                    num_hidden_layers=args.layers, num_attention_heads=args.heads,
                    num_key_value_heads=args.kv_heads, tie_word_embeddings=args.tie_embeddings,
                    seed=args.seed)
    from qerl import outputs

    outputs.check_parent_writable(args.output, "tiny model")
    with outputs.hold(args.output, "build-tiny"):
        out = save_tiny_model(args.output, spec, max_shard_size=args.max_shard_size, force=args.force)
    print(f"wrote tiny {args.arch} model to {out}")
    return 0


def _cmd_quantize(args) -> int:
    from qerl import outputs
    from qerl.checkpoint import parse_size
    from qerl.stages.quantize import REPORT, quantize_checkpoint

    parse_size(args.max_shard_size)
    outputs.check_not_input(args.output, {"--model": args.model})
    if args.output.exists() and not args.output.is_dir():
        raise outputs.OutputNotWritable(f"--output {args.output}: is a file, not a directory")
    outputs.check_parent_writable(args.output, "quantized checkpoint")
    with outputs.hold(args.output, "quantize"):
        summary = quantize_checkpoint(args.model, args.output, force=args.force,
                                      max_shard_size=args.max_shard_size, ignore=tuple(args.ignore),
                                      revision=args.revision, progress=not args.no_progress)
    if summary.pop("up_to_date"):
        print(f"{args.output}: already quantized from this source; nothing to do")
    print(json.dumps(summary, indent=2))
    print(f"per-layer report: {Path(args.output) / REPORT}")
    return {k: v for k, v in summary.items() if isinstance(v, (int, float))}


def _cmd_export_merged(args) -> int:
    from qerl.lora import export_merged

    from qerl import outputs

    outputs.check_not_input(args.output, {"--base": args.base, "--adapter": args.adapter})
    outputs.check_parent_writable(args.output, "merged model")
    with outputs.hold(args.output, "export-merged"):
        out = export_merged(args.base, args.adapter, args.output, force=args.force)
    print(f"wrote merged bf16 model to {out}")
    return 0


def _overrides(items) -> dict:
    """``--set KEY=VALUE`` items as a dict, each value parsed as YAML."""
    import yaml

    from qerl.train.config import ConfigError

    overrides = {}
    for item in items or []:
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE (e.g. --set steps=10)")
        try:
            overrides[key.strip()] = yaml.safe_load(value)
        except yaml.YAMLError as e:
            raise ConfigError(f"--set {item!r}: the value is not valid YAML ({str(e).splitlines()[0]})") from None
    return overrides


def _train_mode(args) -> str:
    return "resume" if args.resume else "auto" if args.auto_resume else "overwrite" if args.overwrite else "new"


def _cmd_train(args) -> int:
    from qerl import outputs
    from qerl.train import ownership
    from qerl.train.config import load_config, to_dict
    from qerl.train.methods import resolve_device

    cfg = load_config(args.config, _overrides(args.set))  # a bad config fails here, before any process starts
    out = Path(cfg.output_dir)
    launching = (args.nproc > 1 or args.nnodes > 1 or args.dry_run) and "WORLD_SIZE" not in os.environ
    if not launching and os.environ.get("RANK", "0") != "0":  # a rank of a run started by torchrun itself
        return _train_rank(args, cfg, args.resume or (args.auto_resume and ownership.status(out).checkpoint_step
                                                      is not None))
    if not launching and outputs.HELD_ENV in os.environ and outputs.held_by_parent(out):  # our launcher's rank 0
        return _train_rank(args, cfg, args.resume)
    resolve_device(cfg.device)  # (a device this machine lacks is named now)
    if launching:
        _check_launch(args, cfg)
    if args.dry_run:
        return _launch(args, cfg, resume=args.resume or args.auto_resume)
    outputs.check_dir_writable(out, "output_dir")
    with outputs.hold(out, "train"):
        resume = ownership.prepare(out, _train_mode(args), to_dict(cfg))
        if resume:
            print(f"resuming from {out / ownership.CHECKPOINT} (step {ownership.status(out).checkpoint_step})",
                  flush=True)
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
                  if a not in ("--resume", "--auto-resume", "--overwrite")]
    return launch(args.nproc, args.nnodes, train_args + (["--resume"] if resume else []), args.dry_run)


def _train_rank(args, cfg, resume: bool) -> int:
    from qerl.train.loop import train

    out = train(cfg, resume=resume, progress=not args.no_progress)
    if os.environ.get("RANK", "0") == "0":
        print(f"done: metrics in {out / 'metrics.jsonl'}, final weights in {out / 'final'}")
    return 0


def _cmd_sft(args) -> int:
    from qerl.data.tasks import synthetic_arithmetic
    from qerl.train.sft import sft

    records = synthetic_arithmetic(args.size, seed=args.seed, max_operand=args.max_operand)
    from qerl import outputs

    outputs.check_not_input(args.output, {"--model": args.model})
    outputs.check_parent_writable(args.output, "warm-started model")
    with outputs.hold(args.output, "sft"):
        stats = sft(args.model, args.output, records, steps=args.steps, lr=args.lr, batch_size=args.batch_size,
                    seed=args.seed, progress=not args.no_progress, force=args.force)
    print(json.dumps(stats))
    return stats


def _cmd_evaluate(args) -> dict:
    from qerl import outputs
    from qerl.stages.evaluate import (
        EvalSettings, benchmark_source, check_outputs_are_ours, evaluate, load_for_eval, precheck,
    )
    from qerl.train.methods import DTYPES, resolve_device

    settings = EvalSettings(samples=args.samples, temperature=args.temperature, top_p=args.top_p,
                            max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, limit=args.limit,
                            seed=args.seed, template=args.template)
    benchmark_source(args.benchmark)  # an unknown benchmark is named before the model loads
    device = resolve_device(args.device)
    out = Path(args.output)
    samples = Path(args.samples_output) if args.samples_output else out.with_suffix(".samples.jsonl")
    outputs.check_file_output(out, "--output summary")
    outputs.check_file_output(samples, "--samples-output file")
    for path, flag in ((out, "--output"), (samples, "--samples-output")):
        outputs.check_not_input(path, {"--model": args.model, "--adapter": args.adapter}, flag)
    check_outputs_are_ours(out, samples)
    with outputs.hold(out, "evaluate"):
        import torch

        precheck(args.model, args.benchmark, settings, args.adapter)
        model, tok = load_for_eval(args.model, args.base, args.adapter, DTYPES[args.dtype], device)
        with torch.no_grad():
            summary = evaluate(model, tok, args.benchmark, settings, out, samples, progress=not args.no_progress,
                               meta={"model": str(args.model), "base": args.base, "adapter": str(args.adapter or "")})
    print(json.dumps({k: summary[k] for k in ("benchmark", "pass@1", "problems", "samples_per_problem")}))
    return {"pass_at_1": summary["pass@1"], "problems": summary["problems"]}


def _cmd_report(args) -> dict:
    from qerl import outputs
    from qerl.stages.report import build_report, check_report_dir, load_workflow_config

    config = load_workflow_config(Path(args.workflow_config))
    out = Path(args.output)
    if out.exists() and not out.is_dir():
        raise outputs.OutputNotWritable(f"--output {out}: is a file, not a directory")
    outputs.check_not_input(out, {"--results": args.results, "--workflow-config": args.workflow_config})
    outputs.check_parent_writable(out, "report")
    check_report_dir(out)
    with outputs.hold(out, "report"):
        idx = build_report(config, Path(args.results), out)
    print(f"wrote {idx}")
    return {}


def _cmd_download(args) -> dict:
    from qerl.models.source import download

    from qerl.checkpoint import CheckpointError, is_nonempty_dir

    if is_nonempty_dir(args.output) and not (args.output / ".cache" / "huggingface").is_dir():
        raise CheckpointError(f"--output {args.output}: holds files that are not an earlier download; refusing to "
                              "write a snapshot among them")
    path = download(args.model, args.revision, args.output)
    print(f"downloaded {args.model}@{args.revision} to {path}")
    return {}


def _cmd_resolve_config(args) -> dict:
    import yaml

    from qerl.train.config import from_dict, TrainConfig, validate
    from qerl.workflow_config import Run, train_config

    config = yaml.safe_load(Path(args.workflow_config).read_text())
    run = Run(args.model, args.method, args.algo, args.dataset, args.seed)
    cfg = train_config(config, run, args.tracking_uri)
    validate(from_dict(TrainConfig, cfg, f"{args.workflow_config} (run {run.path})"))  # fail early, name the run
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(yaml.safe_dump(cfg, sort_keys=False))
    return {}


def _cmd_mlflow_init(args) -> dict:
    from qerl.tracking import init_store

    exp = init_store(args.tracking_uri, args.experiment)
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps({"tracking_uri": args.tracking_uri, "experiment": args.experiment,
                                             "experiment_id": exp}) + "\n")
    return {}


def _add_tracking(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("MLflow (optional: log this job as a run)")
    g.add_argument("--mlflow-run-name", help="run name (the workflow uses the output path under results/)")
    g.add_argument("--mlflow-experiment", default="qerl", help="experiment name")
    g.add_argument("--mlflow-uri", default=None, help="tracking URI (default: $MLFLOW_TRACKING_URI)")
    g.add_argument("--mlflow-tag", action="append", default=[], metavar="KEY=VALUE", help="a run tag (repeatable)")


def _tracked(args, func):
    """Run a verb inside an MLflow run when --mlflow-run-name is given; log its returned metrics."""
    if not getattr(args, "mlflow_run_name", None):
        return func(args)
    import os

    from qerl.tracking import MLflowTracker
    from qerl.train.tracking_setup import git_commit

    uri = args.mlflow_uri or os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        raise ValueError("--mlflow-run-name needs --mlflow-uri or MLFLOW_TRACKING_URI")
    tags = dict(t.split("=", 1) for t in args.mlflow_tag)
    if os.environ.get("QERL_CONFIG_HASH"):  # the workflow's config hash (workflow/rules/common.smk)
        tags.setdefault("config_hash", os.environ["QERL_CONFIG_HASH"])
    tags.update(command=args.command, git_commit=git_commit())
    tracker = MLflowTracker(args.mlflow_experiment, args.mlflow_run_name, uri, tags=tags)
    try:
        tracker.log_params({k: v for k, v in vars(args).items() if k not in ("func",) and not k.startswith("mlflow")})
        result = func(args) or {}
        tracker.log_metrics(result, step=0)
        tracker.close("FINISHED")
    except BaseException:
        tracker.close("FAILED")
        raise
    return 0


def _cmd_bench(args) -> int:
    if args.what == "rollout":
        from qerl.bench import rollout as bench_rollout

        return bench_rollout.main(args.rest)
    if args.what == "step":
        from qerl.bench import step as bench_step

        return bench_step.main(args.rest)
    from qerl.bench import kernels as bench_kernels

    return bench_kernels.main(args.rest)


def _cmd_plan(args) -> int:
    from qerl.train.config import load_config
    from qerl.train.plan import plan_config

    cfg = load_config(args.config, _overrides(args.set))
    res = plan_config(cfg, shape=args.shape, available=None if args.gpu_gb is None else args.gpu_gb * 1e9,
                      world=args.nproc)
    print(json.dumps(res, default=float) if args.json else res["markdown"], end="\n" if args.json else "")
    return 0 if res["fits"] else 3


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="qerl", description="QeRL: RL on NVFP4-quantized LLMs with LoRA and AQN.")
    p.add_argument("--version", action="version", version=f"qerl {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _plain_add = sub.add_parser
    sub.add_parser = lambda *a, **k: _plain_add(*a, formatter_class=HelpFormatter, **k)  # defaults shown

    t = sub.add_parser("build-tiny", help="build a seeded tiny model + tokenizer (offline)",
                       description="Build a small random Qwen2/Llama model and a byte-level tokenizer, "
                                   "entirely offline, for tests and the embedded default workflow.")
    t.add_argument("--output", required=True, type=Path, help="output model directory")
    t.add_argument("--arch", choices=["qwen2", "llama"], default="qwen2", help="architecture")
    t.add_argument("--seed", type=_int_at_least(0), default=0, help="weight initialisation seed")
    t.add_argument("--hidden-size", type=POSITIVE, default=64, help="model width (a multiple of 16)")
    t.add_argument("--intermediate-size", type=POSITIVE, default=128, help="MLP width (a multiple of 16)")
    t.add_argument("--layers", type=POSITIVE, default=2, help="decoder layers")
    t.add_argument("--heads", type=POSITIVE, default=4, help="attention heads (divide --hidden-size)")
    t.add_argument("--kv-heads", type=POSITIVE, default=2, help="key/value heads (divide --heads)")
    t.add_argument("--tie-embeddings", action="store_true", help="share the input embedding and the LM head")
    t.add_argument("--max-shard-size", default="2GB", help="safetensors shard size, e.g. 500MB, 2GB")
    t.add_argument("--force", action="store_true", help="replace an output directory that holds another model")
    t.set_defaults(func=_cmd_build_tiny)

    q = sub.add_parser("quantize", help="write an NVFP4 (compressed-tensors) checkpoint",
                       description="Quantize every decoder Linear of a Hugging Face causal LM to NVFP4 "
                                   "(calibration-free, round-to-nearest) and write a compressed-tensors "
                                   "'nvfp4-pack-quantized' checkpoint that vLLM, llm-compressor and "
                                   "transformers read. Streams tensor by tensor; writes atomically.")
    q.add_argument("--model", required=True, help="local model directory or hub id (e.g. Qwen/Qwen2.5-7B-Instruct)")
    q.add_argument("--output", required=True, type=Path, help="output checkpoint directory")
    q.add_argument("--revision", default=None, help="hub revision (commit/tag) to pin")
    q.add_argument("--force", action="store_true", help="replace an output directory holding another model")
    q.add_argument("--max-shard-size", default="2GB", help="output shard size, e.g. 500MB, 2GB")
    q.add_argument("--ignore", nargs="*", default=["lm_head"],
                   help="modules left unquantized: names, class names or 're:' regexes")
    q.add_argument("--no-progress", action="store_true", help="no progress bar")
    q.set_defaults(func=_cmd_quantize)

    e = sub.add_parser("export-merged", help="merge a LoRA adapter into a bf16 model",
                       description="Merge a PEFT adapter into its base (an NVFP4 base is dequantized "
                                   "first) and save a dense bf16 Hugging Face model.")
    e.add_argument("--base", required=True, help="base model directory (bf16 or NVFP4)")
    e.add_argument("--adapter", required=True, type=Path, help="PEFT adapter directory")
    e.add_argument("--output", required=True, type=Path, help="output bf16 model directory")
    e.add_argument("--force", action="store_true", help="replace an existing output directory")
    e.set_defaults(func=_cmd_export_merged)
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
    how.add_argument("--overwrite", action="store_true",
                     help="delete the run in output_dir (metrics, checkpoint, final/, summary) and start over")
    r.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="override a config value, e.g. --set steps=10 --set algorithm.name=dapo")
    r.add_argument("--no-progress", action="store_true",
                   help="no progress bar: one log line per step (reward, accuracy, time) instead (workflow jobs)")
    r.add_argument("--nproc", type=POSITIVE, default=1,
                   help="data-parallel processes (one per GPU): relaunches itself under torchrun; each rank "
                        "generates and trains on its share of every step's prompts")
    r.add_argument("--nnodes", type=POSITIVE, default=1,
                   help="nodes of a SLURM allocation (srun + torchrun, --nproc per node)")
    r.add_argument("--dry-run", action="store_true", help="print the torchrun / srun command instead of running it")
    r.set_defaults(func=_cmd_train)

    f = sub.add_parser("sft", help="supervised warm-start on the synthetic arithmetic task",
                       description="Full-parameter SFT of a (tiny) model on the offline synthetic arithmetic "
                                   "task, so RL starts with non-zero reward.")
    f.add_argument("--model", required=True, help="model directory to start from")
    f.add_argument("--output", required=True, type=Path, help="output model directory")
    f.add_argument("--steps", type=POSITIVE, default=200, help="optimizer steps")
    f.add_argument("--lr", type=_float_in(0.0, lo_open=True), default=3e-3, help="AdamW learning rate")
    f.add_argument("--batch-size", type=POSITIVE, default=32, help="problems per step")
    f.add_argument("--size", type=POSITIVE, default=2000, help="number of synthetic problems")
    f.add_argument("--max-operand", type=POSITIVE, default=9, help="largest operand of the synthetic problems")
    f.add_argument("--seed", type=_int_at_least(0), default=0, help="data and initialisation seed")
    f.add_argument("--no-progress", action="store_true", help="no progress bar")
    f.add_argument("--force", action="store_true", help="replace an output directory that holds another model")
    f.set_defaults(func=_cmd_sft)
    _add_tracking(f)

    v = sub.add_parser("evaluate", help="pass@1 over k samples on a benchmark",
                       description="Evaluate a base model or a trained policy (adapter on its quantized or bf16 "
                                   "base, as trained) on a benchmark: mean pass@1 over k samples per problem. "
                                   "Writes a summary JSON and per-sample JSONL.")
    v.add_argument("--model", required=True, help="base model directory (bf16, or NVFP4 checkpoint)")
    v.add_argument("--base", choices=["bf16", "nvfp4", "nf4"], required=True, help="format to run the base in")
    v.add_argument("--adapter", default=None, help="PEFT adapter directory (trained LoRA)")
    v.add_argument("--benchmark", required=True,
                   help="synthetic_test | gsm8k_test | math500 | aime24 | aime25 | amc23")
    v.add_argument("--output", required=True, help="summary JSON path")
    v.add_argument("--samples-output", default=None, help="per-sample JSONL (default: beside the JSON)")
    v.add_argument("--samples", type=POSITIVE, default=4, help="k samples per problem (pass@1 is their mean)")
    v.add_argument("--temperature", type=_float_in(0.0), default=0.6,
                   help="sampling temperature (0 = greedy; paper 0.6)")
    v.add_argument("--top-p", type=_float_in(0.0, 1.0, lo_open=True), default=0.95,
                   help="nucleus sampling mass (paper 0.95)")
    v.add_argument("--max-new-tokens", type=POSITIVE, default=4096, help="completion length limit (paper 4096)")
    v.add_argument("--batch-size", type=POSITIVE, default=32, help="sequences per generation batch")
    v.add_argument("--limit", type=POSITIVE, default=None, help="only the first N problems (default: all)")
    v.add_argument("--template", default="paper", choices=["raw", "chat", "paper"],
                   help="prompt template for hub benchmarks")
    v.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                   help="compute dtype of the model")
    v.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    v.add_argument("--seed", type=_int_at_least(0), default=0, help="sampling seed")
    v.add_argument("--no-progress", action="store_true",
                   help="no progress bar: one log line per chunk of problems instead (workflow jobs)")
    v.set_defaults(func=_cmd_evaluate)
    _add_tracking(v)

    rp = sub.add_parser("report", help="tables (paper-shaped, paper numbers adjacent), figures, index.md",
                        description="Build Table 1 / Table 2 (Markdown + CSV) with the paper's numbers in adjacent "
                                    "columns, training-curve / σ / accuracy figures and an index.md, from results/.")
    rp.add_argument("--workflow-config", required=True, help="the workflow config (config/*.yaml)")
    rp.add_argument("--results", default="results", help="the workflow's results directory (train/, eval/)")
    rp.add_argument("--output", required=True, help="report directory, e.g. reports/<configuration>")
    rp.set_defaults(func=_cmd_report)
    _add_tracking(rp)

    d = sub.add_parser("download", help="hub snapshot of a model at a pinned revision",
                       description="Download a Hugging Face model snapshot (weights, config, tokenizer) at a pinned "
                                   "revision into a local directory.")
    d.add_argument("--model", required=True, help="hub id, e.g. Qwen/Qwen2.5-7B-Instruct")
    d.add_argument("--revision", required=True, help="commit hash or tag to pin")
    d.add_argument("--output", required=True, type=Path, help="local model directory to write")
    d.set_defaults(func=_cmd_download)

    c = sub.add_parser("resolve-config", help="write the resolved qerl-train config of one workflow run",
                       description="Resolve one run of a workflow config's experiment matrix into a strict "
                                   "`qerl train` config file (validated).")
    c.add_argument("--workflow-config", required=True, help="the workflow config (config/*.yaml)")
    for name in ("model", "method", "algo", "dataset"):
        c.add_argument(f"--{name}", required=True, help=f"the run's {name} (a name of the workflow config)")
    c.add_argument("--seed", type=_int_at_least(0), required=True, help="the run's seed")
    c.add_argument("--tracking-uri", required=True, help="MLflow tracking URI of the run")
    c.add_argument("--output", required=True, help="resolved config YAML to write")
    c.set_defaults(func=_cmd_resolve_config)

    mi = sub.add_parser("mlflow-init", help="create the MLflow store and experiment before parallel jobs",
                        description="Create the MLflow tracking store (schema) and experiment once, so that "
                                    "parallel jobs only append runs.")
    mi.add_argument("--tracking-uri", required=True, help="MLflow tracking URI (e.g. sqlite:///results/mlflow.db)")
    mi.add_argument("--experiment", required=True, help="experiment name")
    mi.add_argument("--output", required=True, help="marker JSON written on success")
    mi.set_defaults(func=_cmd_mlflow_init)

    bk = sub.add_parser("bench", help="benchmarks: `qerl bench kernels | rollout | step` (GPU)",
                        description="Benchmarks. `qerl bench kernels [--output DIR] [--models 7B 14B 32B] [--ms ...] "
                                    "[--tune]` times the NVFP4 Triton kernels against cuBLAS bf16 on Qwen2.5 "
                                    "projection shapes and writes <device>.csv / .md (needs a CUDA GPU). "
                                    "`qerl bench rollout [--models ...] [--bases ...] [--batches ...]` measures "
                                    "rollout tokens/s of the engine, the reference sampler and transformers "
                                    "(reports/rollout/<device>.csv / .md / .png). `qerl bench step [--models ...] "
                                    "[--methods lora qlora qerl] [--batches 2 8] [--gen-lens 1024 2048]` times full "
                                    "GRPO steps and their peak memory (reports/step/<device>.csv / .md).")
    bk.add_argument("what", choices=["kernels", "rollout", "step"], help="which benchmark")
    bk.add_argument("rest", nargs=argparse.REMAINDER,
                    help="options of the benchmark (see `qerl bench kernels|rollout|step --help`)")
    bk.set_defaults(func=_cmd_bench)

    pl = sub.add_parser("plan", help="estimate a training config's peak GPU memory before loading anything",
                        description="Estimate the peak GPU memory of `qerl train --config FILE` (weights, LoRA and "
                                    "optimizer states, rollout KV cache, update activations; qerl.train.plan) from "
                                    "the model's config.json (or --shape for a Qwen2.5 size) and say whether it fits.")
    pl.add_argument("--config", required=True, type=Path, help="YAML training config")
    pl.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config value (as in train)")
    pl.add_argument("--shape", choices=["7B", "14B", "32B"], default=None,
                    help="use Qwen2.5 shapes instead of reading model.path's config.json")
    pl.add_argument("--gpu-gb", type=_float_in(0.0, lo_open=True), default=None,
                    help="memory to plan for (default: this GPU, else 80)")
    pl.add_argument("--json", action="store_true", help="JSON instead of Markdown")
    pl.add_argument("--nproc", type=POSITIVE, default=1, help="data-parallel processes sharing each step (per-process plan)")
    pl.set_defaults(func=_cmd_plan)

    _add_tracking(q)
    return p


def _one_line(e: BaseException) -> str:
    """An error message on one line (YAML and library messages span several: joined with ' | ')."""
    return " | ".join(x.strip() for x in str(e).splitlines() if x.strip() and x.strip() != "^")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    args.argv = argv
    try:
        return _run(args)
    except KeyboardInterrupt:  # (Ctrl-C while the libraries load, before a verb's own handling)
        print(f"qerl {args.command}: interrupted; outputs are written atomically, so none is half-written",
              file=sys.stderr)
        return 130


def _run(args) -> int:
    from qerl.errors import USER_ERRORS, TrainingInterrupted
    from qerl.gpu_claim import claim_from_env

    try:  # a workflow job of a local multi-GPU run: its own GPUs (before CUDA starts)
        claim_from_env()
    except RuntimeError as e:
        print(f"qerl {args.command}: error: {e}", file=sys.stderr)
        return 2

    try:
        result = _tracked(args, args.func)
        return result if isinstance(result, int) else 0
    except TrainingInterrupted as e:
        print(f"qerl {args.command}: {e}", file=sys.stderr)
        return 130
    except USER_ERRORS as e:
        print(f"qerl {args.command}: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except OSError as e:  # a read-only or full file system, a permission: the path and the reason
        from qerl.outputs import describe_os_error

        print(f"qerl {args.command}: error: {describe_os_error(e, getattr(args, 'output', None))}", file=sys.stderr)
        return 2

if __name__ == "__main__":
    sys.exit(main())
