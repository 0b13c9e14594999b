"""``qerl evaluate``: mean pass@1 over k samples on a benchmark, for a base or a trained policy.

A policy is evaluated exactly as trained: an adapter on its quantized (NVFP4 / NF4) or bf16 base,
a full fine-tuned model on its own, an untrained base in its format. Outputs: a summary JSON
(``pass@1`` = mean over problems of the fraction of k samples that are correct) and a per-sample
JSONL (prompt, completion, extracted answer, gold, correct). Paper protocol: temperature 0.6,
top-p 0.95, 4096 new tokens.
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from qerl.data.tasks import BENCHMARKS, REGISTERED_BENCHMARKS, VERIFIERS  # (the table lives with the tasks)

LOCAL_SUFFIXES = (".jsonl", ".parquet")


@dataclass(frozen=True)
class Benchmark:
    """A benchmark: a registered name (:data:`BENCHMARKS`: the synthetic task or a hub dataset) or a local
    ``.jsonl`` / ``.parquet`` file whose ``prompt_field`` holds the problem and ``answer_field`` the gold answer in
    ``answer_format`` (:data:`qerl.data.tasks.ANSWER_FORMATS`: plain, gsm8k ``####``, boxed, aime integer) — read
    by the same loader as training data (:func:`qerl.data.tasks.load_local`) and judged by its declared
    ``verifier`` (:data:`qerl.data.tasks.VERIFIERS`; a registered benchmark declares its own in
    :data:`qerl.data.tasks.REGISTERED_BENCHMARKS`). ``name`` labels the results."""

    name: str
    path: str | None = None
    prompt_field: str = "prompt"
    answer_field: str = "answer"
    answer_format: str = "plain"
    revision: str | None = None  # a hub benchmark's commit (the workflow's inputs lock), else its registered one
    verifier: str = "math"
    registered: str | None = None  # its row of REGISTERED_BENCHMARKS (None: a local file)

    @property
    def source(self) -> str:
        return "local" if self.path else REGISTERED_BENCHMARKS[self.registered or self.name].source


def resolve_benchmark(benchmark, name: str | None = None, prompt_field: str | None = None,
                      answer_field: str | None = None, answer_format: str | None = None,
                      revision: str | None = None, verifier: str | None = None) -> Benchmark:
    """``benchmark``: a :class:`Benchmark`, a registered name, or the path of a local file (then the field / format
    options apply; ``name`` defaults to the file's stem). Anything else is a ValueError naming the choices."""
    if isinstance(benchmark, Benchmark):
        return benchmark
    text = str(benchmark)
    fields = {k: v for k, v in (("prompt_field", prompt_field), ("answer_field", answer_field),
                                ("answer_format", answer_format)) if v is not None}
    if text in BENCHMARKS:
        reg = REGISTERED_BENCHMARKS[text]
        if fields or verifier is not None:
            raise ValueError(f"--benchmark {text}: a registered benchmark (verifier {reg.verifier}); --prompt-field / "
                             "--answer-field / --answer-format / --verifier apply to local files only")
        if revision and reg.source != "hub":
            raise ValueError(f"--revision: {text} is built offline, it has no revision")
        return Benchmark(name or text, revision=revision, verifier=reg.verifier, registered=text)
    if Path(text).suffix in LOCAL_SUFFIXES:
        from qerl.data.tasks import ANSWER_FORMATS

        if not Path(text).is_file():
            raise ValueError(f"--benchmark {text}: file not found")
        if revision:
            raise ValueError(f"--revision: {text} is a local file (its sha256 pins it), not a hub dataset")
        fmt = fields.get("answer_format", "plain")
        if fmt not in ANSWER_FORMATS:
            raise ValueError(f"--answer-format {fmt!r}: not one of {', '.join(ANSWER_FORMATS)}")
        if verifier is not None and verifier not in VERIFIERS:
            raise ValueError(f"--verifier {verifier!r}: not one of {', '.join(VERIFIERS)}")
        return Benchmark(name or Path(text).stem, text, **fields, verifier=verifier or "math")
    raise ValueError(f"--benchmark {text!r} is neither a known benchmark ({', '.join(BENCHMARKS)}) nor a local "
                     f"{' / '.join(LOCAL_SUFFIXES)} file")


@dataclass(frozen=True)
class EvalSettings:
    samples: int = 4  # k
    temperature: float = 0.6
    top_p: float = 0.95
    max_new_tokens: int = 4096
    batch_size: int = 32
    template: str = "paper"  # prompt template for hub benchmarks
    limit: int | None = None  # evaluate only the first N problems
    seed: int = 0
    synthetic_size: int = 200
    synthetic_max_operand: int = 9
    nf4_weights: str = "eager"  # an NF4 (QLoRA) base in the engine: eager | dense (SamplingSettings.nf4_weights)


def benchmark_source(benchmark) -> str:
    """Where a benchmark's problems come from (``synthetic``, ``hub`` or ``local``); an unknown one is a
    ValueError."""
    return resolve_benchmark(benchmark).source


def benchmark_records(benchmark, s: EvalSettings) -> tuple[list[dict], str, str]:
    """``(records, reward name, template)`` of a benchmark (:func:`resolve_benchmark`)."""
    from qerl.data.tasks import DataError, load_hub, load_local, synthetic_arithmetic

    b = resolve_benchmark(benchmark)
    reg = REGISTERED_BENCHMARKS.get(b.registered or b.name) if b.source != "local" else None
    template = (reg.template if reg is not None else None) or s.template
    if b.source == "synthetic":  # a seed disjoint from training's stream
        recs = synthetic_arithmetic(s.synthetic_size, seed=10_000 + s.seed, max_operand=s.synthetic_max_operand)
    elif b.source == "local":
        recs = load_local(b.path, b.prompt_field, b.answer_field, b.answer_format)
        if not recs:
            raise DataError(f"--benchmark {b.path}: holds no problems (an empty file)")
    else:
        recs = load_hub(reg.hub, b.revision)
    return (recs[: s.limit] if s.limit is not None else recs), b.verifier, template


def benchmark_meta(benchmark) -> dict:
    """What the summary records of a benchmark: its name and, for a local file, its path, fields and sha256 (so
    a result names the exact problems it was computed on)."""
    from qerl.checkpoint import sha256_file

    b = resolve_benchmark(benchmark)
    if b.source != "local":
        return {"benchmark": b.name, **({"benchmark_revision": b.revision} if b.revision else {})}
    return {"benchmark": b.name, "benchmark_file": str(b.path), "benchmark_sha256": sha256_file(b.path),
            "benchmark_fields": {"prompt": b.prompt_field, "answer": b.answer_field, "format": b.answer_format},
            **({"benchmark_verifier": b.verifier} if b.verifier != "math" else {})}


IDENTITY = ("model", "base", "adapter", "benchmark")


def check_outputs_are_ours(summary: Path, samples: Path, identity: dict | None = None,
                           overwrite: bool = False) -> None:
    """An existing ``summary`` / ``samples`` file is replaced only if an earlier evaluation wrote it (a summary JSON
    with ``pass@1``; a JSONL of samples), never another file given by mistake (a model's ``config.json``), and — unless
    ``overwrite`` — only by an evaluation of the same policy on the same benchmark (``identity``: model, base,
    adapter, benchmark). ``summary`` and ``samples`` must be two files."""
    from qerl.checkpoint import CheckpointError

    if Path(summary).resolve() == Path(samples).resolve():
        raise CheckpointError(f"--output and --samples-output are the same file ({summary}): the summary would "
                              "overwrite the samples; give two paths")
    if summary.is_file():
        try:
            old = json.loads(summary.read_text())
            ok = isinstance(old, dict) and "pass@1" in old
        except (ValueError, TypeError, UnicodeDecodeError):
            ok, old = False, {}
        if not ok:
            raise CheckpointError(f"--output {summary}: exists and is not an evaluation summary; refusing to "
                                  "overwrite it")
        if identity and not overwrite:
            diff = [k for k in IDENTITY if k in old and k in identity and str(old[k]) != str(identity[k])]
            if diff:
                shown = ", ".join(f"{k} {old[k]!r}" for k in diff)
                raise CheckpointError(f"--output {summary}: holds the evaluation of another policy or benchmark "
                                      f"({shown}); pass --overwrite to replace it and its samples, or choose another "
                                      "--output")
    if samples.is_file() and samples.stat().st_size:
        with open(samples, "rb") as f:
            head = f.readline(1 << 20)
        try:
            ok = "completion" in json.loads(head)
        except (ValueError, TypeError, UnicodeDecodeError):
            ok = False
        if not ok:
            raise CheckpointError(f"--samples-output {samples}: exists and is not an evaluation's samples; refusing "
                                  "to overwrite it")


def precheck(model_dir: str | Path, benchmark: str, settings: EvalSettings, adapter: str | Path | None = None
             ) -> None:
    """Before any weights load: the model directory, the adapter directory, the tokenizer, the benchmark's problems,
    and every prompt + ``max_new_tokens`` against the model's context (:mod:`qerl.data.context`)."""
    from qerl.checkpoint import CheckpointError
    from qerl.data.context import check_records, model_context
    from qerl.models.source import resolve_model_dir
    from qerl.train.methods import load_tokenizer

    src = resolve_model_dir(model_dir)
    if adapter is not None and not (Path(adapter) / "adapter_config.json").is_file():
        raise CheckpointError(f"--adapter {adapter}: not a PEFT adapter directory (no adapter_config.json; a trained "
                              "run's adapter is its final/ directory)")
    bench = resolve_benchmark(benchmark)
    records, _, template = benchmark_records(bench, settings)
    check_records(records, load_tokenizer(src), template, settings.max_new_tokens, model_context(src),
                  f"--benchmark {bench.path or bench.name}")


def adapter_sha256(adapter: str | Path | None) -> str:
    """sha256 of an adapter's weights file (``adapter_model.safetensors``), '' without an adapter: every evaluation
    summary carries it, so a trained run's accuracy is tied to the exact adapter that produced it."""
    from qerl.checkpoint import sha256_file

    path = Path(adapter) / "adapter_model.safetensors" if adapter else None
    return sha256_file(path) if path is not None and path.is_file() else ""


def load_for_eval(base_path: str | Path, base: str, adapter: str | Path | None, dtype, device):
    """The policy as trained: ``base`` format of ``base_path`` plus an optional PEFT adapter."""
    from transformers import AutoTokenizer

    from qerl.lora import load_adapter
    from qerl.models import load_policy

    from qerl.models.check import check_tokenizer

    check_tokenizer(Path(base_path))  # before the weights load: a directory without one is named at once
    model = load_policy(base_path, base=base, device=device, dtype=dtype)
    if adapter:
        model = load_adapter(model, adapter)
    tok = AutoTokenizer.from_pretrained(base_path)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    model.eval()
    return model, tok


def evaluate(model, tokenizer, benchmark: str, settings: EvalSettings, out_json: Path, out_samples: Path,
             progress: bool = True, meta: dict | None = None) -> dict:
    """Sample k completions per problem, grade them, write the JSON summary and JSONL samples."""
    from tqdm.auto import tqdm

    from qerl.checkpoint import write_json
    from qerl.data.tasks import format_prompt
    from qerl.rewards.extract import extract_answer
    from qerl.rewards.registry import RewardSettings, build_reward
    from qerl.rollout import SamplingSettings, generate

    bench = resolve_benchmark(benchmark)
    benchmark = bench.name
    records, kind, template = benchmark_records(bench, settings)
    reward = build_reward(RewardSettings(correctness=kind))
    sampling = SamplingSettings(temperature=settings.temperature, top_p=settings.top_p,
                                max_new_tokens=settings.max_new_tokens, nf4_weights=settings.nf4_weights)
    k = settings.samples
    per_problem, lines, lengths, truncated = [], [], [], 0
    t0 = time.time()
    n_batch = max(1, settings.batch_size // k)
    every = max(1, -(-len(records) // 10))  # without a bar: a line per ~10% of the problems
    logged = 0
    try:
        for start in tqdm(range(0, len(records), n_batch), desc=f"eval {benchmark}", disable=not progress):
            batch = records[start : start + n_batch]
            prompts = [format_prompt(r["prompt"], tokenizer, template) for r in batch]
            ro = generate(model, tokenizer, prompts, sampling, seed=settings.seed + start, num_samples=k)
            lengths += [int(n) for n in ro.lengths.tolist()]
            truncated += int(ro.truncated.sum())
            for i, rec in enumerate(batch):
                correct = []
                for j in range(k):
                    text = ro.texts[i * k + j]
                    ok = reward.score(text, rec["answer"])[1] >= 1.0
                    correct.append(ok)
                    lines.append({"problem": start + i, "sample": j, "prompt": prompts[i], "completion": text,
                                  "extracted": extract_answer(text) if kind == "math" else text.strip(),
                                  "gold": rec["answer"], "correct": ok})
                per_problem.append(sum(correct) / k)
            done = len(per_problem)
            if not progress and (done - logged >= every or done == len(records)):
                logged = done
                el = int(time.time() - t0)
                print(f"eval {benchmark}: {done}/{len(records)} problems, pass@1 so far "
                      f"{sum(per_problem) / done:.3f}, elapsed {el // 60}:{el % 60:02d}", flush=True)
    finally:
        reward.close()
    from qerl.files import write_jsonl

    write_jsonl(out_samples, lines)
    summary = {**benchmark_meta(bench), "pass@1": sum(per_problem) / max(1, len(per_problem)),
               "problems": len(per_problem), "samples_per_problem": k, "seconds": time.time() - t0,
               "completion_tokens_mean": sum(lengths) / max(1, len(lengths)),
               "truncated_frac": truncated / max(1, len(lengths)), "per_problem": per_problem,
               "settings": asdict(settings), **(meta or {})}
    write_json(out_json, summary)
    return summary
