"""``qerl build-tiny | quantize | export-merged | sft | download``: the verbs that write a model directory."""
from __future__ import annotations

import json
from pathlib import Path

from qerl.argtypes import POSITIVE, float_in, int_at_least, layer_count_or_fraction
from qerl.cli.common import add_tracking


def add_build_tiny(sub) -> None:
    t = sub.add_parser("build-tiny", help="build a seeded tiny model + tokenizer (offline)",
                       description="Build a small random Qwen2/Llama model and a byte-level tokenizer, "
                                   "entirely offline, for tests and the embedded default workflow.")
    t.add_argument("--output", required=True, type=Path, help="output model directory")
    t.add_argument("--arch", choices=["qwen2", "llama"], default="qwen2", help="architecture")
    t.add_argument("--seed", type=int_at_least(0), default=0, help="weight initialisation seed")
    t.add_argument("--hidden-size", type=POSITIVE, default=64, help="model width (a multiple of 16)")
    t.add_argument("--intermediate-size", type=POSITIVE, default=128, help="MLP width (a multiple of 16)")
    t.add_argument("--layers", type=POSITIVE, default=2, help="decoder layers")
    t.add_argument("--heads", type=POSITIVE, default=4, help="attention heads (divide --hidden-size)")
    t.add_argument("--kv-heads", type=POSITIVE, default=2, help="key/value heads (divide --heads)")
    t.add_argument("--tie-embeddings", action="store_true", help="share the input embedding and the LM head")
    t.add_argument("--max-shard-size", default="2GB", help="safetensors shard size, e.g. 500MB, 2GB")
    t.add_argument("--force", action="store_true", help="replace an output directory that holds another model")
    t.set_defaults(func=run_build_tiny)


def run_build_tiny(args) -> int:
    from qerl.models.tiny import TinySpec, save_tiny_model

    spec = TinySpec(arch=args.arch, hidden_size=args.hidden_size, intermediate_size=args.intermediate_size,
                    num_hidden_layers=args.layers, num_attention_heads=args.heads,
                    num_key_value_heads=args.kv_heads, tie_word_embeddings=args.tie_embeddings,
                    seed=args.seed)
    from qerl import outputs, owned

    outputs.check_parent_writable(args.output, "tiny model")
    owned.check_force(args.output, args.force)
    with outputs.hold(args.output, "build-tiny"):
        out = save_tiny_model(args.output, spec, max_shard_size=args.max_shard_size, force=args.force)
    print(f"wrote tiny {args.arch} model to {out}")
    return 0


def add_quantize(sub) -> None:
    q = sub.add_parser("quantize", help="write an NVFP4 (compressed-tensors) checkpoint",
                       description="Quantize every decoder Linear of a Hugging Face causal LM to NVFP4 "
                                   "(round-to-nearest, or after AWQ's activation-aware scales are folded into the "
                                   "model: --calibration awq) and write a compressed-tensors "
                                   "'nvfp4-pack-quantized' checkpoint that vLLM, llm-compressor and "
                                   "transformers read. Streams tensor by tensor; writes atomically.")
    q.add_argument("--model", required=True, help="local model directory or hub id (e.g. Qwen/Qwen2.5-7B-Instruct)")
    q.add_argument("--output", required=True, type=Path, help="output checkpoint directory")
    q.add_argument("--revision", default=None, help="hub revision (commit/tag) to pin")
    q.add_argument("--force", action="store_true", help="replace an output directory holding another model")
    q.add_argument("--max-shard-size", default="2GB", help="output shard size, e.g. 500MB, 2GB")
    q.add_argument("--ignore", nargs="*", default=["lm_head"],
                   help="modules left unquantized: names, class names or 're:' regexes")
    from qerl.quant import scale_rules

    q.add_argument("--scale-rule", choices=list(scale_rules.RULES), default=scale_rules.DEFAULT,
                   help=scale_rules.help_text() + " (each writes ordinary NVFP4)")
    q.add_argument("--keep-bf16-last", type=layer_count_or_fraction, default=0, metavar="N|FRACTION",
                   help="leave the last decoder layers in bf16: a count (e.g. 4) or a fraction of the layers (e.g. "
                        "0.15, rounded up); written into the checkpoint's ignore list")
    q.add_argument("--calibration", choices=["none", "awq"], default="none",
                   help="none: round-to-nearest; awq: per-input-channel scales searched on --calibration-data and "
                        "folded into the norms / linears before quantizing (same checkpoint format, no run-time cost)")
    q.add_argument("--calibration-data", type=Path, default=None, metavar="FILE",
                   help="AWQ calibration text: a JSONL file (its --calibration-field) or a text file (its lines), "
                        "e.g. the training prompts config/real/data/gsm8k_train.jsonl")
    q.add_argument("--calibration-field", default="question", help="the JSONL field holding the prompt text")
    q.add_argument("--calibration-solution-field", default=None, metavar="FIELD",
                   help="the JSONL field holding a worked solution, calibrated on after its prompt (the tokens a "
                        "policy writes; e.g. GSM8K's answer); every row must have it")
    q.add_argument("--calibration-template", choices=["raw", "chat", "paper"], default="raw",
                   help="how each text is formatted before tokenizing (chat / paper: the tokenizer's chat template, "
                        "as training prompts are)")
    q.add_argument("--calibration-samples", type=int_at_least(1), default=128,
                   help="calibration rows (the paper: 256)")
    q.add_argument("--calibration-seq-len", type=int_at_least(1), default=512,
                   help="tokens per calibration row (the paper: 2048)")
    q.add_argument("--device", default="auto", help="where the AWQ search runs: auto (CUDA if present), cpu, cuda")
    q.add_argument("--no-progress", action="store_true", help="no progress bar")
    q.set_defaults(func=run_quantize)
    add_tracking(q)


def run_quantize(args) -> int:
    from qerl import outputs, owned
    from qerl.checkpoint import parse_size
    from qerl.stages.quantize import REPORT, quantize_checkpoint

    parse_size(args.max_shard_size)
    outputs.check_not_input(args.output, {"--model": args.model})
    if args.output.exists() and not args.output.is_dir():
        raise outputs.OutputNotWritable(f"--output {args.output}: is a file, not a directory")
    outputs.check_parent_writable(args.output, "quantized checkpoint")
    owned.check_force(args.output, args.force)
    with outputs.hold(args.output, "quantize"):
        summary = quantize_checkpoint(args.model, args.output, force=args.force,
                                      max_shard_size=args.max_shard_size, ignore=tuple(args.ignore),
                                      revision=args.revision, progress=not args.no_progress,
                                      scale_rule=args.scale_rule, keep_bf16_last=args.keep_bf16_last,
                                      calibration=args.calibration, calibration_data=args.calibration_data,
                                      calibration_field=args.calibration_field,
                                      calibration_solution_field=args.calibration_solution_field,
                                      calibration_template=args.calibration_template,
                                      calibration_samples=args.calibration_samples,
                                      calibration_seq_len=args.calibration_seq_len, device=args.device)
    if summary.pop("up_to_date"):
        print(f"{args.output}: already quantized from this source; nothing to do")
    print(json.dumps(summary, indent=2))
    print(f"per-layer report: {Path(args.output) / REPORT}")
    return {k: v for k, v in summary.items() if isinstance(v, (int, float))}


def add_export_merged(sub) -> None:
    e = sub.add_parser("export-merged", help="merge a LoRA adapter into a bf16 model",
                       description="Merge a PEFT adapter into its base (an NVFP4 base is dequantized "
                                   "first) and save a dense bf16 Hugging Face model.")
    e.add_argument("--base", required=True, help="base model directory (bf16 or NVFP4)")
    e.add_argument("--adapter", required=True, type=Path, help="PEFT adapter directory")
    e.add_argument("--output", required=True, type=Path, help="output bf16 model directory")
    e.add_argument("--force", action="store_true", help="replace an existing output directory")
    e.set_defaults(func=run_export_merged)


def run_export_merged(args) -> int:
    from qerl.lora import export_merged

    from qerl import outputs, owned

    outputs.check_not_input(args.output, {"--base": args.base, "--adapter": args.adapter})
    outputs.check_parent_writable(args.output, "merged model")
    owned.check_force(args.output, args.force)
    with outputs.hold(args.output, "export-merged"):
        out = export_merged(args.base, args.adapter, args.output, force=args.force)
    print(f"wrote merged bf16 model to {out}")
    return 0


def add_sft(sub) -> None:
    f = sub.add_parser("sft", help="supervised warm-start on the synthetic arithmetic task",
                       description="Full-parameter SFT of a (tiny) model on the offline synthetic arithmetic "
                                   "task, so RL starts with non-zero reward.")
    f.add_argument("--model", required=True, help="model directory to start from")
    f.add_argument("--output", required=True, type=Path, help="output model directory")
    f.add_argument("--steps", type=POSITIVE, default=200, help="optimizer steps")
    f.add_argument("--lr", type=float_in(0.0, lo_open=True), default=3e-3, help="AdamW learning rate")
    f.add_argument("--batch-size", type=POSITIVE, default=32, help="problems per step")
    f.add_argument("--size", type=POSITIVE, default=2000, help="number of synthetic problems")
    f.add_argument("--max-operand", type=POSITIVE, default=9, help="largest operand of the synthetic problems")
    f.add_argument("--seed", type=int_at_least(0), default=0, help="data and initialisation seed")
    f.add_argument("--no-progress", action="store_true", help="no progress bar")
    f.add_argument("--force", action="store_true", help="replace an output directory that holds another model")
    f.set_defaults(func=run_sft)
    add_tracking(f)


def run_sft(args) -> int:
    from qerl.data.tasks import synthetic_arithmetic
    from qerl.train.sft import sft

    records = synthetic_arithmetic(args.size, seed=args.seed, max_operand=args.max_operand)
    from qerl import outputs, owned

    outputs.check_not_input(args.output, {"--model": args.model})
    outputs.check_parent_writable(args.output, "warm-started model")
    owned.check_force(args.output, args.force)
    with outputs.hold(args.output, "sft"):
        stats = sft(args.model, args.output, records, steps=args.steps, lr=args.lr, batch_size=args.batch_size,
                    seed=args.seed, progress=not args.no_progress, force=args.force)
    print(json.dumps(stats))
    return stats


def add_download(sub) -> None:
    d = sub.add_parser("download", help="hub snapshot of a model at a pinned revision",
                       description="Download a Hugging Face model snapshot (weights, config, tokenizer) at a pinned "
                                   "revision into a local directory.")
    d.add_argument("--model", required=True, help="hub id, e.g. Qwen/Qwen2.5-7B-Instruct")
    d.add_argument("--revision", required=True, help="commit hash or tag to pin")
    d.add_argument("--output", required=True, type=Path, help="local model directory to write")
    d.set_defaults(func=run_download)


def add_fetch(sub) -> None:
    f = sub.add_parser("fetch", help="download every hub model / dataset a workflow config names, write its lock",
                       description="Fetch once, run offline: download every hub model and dataset the workflow "
                                   "config names (models, training sets, benchmarks) into the Hugging Face cache and "
                                   "write a lock file of the commit each resolved to. Point the config at it "
                                   "(`inputs_lock: FILE`): the workflow then uses those commits and runs its jobs "
                                   "with the hub off (HF_HUB_OFFLINE=1). --check verifies, with the hub off, that "
                                   "this machine's cache holds every locked input.")
    f.add_argument("--configfile", nargs="+", required=True, type=Path,
                   help="the workflow config file(s), deep-merged in order as snakemake does")
    f.add_argument("--lock", type=Path, default=None,
                   help="lock file to write / check (default: beside the first config, <name>.lock.yaml)")
    f.add_argument("--check", action="store_true", help="only check that the cache holds every locked input")
    f.add_argument("--dry-run", action="store_true", help="only list the hub inputs")
    f.set_defaults(func=run_fetch)


def run_fetch(args) -> dict:
    from qerl import inputs
    from qerl.train.config import read_workflow_config_checked

    config = read_workflow_config_checked(args.configfile)  # (strict: duplicates, unknown keys, the schema)
    todo = inputs.hub_inputs(config)
    lock_path = args.lock or inputs.default_lock_path(args.configfile[0])
    if args.dry_run:
        for x in todo:
            print(f"{x.kind} {x.name}: {x.repo}@{x.revision}")
        return {}
    if args.check:
        lock = inputs.read_lock(lock_path)
        inputs.locked_commits(config, lock, f"inputs_lock {lock_path}")  # judged as the workflow judges it
        missing = inputs.check_cached(todo, lock)
        if missing:
            files = " ".join(map(str, args.configfile))
            raise inputs.InputsError(f"{len(missing)} of {len(todo)} locked inputs are missing here: "
                                     + "; ".join(missing) + f". Run `qerl fetch --configfile {files}` on a machine "
                                     "with network and copy its Hugging Face cache (HF_HOME) here")
        print(f"all {len(todo)} hub inputs of {lock_path} are in the local cache")
        return {}
    lock = inputs.fetch(todo)
    print(f"wrote {inputs.write_lock(lock, lock_path)} ({len(todo)} inputs); use it with `inputs_lock: {lock_path}`")
    return {}


def run_download(args) -> dict:
    from qerl.models.source import download

    from qerl.checkpoint import CheckpointError, is_nonempty_dir

    if is_nonempty_dir(args.output) and not (args.output / ".cache" / "huggingface").is_dir():
        raise CheckpointError(f"--output {args.output}: holds files that are not an earlier download; refusing to "
                              "write a snapshot among them")
    path = download(args.model, args.revision, args.output)
    print(f"downloaded {args.model}@{args.revision} to {path}")
    return {}


def add_from_gguf(sub) -> None:
    g = sub.add_parser("from-gguf", help="turn a local GGUF file (llama.cpp) into a model directory",
                       description="Convert a local GGUF file (llama.cpp's format) into the Hugging Face model "
                                   "directory every qerl stage reads, through transformers' GGUF loader, offline. The "
                                   "weights are DEQUANTIZED from the file's types (Q4_K, Q8_0, ...) to --dtype: the "
                                   "directory's qerl_source.json and the MLflow tags of every run on it say so. "
                                   "Written atomically; a rerun on the same file (same sha256) does nothing.")
    g.add_argument("--gguf", required=True, type=Path, help="the .gguf file")
    g.add_argument("--output", required=True, type=Path, help="model directory to write")
    g.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16",
                   help="dtype of the written weights")
    g.add_argument("--force", action="store_true", help="replace an output directory holding another model")
    g.set_defaults(func=run_from_gguf)


def run_from_gguf(args) -> int:
    from qerl import outputs, owned
    from qerl.models.gguf import convert

    outputs.check_not_input(args.output, {"--gguf": args.gguf})
    if args.output.exists() and not args.output.is_dir():
        raise outputs.OutputNotWritable(f"--output {args.output}: is a file, not a directory")
    outputs.check_parent_writable(args.output, "model directory")
    owned.check_force(args.output, args.force)
    with outputs.hold(args.output, "from-gguf"):
        rec = convert(args.gguf, args.output, dtype=args.dtype, force=args.force)
    types = ", ".join(f"{k} x{v}" for k, v in rec["tensor_types"].items())
    if rec["cached"]:
        print(f"{args.output}: already the conversion of {args.gguf} (sha256 {rec['sha256'][:12]}); nothing to do")
    else:
        print(f"wrote {rec['architecture']} model {rec['name']!r} to {args.output} ({args.dtype}; dequantized from "
              f"{types})")
    return 0
