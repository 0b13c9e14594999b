"""``python -m qerl.bench.base_kl``: how far each quantized base is from its bf16 reference on held-out text.

For each base (an NVFP4 checkpoint, e.g. round-to-nearest, four-over-six, AWQ) and for the reference itself: the
perplexity of held-out text (problems with their worked solutions, as the template formats them), and the mean
per-token KL(reference || base) of the next-token distributions -- the error a quantized base brings before any
training. Writes a CSV (one row per model, the device in it) and prints it.

    python -m qerl.bench.base_kl --reference results/models/qwen2.5-coder-0.5b \\
        --bases rtn=results/quantize/q05b-rtn awq=results/quantize/q05b-awq \\
        --data config/real/data/gsm8k_val.jsonl --template paper --output reports/real/bases_kl.csv
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import sys
from pathlib import Path

import torch

from qerl.files import atomic_open


def texts(path: Path, field: str, answer_field: str | None, tokenizer, template: str, limit: int) -> list[str]:
    """The first ``limit`` rows of a JSONL file: ``field`` through the prompt template, then ``answer_field``."""
    from qerl.data.tasks import format_prompt

    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()][:limit]
    if not rows:
        raise ValueError(f"--data {path}: no rows")
    return [format_prompt(r[field], tokenizer, template) + (r[answer_field] if answer_field else "") for r in rows]


@torch.no_grad()
def measure(reference, bases: dict[str, object], ids: torch.Tensor, mask: torch.Tensor, batch: int = 16) -> dict:
    """``{name: {"tokens", "ppl", "kl"}}`` over the real tokens of ``ids [N, L]`` (``mask``: 1 = real): perplexity of
    each model on the next token, and the mean KL(reference || model) of its next-token distributions."""
    out = {name: {"nll": 0.0, "kl": 0.0} for name in ["reference", *bases]}
    n = 0
    for i in range(0, ids.shape[0], batch):
        x, m = ids[i:i + batch], mask[i:i + batch]
        keep = m[:, 1:].bool()
        ref = torch.log_softmax(reference(input_ids=x, attention_mask=m).logits[:, :-1].float(), -1)
        target = x[:, 1:, None]
        out["reference"]["nll"] -= float(ref.gather(-1, target)[..., 0][keep].sum())
        for name, model in bases.items():
            lq = torch.log_softmax(model(input_ids=x, attention_mask=m).logits[:, :-1].float(), -1)
            out[name]["nll"] -= float(lq.gather(-1, target)[..., 0][keep].sum())
            out[name]["kl"] += float((ref.exp() * (ref - lq)).sum(-1)[keep].sum())
        n += int(keep.sum())
    return {k: {"tokens": n, "ppl": math.exp(v["nll"] / n), "kl": v["kl"] / n} for k, v in out.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m qerl.bench.base_kl", description=__doc__.split("\n\n")[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reference", required=True, type=Path, help="the bf16 model directory")
    p.add_argument("--bases", nargs="+", required=True, metavar="NAME=DIR", help="NVFP4 checkpoints to compare")
    p.add_argument("--data", required=True, type=Path, help="held-out JSONL (e.g. config/real/data/gsm8k_val.jsonl)")
    p.add_argument("--field", default="question", help="the JSONL field holding the prompt (default: question)")
    p.add_argument("--answer-field", default="answer", help="appended after the prompt ('' for none; default: answer)")
    p.add_argument("--template", choices=["raw", "chat", "paper"], default="paper",
                   help="prompt template, as training formats prompts (default: paper)")
    p.add_argument("--limit", type=int, default=200, help="rows of --data (default: 200)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="where the models run (default: cuda when present)")
    p.add_argument("--output", type=Path, required=True, help="CSV to write")
    args = p.parse_args(argv)
    from transformers import AutoTokenizer

    from qerl.models import load_policy

    specs = {}
    for spec in args.bases:
        name, sep, path = spec.partition("=")
        if not sep or not name or not Path(path).is_dir():
            p.error(f"--bases {spec!r}: expected NAME=DIR with an existing checkpoint directory")
        specs[name] = Path(path)
    tok = AutoTokenizer.from_pretrained(args.reference)
    tok.padding_side = "right"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    enc = tok(texts(args.data, args.field, args.answer_field or None, tok, args.template, args.limit),
              return_tensors="pt", padding=True, add_special_tokens=False)
    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    ref = load_policy(args.reference, base="bf16", device=dev, dtype=dtype).eval()
    bases = {k: load_policy(v, base="nvfp4", device=dev, dtype=dtype).eval() for k, v in specs.items()}
    res = measure(ref, bases, enc.input_ids.to(dev), enc.attention_mask.to(dev))
    device = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    rows = [["model", "path", "tokens", "ppl", "kl_vs_reference", "device"]]
    rows += [[k, str(args.reference if k == "reference" else specs[k]), str(v["tokens"]), f"{v['ppl']:.4f}",
              f"{v['kl']:.5f}", device] for k, v in res.items()]
    with atomic_open(args.output, newline="") as f:
        csv.writer(f, lineterminator="\n").writerows(rows)
    for r in rows:
        print(",".join(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
