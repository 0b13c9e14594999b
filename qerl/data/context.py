"""Prompts against the model's context, checked before any weights load.

The rule (stated once, used by training and evaluation): a problem whose templated prompt needs ``p`` tokens
fits when ``p + max_new_tokens <= max_position_embeddings`` of the model's ``config.json``. Training leaves the
problems that do not fit out of its prompt stream and says how many (a refusal would stop a 7,500-problem run for
one long problem; a truncated prompt would be a different problem with the same answer); it refuses when none
fits. Evaluation must score every problem, so it refuses and names the first one that does not fit.
"""
from __future__ import annotations

import json
from pathlib import Path

from qerl.data.tasks import DataError, format_prompt


def model_context(model_dir: str | Path) -> int | None:
    """``max_position_embeddings`` of a model directory's ``config.json`` (None when it does not say)."""
    f = Path(model_dir) / "config.json"
    try:
        cfg = json.loads(f.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    v = cfg.get("max_position_embeddings") or (cfg.get("text_config") or {}).get("max_position_embeddings")
    return int(v) if isinstance(v, int) and v > 0 else None


def prompt_lengths(records: list[dict], tokenizer, template: str) -> list[int]:
    """Tokens of each record's templated prompt (as the rollout encodes it: no special tokens added)."""
    prompts = [format_prompt(r["prompt"], tokenizer, template) for r in records]
    ids = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    return [len(x) for x in ids]


def fit_records(records: list[dict], tokenizer, template: str, max_new_tokens: int, context: int | None,
                what: str) -> tuple[list[dict], str | None]:
    """Training: ``(records that fit, a note on those left out or None)``; :class:`DataError` when none fits."""
    if context is None or not records:
        return records, None
    if max_new_tokens >= context:
        raise DataError(f"rollout.max_new_tokens {max_new_tokens} leaves no room for a prompt in the model's context "
                        f"of {context} tokens (max_position_embeddings)")
    lengths = prompt_lengths(records, tokenizer, template)
    room = context - max_new_tokens
    over = [i for i, n in enumerate(lengths) if n > room]
    if not over:
        return records, None
    if len(over) == len(records):
        raise DataError(f"{what}: no prompt fits the model's context: the shortest has {min(lengths)} tokens, "
                        f"+ rollout.max_new_tokens {max_new_tokens} > max_position_embeddings {context}")
    keep = [r for i, r in enumerate(records) if lengths[i] <= room]
    first = over[0]
    return keep, (f"{what}: {len(over)} of {len(records)} problems left out: prompt + rollout.max_new_tokens "
                  f"{max_new_tokens} exceeds the model's context of {context} tokens (e.g. problem {first}: "
                  f"{lengths[first]} prompt tokens)")


def check_records(records: list[dict], tokenizer, template: str, max_new_tokens: int, context: int | None,
                  what: str) -> None:
    """Evaluation: every problem must fit, else a :class:`DataError` naming the first that does not."""
    if context is None or not records:
        return
    lengths = prompt_lengths(records, tokenizer, template)
    for i, n in enumerate(lengths):
        if n + max_new_tokens > context:
            raise DataError(f"{what}: problem {i} has a {n}-token prompt; + --max-new-tokens {max_new_tokens} = "
                            f"{n + max_new_tokens} > the model's context of {context} tokens "
                            "(max_position_embeddings): lower --max-new-tokens")
