"""``qerl bench hf``: one GRPO step three ways on the same batch — what a TRL user gets with and without qerl.

* ``trl-bf16``: TRL's ``GRPOTrainer`` on a bf16 base with PEFT LoRA (rank 32, the seven projections) and TRL's
  default generation (``model.generate``, no vLLM);
* ``trl-qerl``: the same trainer on the NVFP4 base that ``QerlNVFP4Config`` loads (the same
  :class:`~qerl.models.nvfp4_linear.NVFP4Linear` modules, built here from random weights instead of read from a
  file), the same LoRA through PEFT's own ``get_peft_model``, rolling out with ``rollout_func=qerl.hf.rollout_func()``;
* ``qerl``: ``qerl train``'s own step on the same shapes (:func:`qerl.bench.step.run_config`, QeRL; CUDA only).

Random-weight Qwen2.5 shapes (:mod:`qerl.models.random`; speed and memory do not depend on the values), ``batch``
sequences of ``prompt_len`` random tokens each sampling ``gen_len`` tokens (TRL's generation is held to exactly
``gen_len`` by ``min_new_tokens``; the end-of-sequence id of the word tokenizer is a random model's one-in-150,000
draw), ``num_generations`` samples a prompt. Each trainer runs ``--warmup`` steps, then the measured one:
``step_s`` is its wall time (CUDA-synchronised at both ends), ``peak_gb`` the largest allocation during it.
Writes ``<device>.csv / .md`` under ``--output``.
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

from qerl.bench.step import _sync_time  # (CUDA-synchronised wall clock)
from qerl.files import write_text_atomic

VARIANTS = ("trl-bf16", "trl-qerl", "qerl")


def word_tokenizer(vocab: int):
    """A fast tokenizer whose token ``i`` is the word ``t<i>`` (every id of a random model decodes); pad ``t0``, EOS
    the last id."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t1"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="t0", eos_token=f"t{vocab - 1}", unk_token="t1")


def _step_timer():
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        """Wall time and peak memory of every optimizer step."""

        def __init__(self):
            self.steps: list[tuple[float, float]] = []

        def on_step_begin(self, args, state, control, **kwargs):
            if torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()
            self._t0 = _sync_time()

        def on_step_end(self, args, state, control, **kwargs):
            dt = _sync_time() - self._t0
            peak = round(torch.cuda.max_memory_allocated() / 1e9, 2) if torch.cuda.is_available() else ""
            self.steps.append((dt, peak))

    return StepTimer()


def trl_step(model_name: str, variant: str, batch: int, prompt_len: int, gen_len: int, generations: int,
             warmup: int, out_dir: Path, device: str, weight_layout: str = "rows") -> dict:
    """Build the ``variant``'s policy, train ``warmup + 1`` GRPO steps with TRL, return the last step's row.
    ``weight_layout``: ``QerlNVFP4Config``'s, applied to ``trl-qerl``'s NVFP4 layers as ``from_pretrained`` applies it
    (:func:`qerl.hf.quantizer.lay_out`)."""
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from datasets import Dataset
    from peft import LoraConfig, get_peft_model
    from trl import GRPOConfig, GRPOTrainer

    import qerl.hf
    from qerl.hf.quantizer import lay_out
    from qerl.models.nvfp4_linear import NVFP4Linear
    from qerl.models.random import build, prompts

    cuda = device == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    lm = build(model_name, "bf16" if variant == "trl-bf16" else "nvfp4", device=device, dtype=dtype)
    tiled = ""
    if variant == "trl-qerl":  # what from_pretrained(..., quantization_config=QerlNVFP4Config()) hands over
        quantizer = qerl.hf.QerlNVFP4HfQuantizer(qerl.hf.QerlNVFP4Config(weight_layout=weight_layout),
                                                 pre_quantized=True)
        lm.hf_quantizer, lm.is_quantized, lm.quantization_method = quantizer, True, qerl.hf.quantizer.QUANT_METHOD
        lm.config.quantization_config = quantizer.quantization_config
        layers = [m for m in lm.modules() if isinstance(m, NVFP4Linear)]
        tiled = f"{lay_out(layers, weight_layout)} of {len(layers)}"
    policy = get_peft_model(lm, LoraConfig(r=32, lora_alpha=32, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    vocab = lm.config.vocab_size
    tok = word_tokenizer(vocab)
    steps = warmup + 1
    texts = [" ".join(f"t{i}" for i in p.split()) for p in prompts(steps * batch // generations, prompt_len,
                                                                       vocab, seed=1)]
    g = torch.Generator().manual_seed(0)

    def reward(completions, **kwargs):  # random rewards: every group has an advantage to learn from
        return torch.rand(len(completions), generator=g).tolist()

    args = GRPOConfig(output_dir=str(out_dir), per_device_train_batch_size=batch, num_generations=generations,
                      max_completion_length=gen_len, max_steps=steps, learning_rate=1e-5, beta=0.0,
                      report_to=[], logging_steps=1, save_strategy="no", temperature=1.0, use_cpu=not cuda,
                      bf16=cuda, seed=0, dataloader_num_workers=0,
                      generation_kwargs={"min_new_tokens": gen_len})
    timer = _step_timer()
    extra = {"rollout_func": qerl.hf.rollout_func(max_new_tokens=gen_len)} if variant == "trl-qerl" else {}
    trainer = GRPOTrainer(model=policy, reward_funcs=reward, args=args, processing_class=tok,
                          train_dataset=Dataset.from_dict({"prompt": texts}), callbacks=[timer], **extra)
    trainer.train()
    step_s, peak = timer.steps[-1]
    lengths = trainer.state.log_history[-2].get("completions/mean_length") if len(trainer.state.log_history) > 1 \
        else None
    return {"model": model_name, "variant": variant, "batch": batch, "prompt_len": prompt_len, "gen_len": gen_len,
            "status": "ok", "step_s": round(step_s, 3), "peak_gb": peak,
            "tokens_per_s": round(batch * gen_len / step_s, 1),
            "mean_completion": lengths, "warmup_steps": warmup,
            "weight_layout": weight_layout if variant == "trl-qerl" else "", "tiled_layers": tiled, "note": ""}


def qerl_step(model_name: str, batch: int, prompt_len: int, gen_len: int, device_name: str) -> dict:
    """``qerl train``'s own QeRL step on the same shapes (:mod:`qerl.bench.step`)."""
    from qerl.bench.step import run_config

    r = run_config(model_name, "qerl", [batch], [gen_len], prompt_len, micro=batch, checkpointing="auto",
                   device=device_name, progress=lambda *a, **k: None)[0]
    ok = r.get("status") == "ok"
    return {"model": model_name, "variant": "qerl", "batch": batch, "prompt_len": prompt_len, "gen_len": gen_len,
            "status": r.get("status"), "step_s": r.get("total_s") if ok else "",
            "peak_gb": r.get("peak_gb", ""), "tokens_per_s": round(batch * gen_len / r["total_s"], 1) if ok else "",
            "mean_completion": gen_len, "warmup_steps": 1, "note": r.get("note", "")}


def write(rows: list[dict], out: Path, device: str) -> Path:
    from qerl.bench.report import device_csv

    stem = device_csv(rows, out, device)
    by = {(r["model"], r["variant"]): r for r in rows if r["status"] == "ok"}
    lines = [f"# One GRPO step: TRL without and with qerl — {device}", "",
             "`qerl bench hf`: TRL `GRPOTrainer` on a bf16 base with its default generation (`trl-bf16`), the same "
             "trainer on the NVFP4 base `QerlNVFP4Config` loads with `rollout_func=qerl.hf.rollout_func()` "
             "(`trl-qerl`), and `qerl train`'s own step (`qerl`). Random-weight Qwen2.5 shapes, LoRA rank 32 on the "
             "seven projections; the last of the warm-up + measured steps.", "",
             "| model | variant | batch | prompt | gen | step s | tok/s | peak GB | vs trl-bf16 | vs qerl | status |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        base, own = by.get((r["model"], "trl-bf16")), by.get((r["model"], "qerl"))
        ok = r["status"] == "ok"
        vs_b = f"{base['step_s'] / r['step_s']:.2f}x" if ok and base else ""
        vs_q = f"{r['step_s'] / own['step_s']:.2f}" if ok and own else ""
        lines.append(f"| {r['model']} | {r['variant']} | {r['batch']} | {r['prompt_len']} | {r['gen_len']} | "
                     f"{r['step_s']} | {r['tokens_per_s']} | {r['peak_gb']} | {vs_b} | {vs_q} | {r['status']} |")
    lines += [f"\n`trl-qerl`'s NVFP4 layers: `weight_layout=\"{r['weight_layout']}\"`, {r['tiled_layers']} re-laid tiled "
              "(`qerl.hf.quantizer.tiles_on_load`)." for r in rows if r.get("weight_layout")]
    lines += ["", "`vs trl-bf16`: how many times faster than TRL's default (goal for `trl-qerl`: >= 5x); `vs qerl`: "
              "step time over `qerl train`'s (goal for `trl-qerl`: <= 1.15). Peak memory: the TRL rows checkpoint "
              "activations (GRPOConfig's default `gradient_checkpointing=True`); `qerl train`'s "
              "`gradient_checkpointing: auto` keeps them when the card has room."]
    write_text_atomic(stem.with_suffix(".md"), "\n".join(lines) + "\n")
    return stem


def build_parser() -> argparse.ArgumentParser:
    from qerl.argtypes import HelpFormatter
    from qerl.models.shapes import MODELS_HELP, model_arg

    p = argparse.ArgumentParser(prog="qerl bench hf", description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--output", default="reports/hf", help="directory of the <device>.csv / .md")
    p.add_argument("--models", nargs="+", default=["7B"], type=model_arg, metavar="MODEL", help=MODELS_HELP)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS, metavar="STEP",
                   help="steps to time, of trl-bf16 trl-qerl qerl (the last on a CUDA GPU only)")
    p.add_argument("--batch", type=int, default=8, help="sequences a step")
    p.add_argument("--generations", type=int, default=8, help="samples a prompt (TRL's num_generations)")
    p.add_argument("--prompt-len", type=int, default=256, help="prompt tokens")
    p.add_argument("--gen-len", type=int, default=1024, help="sampled tokens a sequence")
    p.add_argument("--warmup", type=int, default=1, help="TRL steps before the measured one")
    p.add_argument("--weight-layout", default="rows", choices=("rows", "tiled", "auto"),
                   help="QerlNVFP4Config(weight_layout=...) of the trl-qerl step's NVFP4 layers")
    return p


def main(argv: list[str] | None = None) -> int:
    import tempfile

    from qerl.gpu_claim import keep_one

    a = build_parser().parse_args(argv)
    if a.batch % a.generations:
        raise SystemExit(f"qerl bench hf: --batch {a.batch} is not a multiple of --generations {a.generations}")
    keep_one()  # before CUDA starts: the steps are timed on one GPU
    cuda = torch.cuda.is_available()
    if "qerl" in a.variants and not cuda:
        raise SystemExit("qerl bench hf: the `qerl` variant (qerl train's step) needs a CUDA GPU; pass --variants "
                         "trl-bf16 trl-qerl on this machine")
    device = torch.cuda.get_device_name() if cuda else "cpu"
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for model in a.models:
            for variant in a.variants:
                try:
                    if variant == "qerl":
                        row = qerl_step(model, a.batch, a.prompt_len, a.gen_len, device)
                    else:
                        row = trl_step(model, variant, a.batch, a.prompt_len, a.gen_len, a.generations, a.warmup,
                                       Path(tmp) / variant, "cuda" if cuda else "cpu", a.weight_layout)
                except torch.cuda.OutOfMemoryError as e:
                    row = {"model": model, "variant": variant, "batch": a.batch, "prompt_len": a.prompt_len,
                           "gen_len": a.gen_len, "status": "oom", "step_s": "", "peak_gb": "", "tokens_per_s": "",
                           "mean_completion": "", "warmup_steps": a.warmup, "note": str(e).splitlines()[0]}
                rows.append(row)
                print(f"{model} {variant}: {row['status']} {row['step_s']} s", flush=True)
                stem = write(rows, Path(a.output), device)  # after every step: a cut-short run keeps what it timed
                if cuda:
                    torch.cuda.empty_cache()
    print(stem.with_suffix(".md"))
    return 0
