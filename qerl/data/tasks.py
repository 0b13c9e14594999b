"""Tasks: prompt/answer records from the hub, local files, or the offline synthetic arithmetic task.

A record is ``{"prompt": str, "answer": str}`` after field mapping. Hub datasets go through
``datasets.load_dataset`` with a pinned revision (set ``revision`` to a commit for exact
reproduction). The paper's prompt suffix (App. E) and chat templates are applied by
:func:`format_prompt`.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

PAPER_SUFFIX = (
    "Solve the following math problem step by step. The reasoning process and direct answer are "
    "enclosed within <think> </think> and <answer> </answer> tags, respectively, i.e., <think> "
    "reasoning process here </think> <answer> answer here </answer>."
)


@dataclass(frozen=True)
class HubSpec:
    """Where a dataset lives and how its fields map to prompt/answer."""

    repo: str
    config: str | None
    split: str
    prompt_field: str
    answer_field: str
    answer_format: str = "plain"  # one of ANSWER_FORMATS
    revision: str = "main"
    max_prompt_chars: int | None = None


#: how a benchmark's answers are judged (the reward of :mod:`qerl.rewards` it names): ``exact`` (the extracted
#: answer equals the gold string: the synthetic task) or ``math`` (math-verify's equivalence, e.g. 1/2 = 0.5)
VERIFIERS = ("exact", "math")


@dataclass(frozen=True)
class RegisteredBenchmark:
    """A benchmark ``qerl evaluate --benchmark NAME`` knows: where its problems come from (``synthetic``: built
    offline; ``hub``: the :data:`HUB_TASKS` entry ``hub``), the verifier it declares (:data:`VERIFIERS`), the prompt
    template it is always read with (None: the evaluation's own), its problem count (for projections) and a line
    for ``--help``."""

    source: str
    verifier: str
    hub: str | None = None
    template: str | None = None
    problems: int | None = None
    doc: str = ""


#: the registered evaluation benchmarks, one row each (the CLI's help, the workflow's checks and the projections
#: read this table); any other benchmark is a local file (``evaluation.local_benchmarks``, its verifier declared)
REGISTERED_BENCHMARKS: dict[str, RegisteredBenchmark] = {
    "synthetic_test": RegisteredBenchmark("synthetic", "exact", template="raw",
                                          doc="held-out problems of the offline arithmetic task"),
    "gsm8k_test": RegisteredBenchmark("hub", "math", "gsm8k_test", problems=1319, doc="GSM8K test split"),
    "math500": RegisteredBenchmark("hub", "math", "math500", problems=500, doc="MATH-500"),
    "aime24": RegisteredBenchmark("hub", "math", "aime24", problems=30, doc="AIME 2024"),
    "aime25": RegisteredBenchmark("hub", "math", "aime25", problems=30, doc="AIME 2025"),
    "amc23": RegisteredBenchmark("hub", "math", "amc23", problems=40, doc="AMC 2023"),
}
BENCHMARKS = tuple(REGISTERED_BENCHMARKS)

HUB_TASKS: dict[str, HubSpec] = {
    "gsm8k": HubSpec("openai/gsm8k", "main", "train", "question", "answer", "gsm8k"),
    "gsm8k_test": HubSpec("openai/gsm8k", "main", "test", "question", "answer", "gsm8k"),
    "bigmath_l345": HubSpec("open-r1/Big-Math-RL-Verified-Processed", "level_3_4_5", "train", "prompt",
                            "solution", max_prompt_chars=1024),
    "bigmath_l45": HubSpec("open-r1/Big-Math-RL-Verified-Processed", "level_4_5", "train", "prompt",
                           "solution", max_prompt_chars=1024),
    "dapo_math": HubSpec("open-r1/DAPO-Math-17k-Processed", "all", "train", "prompt", "solution"),
    "math500": HubSpec("HuggingFaceH4/MATH-500", None, "test", "problem", "answer"),
    "aime24": HubSpec("HuggingFaceH4/aime_2024", None, "train", "problem", "answer"),
    "aime25": HubSpec("yentinglin/aime_2025", None, "train", "problem", "answer"),
    "amc23": HubSpec("math-ai/amc23", None, "test", "question", "answer"),
}


class DataError(ValueError):
    """A dataset is missing, unreadable or has rows without the mapped fields."""


#: how a file's answer field holds the gold answer: ``plain`` (as is), ``gsm8k`` (the text after the last
#: ``####``, commas removed), ``boxed`` (the last ``\\boxed{…}`` of a worked solution), ``aime`` (an integer
#: 0 … 999, leading zeros dropped: "033" -> "33")
ANSWER_FORMATS = ("plain", "gsm8k", "boxed", "aime")


def gold_answer(answer: str, answer_format: str) -> str:
    """The gold answer of an answer field in ``answer_format`` (:data:`ANSWER_FORMATS`); ValueError naming what
    is wrong."""
    from qerl.rewards.extract import extract_answer, gsm8k_gold

    if answer_format == "plain":
        return answer
    if answer_format == "gsm8k":
        return gsm8k_gold(answer)
    if answer_format == "boxed":
        got = extract_answer(answer, ("boxed",))
        if not got:
            raise ValueError(f"no \\boxed{{...}} answer in {answer[-80:]!r}")
        return got
    if answer_format == "aime":
        text = answer.strip()
        if not text.lstrip("-").isdigit() or not 0 <= int(text) <= 999:
            raise ValueError(f"an AIME answer is an integer 0 ... 999, got {answer[:40]!r}")
        return str(int(text))
    raise ValueError(f"answer format {answer_format!r} is not one of {', '.join(ANSWER_FORMATS)}")


def _map_rows(rows, prompt_field: str, answer_field: str, answer_format: str, source: str,
              max_prompt_chars: int | None = None) -> list[dict]:
    if answer_format not in ANSWER_FORMATS:
        raise DataError(f"{source}: answer format {answer_format!r} is not one of {', '.join(ANSWER_FORMATS)}")
    out = []
    for i, row in enumerate(rows):
        missing = [f for f in (prompt_field, answer_field) if f not in row or row[f] is None]
        if missing:
            raise DataError(f"{source}: row {i} has no field(s) {missing} (fields: {sorted(row)})")
        prompt, answer = str(row[prompt_field]), str(row[answer_field])
        try:
            answer = gold_answer(answer, answer_format)
        except ValueError as e:
            raise DataError(f"{source}: row {i}, field {answer_field!r} ({answer_format} format): {e}") from None
        if not answer.strip():
            raise DataError(f"{source}: row {i}, field {answer_field!r} is empty: an empty gold answer makes an empty "
                            "completion count as correct (the policy would learn to say nothing); fix or drop the row")
        if not prompt.strip():
            raise DataError(f"{source}: row {i}, field {prompt_field!r} is empty: a problem without a question (the "
                            "policy would be trained and scored on its answer alone); fix or drop the row")
        if max_prompt_chars is None or len(prompt) <= max_prompt_chars:
            out.append({"prompt": prompt, "answer": answer})
    return out


def load_hub(name: str, revision: str | None = None) -> list[dict]:
    """Load a registered hub task (needs network or a populated HF cache)."""
    if name not in HUB_TASKS:
        raise DataError(f"unknown task {name!r}; known: {sorted(HUB_TASKS)} (or use a local file)")
    spec = HUB_TASKS[name]
    import datasets

    try:
        ds = datasets.load_dataset(spec.repo, spec.config, split=spec.split, revision=revision or spec.revision)
    except Exception as e:
        import os

        if any(os.environ.get(v, "").lower() in ("1", "true", "yes", "on") for v in ("HF_HUB_OFFLINE",
                                                                                     "HF_DATASETS_OFFLINE")):
            raise DataError(f"{name} ({spec.repo}{'@' + str(revision) if revision else ''}) is not in this machine's "
                            "cache and the hub is off: run `qerl fetch --configfile <config>` on a machine with "
                            "network and copy its cache (HF_HOME) here, or use a local JSONL/Parquet file") from None
        raise DataError(f"could not load {spec.repo} ({type(e).__name__}: {e}); without network use a "
                        "local JSONL/Parquet file or set HF_DATASETS_OFFLINE=1 with a cached copy") from None
    return _map_rows(ds, spec.prompt_field, spec.answer_field, spec.answer_format, spec.repo, spec.max_prompt_chars)


def load_local(path: str | Path, prompt_field: str = "prompt", answer_field: str = "answer",
               answer_format: str = "plain") -> list[dict]:
    """Records from a local ``.jsonl`` or ``.parquet`` file."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"{path}: file not found")
    if path.suffix == ".jsonl":
        rows = []
        try:
            with open(path, encoding="utf-8") as f:
                for i, line in enumerate(f):
                    if line.strip():
                        from qerl.readers import InputFileError, _pairs

                        try:  # duplicate keys refused, as in every file qerl reads (which one would count?)
                            rows.append(json.loads(line, object_pairs_hook=_pairs(f"{path}:{i + 1}")))
                        except json.JSONDecodeError as e:
                            raise DataError(f"{path}: line {i + 1} is not JSON ({e})") from None
                        except InputFileError as e:
                            raise DataError(str(e)) from None
        except UnicodeDecodeError:
            raise DataError(f"{path}: not a UTF-8 text file (a .jsonl file holds one JSON object per line)") from None
        if any(not isinstance(r, dict) for r in rows):
            raise DataError(f"{path}: every line must be a JSON object with the prompt and answer fields")
    elif path.suffix == ".parquet":
        import pandas as pd

        try:
            rows = pd.read_parquet(path).to_dict("records")
        except Exception as e:  # pyarrow's errors for a file that is no Parquet
            raise DataError(f"{path}: not a readable Parquet file ({type(e).__name__}: "
                            f"{str(e).splitlines()[0] if str(e) else ''})") from None
    else:
        raise DataError(f"{path}: unsupported file type {path.suffix!r} (use .jsonl or .parquet)")
    return _map_rows(rows, prompt_field, answer_field, answer_format, str(path))


def synthetic_arithmetic(n: int, seed: int = 0, max_operand: int = 9, ops: str = "+") -> list[dict]:
    """``n`` seeded problems ``"a+b="`` with exact answers (a tiny model can learn them on a CPU)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b, op = rng.randint(0, max_operand), rng.randint(0, max_operand), rng.choice(ops)
        val = {"+": a + b, "-": a - b, "*": a * b}[op]
        out.append({"prompt": f"{a}{op}{b}=", "answer": str(val)})
    return out


def format_prompt(text: str, tokenizer=None, template: str = "raw", suffix: str | None = None) -> str:
    """``raw``: the text (plus suffix); ``chat``: the tokenizer's chat template with a user turn;
    ``paper``: chat template with the paper's App. E instruction appended."""
    if template == "paper":
        suffix = PAPER_SUFFIX
    body = f"{text} {suffix}" if suffix else text
    if template == "raw":
        return body
    if template in ("chat", "paper"):
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise DataError("chat prompt template needs a tokenizer with a chat template")
        return tokenizer.apply_chat_template([{"role": "user", "content": body}], tokenize=False,
                                             add_generation_prompt=True)
    raise DataError(f"unknown prompt template {template!r}; use 'raw', 'chat' or 'paper'")
