"""``qerl bench kernels | rollout | step | rehearsal`` (the options of each: ``qerl bench <what> --help``) and ``qerl
mlflow-init`` (the workflow's helper that creates the MLflow store before parallel jobs)."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from qerl.files import write_text_atomic


def add_bench(sub) -> None:
    bk = sub.add_parser("bench", help="benchmarks: `qerl bench kernels | rollout | step` (GPU)",
                        description="Benchmarks. `qerl bench kernels [--output DIR] [--models 7B 14B 32B] [--ms ...] "
                                    "[--tune]` times the NVFP4 Triton kernels against cuBLAS bf16 on Qwen2.5 "
                                    "projection shapes and writes <device>.csv / .md (needs a CUDA GPU). "
                                    "`qerl bench rollout [--models ...] [--bases ...] [--batches ...]` measures "
                                    "rollout tokens/s of the engine, the reference sampler and transformers "
                                    "(reports/rollout/<device>.csv / .md / .png). `qerl bench step [--models ...] "
                                    "[--methods lora qlora qerl] [--batches 2 8] [--gen-lens 1024 2048]` times full "
                                    "GRPO steps and their peak memory (reports/step/<device>.csv / .md). "
                                    "`qerl bench rehearsal [--shapes 3B 7B] [--steps 2]` runs the paper's stages "
                                    "(quantize, train, evaluate) on random-weight stand-ins, timed "
                                    "(reports/reproduce/rehearsal_<device>.csv / .md). `qerl bench cost "
                                    "[--configfile config/paper.yaml]` projects each paper table's GPU-hours from "
                                    "those measurements (no GPU; reports/reproduce/cost_<device>.csv / .md). `qerl bench host "
                                    "[--models 0.5B 7B] [--ms ...]` measures the host time of eager NVFP4 calls "
                                    "(reports/host/<device>.csv / .md). `qerl bench logprobs [--tokens ...] [--hidden ...]` times "
                                    "the update's per-token log-probs, fused blocks against torch's composite "
                                    "(reports/logprobs/<device>.csv / .md). `qerl bench layout [--models ...] [--ms ...]` "
                                    "times NVFP4 calls on tile-contiguous against row-major weights "
                                    "(reports/layout/<device>.csv / .md). `qerl bench hf [--models 7B] [--batch 8]` "
                                    "times one GRPO step of TRL's GRPOTrainer on bf16 + LoRA, the same on qerl's "
                                    "NVFP4 base with qerl.hf.rollout_func, and qerl train's own (reports/hf/<device>.csv "
                                    "/ .md).")
    bk.add_argument("what", choices=["kernels", "host", "logprobs", "layout", "rollout", "step", "rehearsal", "cost", "hf"],
                    help="which benchmark")
    bk.add_argument("rest", nargs=argparse.REMAINDER,
                    help="options of the benchmark (see `qerl bench kernels|rollout|step|rehearsal|cost --help`)")
    bk.set_defaults(func=run_bench)


def run_bench(args) -> int:
    if args.what == "hf":
        from qerl.bench import hf as bench_hf

        return bench_hf.main(args.rest)
    if args.what == "host":
        from qerl.bench import host as bench_host

        return bench_host.main(args.rest)
    if args.what == "logprobs":
        from qerl.bench import logprobs as bench_logprobs

        return bench_logprobs.main(args.rest)
    if args.what == "layout":
        from qerl.bench import layout as bench_layout

        return bench_layout.main(args.rest)
    if args.what == "rollout":
        from qerl.bench import rollout as bench_rollout

        return bench_rollout.main(args.rest)
    if args.what == "step":
        from qerl.bench import step as bench_step

        return bench_step.main(args.rest)
    if args.what == "cost":
        from qerl.bench import cost as bench_cost

        return bench_cost.main(args.rest)
    if args.what == "rehearsal":
        from qerl.bench import rehearsal

        return rehearsal.main(args.rest)
    from qerl.bench import kernels as bench_kernels

    return bench_kernels.main(args.rest)


def add_mlflow_init(sub) -> None:
    mi = sub.add_parser("mlflow-init", help="workflow helper: the MLflow store and the run of one invocation",
                        description="Create the MLflow tracking store (schema) and experiment once, so that "
                                    "parallel jobs only append runs; with --parent-run, also start the run of this "
                                    "workflow invocation (the jobs' runs nest under it) and print its id. "
                                    "--end RUN_ID closes such a run instead.")
    mi.add_argument("--tracking-uri", required=True, help="MLflow tracking URI (e.g. sqlite:///results/mlflow.db)")
    mi.add_argument("--experiment", help="experiment name (with --output / --parent-run)")
    mi.add_argument("--output", help="marker JSON written on success (tracking URI, experiment, ids)")
    mi.add_argument("--parent-run", metavar="NAME", help="start the invocation's run, named NAME")
    mi.add_argument("--config", type=Path, help="with --parent-run: the effective workflow config (an artifact)")
    mi.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                    help="with --parent-run: a param of the invocation's run (repeatable)")
    mi.add_argument("--end", metavar="RUN_ID", help="close the invocation's run RUN_ID")
    mi.add_argument("--status", default="FINISHED", choices=("FINISHED", "FAILED", "KILLED"), help="with --end")
    mi.add_argument("--artifacts", type=Path, help="with --end: a report directory whose figures and tables "
                                                   "(*.png, *.csv, *.md) the run keeps under report/")
    mi.set_defaults(func=run_mlflow_init)


def run_mlflow_init(args) -> dict:
    from qerl.tracking import end_parent, init_store, start_parent

    if args.end:
        files = sorted(p for p in args.artifacts.glob("*") if p.suffix in (".png", ".csv", ".md")) \
            if args.artifacts and args.artifacts.is_dir() else []
        end_parent(args.tracking_uri, args.end, args.status, files)
        return {}
    if not (args.experiment and args.output):
        raise ValueError("mlflow-init: --experiment and --output are needed (or --end RUN_ID)")
    exp = init_store(args.tracking_uri, args.experiment)
    marker = {"tracking_uri": args.tracking_uri, "experiment": args.experiment, "experiment_id": exp}
    if args.parent_run:
        from qerl.cli.common import key_value_options

        params = key_value_options(args.param, "--param")
        tags = {"configuration": args.experiment}
        if args.config:  # the run's description: what the configuration compares
            import yaml

            from qerl.tracking_links import describe

            tags["mlflow.note.content"] = describe(yaml.safe_load(args.config.read_text()) or {})
        marker["parent_run_id"] = start_parent(args.tracking_uri, args.experiment, args.parent_run, params, tags,
                                               [args.config] if args.config else [])
    write_text_atomic(args.output, json.dumps(marker) + "\n")
    print(json.dumps(marker))
    return {}
