"""``qerl bench rehearsal``: the paper's pipeline on one GPU, stage by stage, on random-weight stand-ins at the real
Qwen2.5 shapes — the stage commands the workflow runs for ``config/paper.yaml`` (``qerl quantize``, ``qerl train``,
``qerl evaluate``) with the paper's settings, timed, so that GPU-only defects show and each stage's rate is known.

Per shape (``--shapes 3B 7B``): a stand-in (:func:`qerl.models.random.build`, bf16, saved as a Hugging Face
checkpoint with the byte-level tokenizer of :mod:`qerl.models.tiny`: prompts are ~1 token per byte, and random
weights never sample EOS, so every completion runs to the cap — the rehearsal's rollouts are the upper bound of a
real run's, whose completions end earlier); GSM8K-format problems written locally (``question`` / ``answer``
ending in ``#### N``, :func:`gsm8k_like`); then

1. ``qerl quantize`` (NVFP4, the paper's calibration-free rule);
2. ``qerl train``: the resolved config of the paper's Table 1 QeRL run (``config/paper.yaml``: GRPO, 16 prompts ×
   G = 8, 4,096 new tokens, μ = 4, micro-batch 16, LoRA 32, AQN) on the local problems, ``--steps`` steps;
3. ``qerl evaluate`` of the trained adapter on held-out problems with the paper's protocol (8 samples,
   temperature 0.6, top-p 0.95, 4,096 tokens), ``--eval-problems`` problems.

``--set KEY=VALUE`` overrides the train config (e.g. a shorter ``rollout.max_new_tokens`` for a smoke test; each
override is stated in the output). Writes ``<device>.csv`` / ``.md`` under ``--output`` (rows: shape, stage,
seconds, and the stage's units: steps, sequences, generated tokens, problems), a row as each stage ends.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

from qerl.files import atomic_open, write_text_atomic

COLUMNS = ["device", "shape", "stage", "status", "seconds", "steps", "sequences", "generated_tokens", "problems",
           "seconds_per_step", "tokens_per_second", "peak_gb", "note"]
PAPER = Path(__file__).resolve().parents[2] / "config" / "paper.yaml"
_NAMES = ["Natalia", "Weng", "Betty", "Julie", "James", "Mark", "Albert", "Ken", "Alexis", "Tina"]
_ITEMS = ["clips", "apples", "books", "marbles", "stickers", "pens", "cookies", "stamps"]


def gsm8k_like(n: int, seed: int) -> list[dict]:
    """``n`` seeded GSM8K-format problems: ``question`` (a two-step word problem) and ``answer`` (the worked
    solution ending in ``#### N``, GSM8K's answer format)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        who, what = rng.choice(_NAMES), rng.choice(_ITEMS)
        a, b, c = rng.randint(2, 60), rng.randint(2, 60), rng.randint(2, 9)
        q = (f"{who} has {a} {what}. A friend gives {who} {b} more, and then {who} buys {c} times as many as "
             f"{who} has now. How many {what} did {who} buy?")
        out.append({"question": q, "answer": f"{who} has {a} + {b} = {a + b} {what}. {who} buys {c} * {a + b} = "
                                               f"{c * (a + b)}.\n#### {c * (a + b)}"})
    return out


def stand_in(shape: str, out: Path, device: str = "cuda") -> Path:
    """A random-weight Qwen2.5 ``shape`` (bf16) with the byte-level tokenizer, saved as a model directory."""
    import torch

    from qerl.models.random import build
    from qerl.models.tiny import build_tokenizer

    tok = build_tokenizer()
    lm = build(shape, "bf16", device=device)
    lm.config.eos_token_id, lm.config.pad_token_id = tok.eos_token_id, tok.pad_token_id
    lm.config.bos_token_id = None
    lm.generation_config.eos_token_id, lm.generation_config.pad_token_id = tok.eos_token_id, tok.pad_token_id
    out.mkdir(parents=True, exist_ok=True)
    lm.save_pretrained(out, max_shard_size="4GB")
    tok.save_pretrained(out)
    del lm
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


def paper_train_config(shape_dir: Path, data: Path, out: Path, steps: int, sets: list[str]) -> dict:
    """The resolved ``qerl train`` config of the paper's Table 1 QeRL run (``config/paper.yaml``, 7B row: the
    shapes share it), pointed at the stand-in's NVFP4 checkpoint and the local problems, ``steps`` steps."""
    import yaml

    from qerl import workflow_config as wc

    config = yaml.safe_load(PAPER.read_text())
    cfg = wc.train_config(config, wc.Run("qwen2.5-7b", "qerl", "grpo", "gsm8k", 0), "")
    cfg = wc._merge(cfg, {"model": {"path": str(shape_dir)}, "output_dir": str(out), "steps": steps,
                          "checkpoint_every": steps, "tracking": {"backend": "none"},
                          "data": {"task": "local", "path": str(data), "prompt_field": "question",
                                   "answer_field": "answer", "answer_format": "gsm8k"}})
    for s in sets:
        key, _, value = s.partition("=")
        node = cfg
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = yaml.safe_load(value)
    cfg["tracking"] = {"backend": "none"}
    return cfg


class StageTimeout(RuntimeError):
    """A stage ran past its time budget (``--stage-timeout``); what it wrote so far is kept."""


def _run(args: list[str], log: Path, env: dict | None = None, timeout: float | None = None) -> float:
    """``python -m qerl ARGS`` (its output to ``log``); seconds; a failure raises with the log's tail, a stage past
    ``timeout`` seconds is stopped (:class:`StageTimeout`)."""
    t0 = time.perf_counter()
    with open(log, "w") as f:
        try:
            r = subprocess.run([sys.executable, "-m", "qerl", *args], stdout=f, stderr=subprocess.STDOUT,
                               env={**os.environ, **(env or {})}, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise StageTimeout(f"qerl {args[0]} stopped after {timeout:.0f} s (--stage-timeout)") from None
    secs = time.perf_counter() - t0
    if r.returncode:
        tail = log.read_text()[-2500:]
        raise RuntimeError(f"qerl {args[0]} failed (exit {r.returncode}); {log}:\n{tail}")
    return secs


def rehearse(shape: str, work: Path, steps: int, eval_problems: int, sets: list[str], device: str,
             emit, stage_timeout: float | None = None) -> None:
    """The stages for one shape; ``emit(row)`` after each. A train stage past ``stage_timeout`` is stopped and its
    finished steps reported (status ``timeout``); evaluation then does not run."""
    import yaml

    work.mkdir(parents=True, exist_ok=True)
    base = {"shape": shape, "status": "ok"}
    t0 = time.perf_counter()
    stand_in(shape, work / "base", device)
    emit({**base, "stage": "stand-in", "seconds": time.perf_counter() - t0,
          "note": "random bf16 weights at the real shape, saved (not a paper stage)"})
    data = work / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in gsm8k_like(512, seed=0)))
    test = work / "test.jsonl"
    test.write_text("".join(json.dumps(r) + "\n" for r in gsm8k_like(max(eval_problems, 1), seed=1)))
    secs = _run(["quantize", "--model", str(work / "base"), "--output", str(work / "nvfp4"), "--no-progress"],
                work / "quantize.log")
    emit({**base, "stage": "quantize", "seconds": secs})
    cfg = paper_train_config(work / "nvfp4", data, work / "train", steps, sets)
    (work / "train.yaml").write_text(yaml.safe_dump(cfg))
    status, t_train = "ok", time.perf_counter()
    try:
        secs = _run(["train", "--config", str(work / "train.yaml"), "--no-progress"], work / "train.log",
                    timeout=stage_timeout)
    except StageTimeout:
        status, secs = "timeout", time.perf_counter() - t_train
    metrics = work / "train" / "metrics.jsonl"
    rows = [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.exists() else []
    seqs = cfg["prompts_per_step"] * cfg["algorithm"]["group_size"]
    if not rows:
        emit({**base, "stage": "train", "status": status, "seconds": secs, "steps": 0,
              "note": f"no step finished in {secs:.0f} s ({cfg['prompts_per_step']} prompts x G "
                      f"{cfg['algorithm']['group_size']}, {cfg['rollout']['max_new_tokens']} new tokens, mu "
                      f"{cfg['algorithm']['updates_per_batch']}); the log's last lines: "
                      + " / ".join((work / "train.log").read_text().strip().splitlines()[-2:])[-300:]})
        return
    last = rows[-1]
    step_s = last["rollout_seconds"] + last["train_seconds"]
    emit({**base, "stage": "train", "status": status, "seconds": secs, "steps": len(rows),
          "sequences": seqs * len(rows),
          "generated_tokens": sum(r["generated_tokens"] for r in rows), "seconds_per_step": step_s,
          "tokens_per_second": last["tokens_per_second"], "peak_gb": max(r.get("peak_memory_gb", 0) for r in rows),
          "note": (f"last step: rollout {last['rollout_seconds']:.1f} s, update {last['train_seconds']:.1f} s; "
                   f"{cfg['prompts_per_step']} prompts x G {cfg['algorithm']['group_size']}, "
                   f"{cfg['rollout']['max_new_tokens']} new tokens, mu {cfg['algorithm']['updates_per_batch']}, "
                   f"micro-batch {cfg['micro_batch_size']}; first step "
                   f"{rows[0]['rollout_seconds'] + rows[0]['train_seconds']:.1f} s"
                   + (f"; overrides {' '.join(sets)}" if sets else ""))})
    if status != "ok":
        return
    ev = yaml.safe_load(PAPER.read_text())["evaluation"]
    max_new = int(cfg["rollout"]["max_new_tokens"])
    secs = _run(["evaluate", "--model", str(work / "nvfp4"), "--base", "nvfp4", "--adapter",
                 str(work / "train" / "final"), "--benchmark", str(test), "--prompt-field", "question",
                 "--answer-field", "answer", "--answer-format", "gsm8k", "--name", "gsm8k_like",
                 "--samples", str(ev["samples"]), "--temperature", str(ev["temperature"]), "--top-p", str(ev["top_p"]),
                 "--max-new-tokens", str(min(ev["max_new_tokens"], max_new)), "--batch-size", str(ev["batch_size"]),
                 "--template", ev["template"], "--limit", str(eval_problems), "--output", str(work / "eval.json"),
                 "--no-progress"], work / "evaluate.log")
    summary = json.loads((work / "eval.json").read_text())
    toks = sum(len(json.loads(x)["completion"]) for x in (work / "eval.samples.jsonl").read_text().splitlines())
    emit({**base, "stage": "evaluate", "seconds": secs, "problems": summary["problems"],
          "sequences": summary["problems"] * summary["samples_per_problem"],
          "note": f"{ev['samples']} samples, T {ev['temperature']}, top-p {ev['top_p']}, "
                  f"{min(ev['max_new_tokens'], max_new)} new tokens; {toks} completion characters (byte tokens); "
                  f"generation {summary['seconds']:.1f} s of it"})


def write(rows: list[dict], out: Path, device: str) -> Path:
    """CSV + Markdown, atomically."""
    out.mkdir(parents=True, exist_ok=True)
    stem = out / ("rehearsal_" + device.replace(" ", "_"))
    with atomic_open(stem.with_suffix(".csv"), newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows({k: (round(r[k], 3) if isinstance(r.get(k), float) else r.get(k, "")) for k in COLUMNS}
                    for r in rows)
    lines = [f"# Rehearsal of the paper's pipeline on {device}", "",
             "Random-weight stand-ins at the real shapes (completions run to the cap: an upper bound).", "",
             "| shape | stage | status | s | steps | sequences | generated tokens | problems | s/step | tok/s | "
             "peak GB | note |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        f = (lambda k: "" if r.get(k) in (None, "") else (f"{r[k]:.2f}" if isinstance(r[k], float) else str(r[k])))
        lines.append(" | ".join(["", r["shape"], r["stage"], r["status"], f("seconds"), f("steps"), f("sequences"),
                                 f("generated_tokens"), f("problems"), f("seconds_per_step"), f("tokens_per_second"),
                                 f("peak_gb"), str(r.get("note", "")), ""]).strip())
    write_text_atomic(stem.with_suffix(".md"), "\n".join(lines) + "\n")
    return stem.with_suffix(".csv")


def build_parser() -> argparse.ArgumentParser:
    from qerl.argtypes import HelpFormatter

    p = argparse.ArgumentParser(prog="qerl bench rehearsal", description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--output", default="reports/reproduce", help="directory of the rehearsal_<device>.csv / .md")
    p.add_argument("--shapes", nargs="+", default=["3B"], help="Qwen2.5 shapes (qerl.models.shapes: 3B 7B 14B 32B)")
    p.add_argument("--steps", type=int, default=2, help="GRPO steps of the train stage")
    p.add_argument("--eval-problems", type=int, default=4, help="problems of the evaluate stage (x 8 samples)")
    p.add_argument("--workdir", type=Path, default=None, help="where the stand-ins and runs go (default: a temp dir)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override the train config")
    p.add_argument("--device", default="cuda", help="where the stand-in is built (cuda; cpu for a smoke test)")
    p.add_argument("--stage-timeout", type=float, default=None,
                   help="stop the train stage after this many seconds and report the steps it finished")
    return p


def main(argv: list[str] | None = None) -> int:
    import tempfile

    import torch

    from qerl.models.shapes import QWEN25

    a = build_parser().parse_args(argv)
    bad = [s for s in a.shapes if s not in QWEN25]
    if bad or a.steps < 1 or a.eval_problems < 1:
        raise SystemExit(f"qerl bench rehearsal: shapes {bad} unknown (known {list(QWEN25)}), or --steps / "
                         "--eval-problems below 1")
    device = torch.cuda.get_device_name() if a.device.startswith("cuda") else "CPU"
    work = a.workdir or Path(tempfile.mkdtemp(prefix="qerl-rehearsal-"))
    rows: list[dict] = []

    def emit(row):
        rows.append({"device": device, **row})
        print(json.dumps(rows[-1]), flush=True)
        write(rows, Path(a.output), device)

    for shape in a.shapes:
        try:
            rehearse(shape, work / shape, a.steps, a.eval_problems, a.set, a.device, emit, a.stage_timeout)
        except (RuntimeError, torch.cuda.OutOfMemoryError) as e:
            emit({"shape": shape, "stage": "failed", "status": "error", "note": str(e)[-600:].replace("\n", " ")})
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
