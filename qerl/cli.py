"""The ``qerl`` command line: the only module that parses argv.

Verbs (each has ``--help``):
  build-tiny     build a seeded tiny Qwen2/Llama model + tokenizer offline
  quantize       bf16 checkpoint -> compressed-tensors NVFP4 checkpoint (+ error report)
  export-merged  merge a PEFT adapter into its (dequantized) base and save a bf16 model
  sft            supervised warm-start on the synthetic task
  train          RL training (GRPO / DAPO) with one of the five methods
Heavy imports happen inside each verb so ``qerl --help`` stays fast.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from qerl import __version__


def _cmd_build_tiny(args) -> int:
    from qerl.models.tiny import TinySpec, save_tiny_model

    spec = TinySpec(arch=args.arch, hidden_size=args.hidden_size, intermediate_size=args.intermediate_size,
                    num_hidden_layers=args.layers, num_attention_heads=args.heads,
                    num_key_value_heads=args.kv_heads, tie_word_embeddings=args.tie_embeddings,
                    seed=args.seed)
    out = save_tiny_model(args.output, spec, max_shard_size=args.max_shard_size)
    print(f"wrote tiny {args.arch} model to {out}")
    return 0


def _cmd_quantize(args) -> int:
    from qerl.stages.quantize import REPORT, quantize_checkpoint

    summary = quantize_checkpoint(args.model, args.output, force=args.force,
                                  max_shard_size=args.max_shard_size, ignore=tuple(args.ignore),
                                  revision=args.revision, progress=not args.no_progress)
    if summary.pop("up_to_date"):
        print(f"{args.output}: already quantized from this source; nothing to do")
    print(json.dumps(summary, indent=2))
    print(f"per-layer report: {Path(args.output) / REPORT}")
    return 0


def _cmd_export_merged(args) -> int:
    from qerl.lora import export_merged

    out = export_merged(args.base, args.adapter, args.output, force=args.force)
    print(f"wrote merged bf16 model to {out}")
    return 0


def _cmd_train(args) -> int:
    from qerl.train.config import load_config
    from qerl.train.loop import train

    overrides = {}
    for item in args.set or []:
        key, _, value = item.partition("=")
        import yaml

        overrides[key] = yaml.safe_load(value)
    cfg = load_config(args.config, overrides)
    out = train(cfg, resume=args.resume, progress=not args.no_progress)
    print(f"done: metrics in {out / 'metrics.jsonl'}, final weights in {out / 'final'}")
    return 0


def _cmd_sft(args) -> int:
    from qerl.data.tasks import synthetic_arithmetic
    from qerl.train.sft import sft

    records = synthetic_arithmetic(args.size, seed=args.seed, max_operand=args.max_operand)
    stats = sft(args.model, args.output, records, steps=args.steps, lr=args.lr, batch_size=args.batch_size,
                seed=args.seed, progress=not args.no_progress)
    print(json.dumps(stats))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="qerl", description="QeRL: RL on NVFP4-quantized LLMs with LoRA and AQN.")
    p.add_argument("--version", action="version", version=f"qerl {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    t = sub.add_parser("build-tiny", help="build a seeded tiny model + tokenizer (offline)",
                       description="Build a small random Qwen2/Llama model and a byte-level tokenizer, "
                                   "entirely offline, for tests and the embedded default workflow.")
    t.add_argument("--output", required=True, type=Path, help="output model directory")
    t.add_argument("--arch", choices=["qwen2", "llama"], default="qwen2")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--hidden-size", type=int, default=64)
    t.add_argument("--intermediate-size", type=int, default=128)
    t.add_argument("--layers", type=int, default=2)
    t.add_argument("--heads", type=int, default=4)
    t.add_argument("--kv-heads", type=int, default=2)
    t.add_argument("--tie-embeddings", action="store_true")
    t.add_argument("--max-shard-size", default="2GB", help="e.g. 500MB, 2GB (default 2GB)")
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
    q.add_argument("--max-shard-size", default="2GB", help="output shard size (default 2GB)")
    q.add_argument("--ignore", nargs="*", default=["lm_head"],
                   help="modules left unquantized: names, class names or 're:' regexes (default: lm_head)")
    q.add_argument("--no-progress", action="store_true", help="no progress bar")
    q.set_defaults(func=_cmd_quantize)

    e = sub.add_parser("export-merged", help="merge a LoRA adapter into a bf16 model",
                       description="Merge a PEFT adapter into its base (an NVFP4 base is dequantized "
                                   "first) and save a dense bf16 Hugging Face model.")
    e.add_argument("--base", required=True, help="base model directory (bf16 or NVFP4)")
    e.add_argument("--adapter", required=True, type=Path, help="PEFT adapter directory")
    e.add_argument("--output", required=True, type=Path)
    e.add_argument("--force", action="store_true", help="replace an existing output directory")
    e.set_defaults(func=_cmd_export_merged)
    r = sub.add_parser("train", help="RL training (GRPO/DAPO) of one method",
                       description="Train a policy with GRPO / DAPO / Dr. GRPO using one of the methods "
                                   "full, lora, qlora, nvfp4_lora, qerl. Writes metrics.jsonl, checkpoints "
                                   "and the final adapter under the config's output_dir.")
    r.add_argument("--config", required=True, type=Path, help="YAML training config")
    r.add_argument("--resume", action="store_true", help="continue from output_dir/checkpoint")
    r.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="override a config value, e.g. --set steps=10 --set algorithm.name=dapo")
    r.add_argument("--no-progress", action="store_true")
    r.set_defaults(func=_cmd_train)

    f = sub.add_parser("sft", help="supervised warm-start on the synthetic arithmetic task",
                       description="Full-parameter SFT of a (tiny) model on the offline synthetic arithmetic "
                                   "task, so RL starts with non-zero reward.")
    f.add_argument("--model", required=True, help="model directory to start from")
    f.add_argument("--output", required=True, type=Path)
    f.add_argument("--steps", type=int, default=200)
    f.add_argument("--lr", type=float, default=3e-3)
    f.add_argument("--batch-size", type=int, default=32)
    f.add_argument("--size", type=int, default=2000, help="number of synthetic problems")
    f.add_argument("--max-operand", type=int, default=9)
    f.add_argument("--seed", type=int, default=0)
    f.add_argument("--no-progress", action="store_true")
    f.set_defaults(func=_cmd_sft)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from qerl.errors import USER_ERRORS

    try:
        return args.func(args)
    except USER_ERRORS as e:
        print(f"qerl {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
