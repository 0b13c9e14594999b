"""Supervised warm-start: teach a (tiny) model the task's answer format so RL starts with
non-zero reward. Full-parameter cross-entropy on the completion tokens (answer + EOS) only."""
from __future__ import annotations

from pathlib import Path

import torch

MARKER = "qerl_sft.json"  # what an output directory of sft holds (a rerun may replace it)


def sft(model_path: str | Path, output: str | Path, records: list[dict], steps: int = 200, lr: float = 3e-3,
        batch_size: int = 32, seed: int = 0, template: str = "raw", progress: bool = True, force: bool = False) -> dict:
    """Fine-tune ``model_path`` on ``records`` and save the result (bf16) with its tokenizer. An ``output`` holding
    anything but an earlier warm start (its ``qerl_sft.json``) is replaced only with ``force``."""
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from qerl.checkpoint import atomic_directory
    from qerl.data.tasks import format_prompt

    if steps < 1 or batch_size < 1 or lr <= 0:
        raise ValueError(f"sft: steps, batch_size and lr must be positive (got {steps}, {batch_size}, {lr})")
    from qerl.checkpoint import CheckpointError, is_nonempty_dir, write_json

    if is_nonempty_dir(Path(output)) and not (Path(output) / MARKER).exists() and not force:
        raise CheckpointError(f"{output}: holds something other than an earlier warm start; refusing to replace it "
                              "(pass --force)")
    torch.manual_seed(seed)
    tok = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(seed)
    losses = []
    for step in tqdm(range(steps), desc="sft", disable=not progress):
        idx = torch.randint(len(records), (batch_size,), generator=gen).tolist()
        prompts = [tok(format_prompt(records[i]["prompt"], tok, template), add_special_tokens=False).input_ids for i in idx]
        answers = [tok(records[i]["answer"], add_special_tokens=False).input_ids + [tok.eos_token_id] for i in idx]
        width = max(len(p) + len(a) for p, a in zip(prompts, answers))
        ids = torch.full((batch_size, width), tok.pad_token_id)
        labels = torch.full((batch_size, width), -100)
        attn = torch.zeros((batch_size, width), dtype=torch.long)
        for r, (p, a) in enumerate(zip(prompts, answers)):
            seq = p + a
            ids[r, : len(seq)] = torch.tensor(seq)
            labels[r, len(p) : len(seq)] = torch.tensor(a)
            attn[r, : len(seq)] = 1
        loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    model = model.to(torch.bfloat16)
    stats = {"first_loss": losses[0], "last_loss": sum(losses[-10:]) / len(losses[-10:])}
    with atomic_directory(Path(output), force=True) as tmp:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        for f in Path(model_path).glob("generation_config.json"):
            (tmp / f.name).write_bytes(f.read_bytes())
        write_json(tmp / MARKER, {"base": str(model_path), "steps": steps, "lr": lr, "seed": seed, **stats})
    return stats
