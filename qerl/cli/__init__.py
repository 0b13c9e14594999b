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
  fetch          every hub input of a workflow config into the cache + a lock file (then run offline)
  plan           estimate a training config's peak GPU memory (before loading anything)
  status         every training job of a results tree: step / total, reward, s/step, ETA (while it runs)
  bench          GPU benchmarks: kernels, rollout, step
  mlflow-init    workflow helper: the MLflow store before parallel jobs
Heavy imports happen inside each verb so ``qerl --help`` stays fast.
"""
from __future__ import annotations

import argparse
import functools
import os
import sys

from qerl import __version__
from qerl.argtypes import HelpFormatter
from qerl.cli import bench, evaluate, models, status, train
from qerl.cli.common import tracked

# the verbs in the order `qerl --help` lists them: each module's add_<verb>(sub) builds its parser
VERBS = (models.add_build_tiny, models.add_quantize, models.add_export_merged, models.add_sft, train.add_train,
         evaluate.add_evaluate, evaluate.add_report, evaluate.add_claims, models.add_download, models.add_from_gguf, models.add_fetch, train.add_plan, status.add_status,
         bench.add_bench, bench.add_mlflow_init)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="qerl", description="QeRL: RL on NVFP4-quantized LLMs with LoRA and AQN.")
    p.add_argument("--version", action="version", version=f"qerl {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND",
                           parser_class=functools.partial(argparse.ArgumentParser, formatter_class=HelpFormatter))
    for add in VERBS:
        add(sub)
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


ALLOC_CONF = "expandable_segments:True"


def cuda_alloc_defaults(env=os.environ) -> None:
    """PyTorch's caching allocator with expandable segments unless the user set ``PYTORCH_CUDA_ALLOC_CONF``
    (read when CUDA first allocates, so before that; torchrun's workers inherit it). The update runs micro-batches
    of varying widths (each on its live columns, rows sorted by length): with fixed segments the freed blocks of
    one width fit the next badly, and a 14B step that fits at 70 GB ran out of memory with 4 GB free (H100,
    reports/step/README.md)."""
    env.setdefault("PYTORCH_CUDA_ALLOC_CONF", ALLOC_CONF)


def _run(args) -> int:
    from qerl.errors import USER_ERRORS, TrainingInterrupted
    from qerl.gpu_claim import claim_from_env

    cuda_alloc_defaults()

    try:  # a workflow job of a local multi-GPU run: its own GPUs (before CUDA starts)
        claim_from_env()
    except RuntimeError as e:
        print(f"qerl {args.command}: error: {e}", file=sys.stderr)
        return 2

    try:
        result = tracked(args, args.func)
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
