"""AWQ for NVFP4: activation-aware per-input-channel scales, searched on calibration text and folded into the
preceding norm or linear, so the NVFP4 checkpoint keeps its format and costs nothing at run time.

AWQ (Lin et al. 2024, "Activation-aware Weight Quantization") protects the weight columns that meet large
activations. For a linear ``y = x Wᵀ`` and a positive per-input-channel scale ``s [K]``,

    y = (x / s) (W diag(s))ᵀ   exactly,   so   ŷ(s) = (x / s) Q(W diag(s))ᵀ

is what the quantized layer computes once ``1 / s`` is folded into what produces ``x``. The search (per group of
linears that read the same ``x``) takes ``s = mean|x|^α`` (per channel, over the calibration tokens, normalised by
``sqrt(max s · min s)``) for ``α`` on a grid in [0, 1) and keeps the ``α`` with the least
``Σ_linears ‖x Wᵀ − ŷ(s)‖²`` (``α = 0`` is round-to-nearest, so the calibration loss never exceeds RTN's). ``Q`` is
NVFP4 quantize-dequantize under the scale rule of the checkpoint (``max6`` or ``four-over-six``) with the group's
fused global scale, as the checkpoint will hold it.

Groups in a Qwen2 / Llama decoder layer and where ``1 / s`` goes:

* q / k / v (read ``input_layernorm``'s output): the norm's weight;
* gate / up (read ``post_attention_layernorm``'s output): the norm's weight;
* o (reads attention's output, linear in v): v's rows — only without grouped-query attention
  (``v.out_features == o.in_features``), as AWQ does;
* down (reads ``act(gate) · up``): up's rows.

The layers run one after another on the calibration hidden states, one forward each: it captures every group's
input and the layer's output, then the groups are searched and folded (a fold is exact, so folding one group moves
no other group's input and not the output). :func:`smooth` changes the model in place; :func:`reference_fold` is the readable
one-group fold the tests check against.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from qerl.quant import nvfp4

GRID = 20  # alpha in {0, 1/20, ..., 19/20}


@dataclass
class Group:
    """Linears that read one input, and where its ``1 / s`` is folded (``prev``: a norm or a linear's rows)."""

    name: str
    linears: list  # nn.Linear modules
    prev: torch.nn.Module
    prev_is_norm: bool


def fake_quant(w: torch.Tensor, gs: torch.Tensor, scale_rule: str) -> torch.Tensor:
    """NVFP4 quantize-dequantize of ``w [N, K]`` under the global scale ``gs`` (fp32 result)."""
    p, s, _ = nvfp4.quantize(w.float(), global_scale=gs, scale_rule=scale_rule)
    return nvfp4.dequantize(p, s, gs, dtype=torch.float32)


def group_loss(x: torch.Tensor, ws: list[torch.Tensor], s: torch.Tensor, scale_rule: str) -> float:
    """``Σ ‖x Wᵀ − (x / s) Q(W diag(s))ᵀ‖²`` over the group's weights ``ws``, ``x [T, K]`` fp32, with the group's
    fused global scale taken from the scaled weights (the minimum, as the checkpoint holds it)."""
    scaled = [w.float() * s[None, :] for w in ws]
    gs = torch.stack([nvfp4.compute_global_scale(w, scale_rule) for w in scaled]).amin(0)
    xs = x / s[None, :]
    return sum(float((x @ w.float().T - xs @ fake_quant(ws_, gs, scale_rule).T).square().sum())
               for w, ws_ in zip(ws, scaled))


def search_scale(x: torch.Tensor, ws: list[torch.Tensor], scale_rule: str = "max6", grid: int = GRID
                 ) -> tuple[torch.Tensor, dict]:
    """The best per-channel scale ``s [K]`` (fp32) for the group's weights ``ws`` on inputs ``x [T, K]`` and its
    report ``{"alpha", "loss", "loss_rtn"}``."""
    x = x.float()
    x_mean = x.abs().mean(0).clamp(min=1e-8)
    best, best_s, rtn = None, torch.ones_like(x_mean), None
    alpha_best = 0.0
    for i in range(grid):
        alpha = i / grid
        s = x_mean.pow(alpha)
        s = (s / (s.max() * s.min()).sqrt()).clamp(min=1e-4)
        loss = group_loss(x, ws, s, scale_rule)
        if i == 0:
            rtn = loss
        if best is None or loss < best:
            best, best_s, alpha_best = loss, s, alpha
    return best_s, {"alpha": alpha_best, "loss": best, "loss_rtn": rtn}


@torch.no_grad()
def reference_fold(group: Group, s: torch.Tensor) -> None:
    """Fold ``s`` into the group: ``prev`` (its weight, or its rows and bias) divided by ``s``, each linear's
    columns multiplied by it. Exact in real arithmetic: the model computes the same function."""
    s = s.to(group.prev.weight.device)
    if group.prev_is_norm:
        group.prev.weight.div_(s.to(group.prev.weight.dtype))
    else:
        group.prev.weight.div_(s[:, None].to(group.prev.weight.dtype))
        if getattr(group.prev, "bias", None) is not None:
            group.prev.bias.div_(s.to(group.prev.bias.dtype))
    for lin in group.linears:
        lin.weight.mul_(s[None, :].to(lin.weight.dtype))


def layer_groups(layer, name: str) -> list[Group]:
    """The AWQ groups of one Qwen2 / Llama decoder layer (o / v only without grouped-query attention)."""
    a, m = layer.self_attn, layer.mlp
    groups = [Group(f"{name}.self_attn.qkv", [a.q_proj, a.k_proj, a.v_proj], layer.input_layernorm, True)]
    if a.v_proj.out_features == a.o_proj.in_features:
        groups.append(Group(f"{name}.self_attn.o", [a.o_proj], a.v_proj, False))
    groups += [Group(f"{name}.mlp.gate_up", [m.gate_proj, m.up_proj], layer.post_attention_layernorm, True),
               Group(f"{name}.mlp.down", [m.down_proj], m.up_proj, False)]
    return groups


def _inputs(layer, groups: list[Group], hidden: torch.Tensor, kwargs: dict) -> tuple[dict[str, torch.Tensor],
                                                                                    torch.Tensor]:
    """Run ``layer`` on ``hidden`` and capture each group's input (its first linear's, as ``[tokens, K]``);
    return them and the layer's output."""
    seen, hooks = {}, []
    for g in groups:
        def hook(mod, args, g=g):
            seen.setdefault(g.name, []).append(args[0].detach().reshape(-1, args[0].shape[-1]).float())
        hooks.append(g.linears[0].register_forward_pre_hook(hook))
    try:
        out = layer(hidden, **kwargs)
    finally:
        for h in hooks:
            h.remove()
    out = out[0] if isinstance(out, tuple) else out
    return {k: torch.cat(v) for k, v in seen.items()}, out


@torch.no_grad()
def smooth(model, input_ids: torch.Tensor, scale_rule: str = "max6", skip_layers: set[int] = frozenset(),
           grid: int = GRID, max_tokens: int = 8192, progress: bool = False) -> dict:
    """Search and fold AWQ scales into ``model`` (a transformers Qwen2 / Llama causal LM) in place, layer by layer,
    on calibration ``input_ids [n, L]``. ``skip_layers``: decoder layers left as they are (those kept in bf16).
    ``max_tokens``: at most this many calibration tokens (evenly spaced) enter each loss. Returns a report
    ``{group name: {"alpha", "loss", "loss_rtn"}}``."""
    from tqdm.auto import tqdm

    dec = model.get_decoder()
    device = next(model.parameters()).device
    ids = input_ids.to(device)
    hidden = dec.embed_tokens(ids)
    pos = torch.arange(ids.shape[1], device=device)[None, :].expand(ids.shape[0], -1)
    kwargs = {"position_embeddings": dec.rotary_emb(hidden, pos), "position_ids": pos, "attention_mask": None}
    try:
        from transformers.masking_utils import create_causal_mask

        kwargs["attention_mask"] = create_causal_mask(config=model.config, inputs_embeds=hidden,
                                                      attention_mask=torch.ones_like(ids), past_key_values=None,
                                                      position_ids=pos, cache_position=pos[0])
    except (ImportError, TypeError):  # (the layer builds a causal mask itself when given none)
        pass
    report = {}
    for i, layer in enumerate(tqdm(dec.layers, desc="awq", disable=not progress)):
        groups = layer_groups(layer, f"layers.{i}")
        # One forward gives every group's input and the layer's output: a fold is exact, so folding one group
        # changes neither another group's input nor what the layer computes (rounding aside).
        xs, hidden = _inputs(layer, [] if i in skip_layers else groups, hidden, kwargs)
        for g in groups if i not in skip_layers else []:
            x = xs[g.name]
            if x.shape[0] > max_tokens:
                x = x[torch.linspace(0, x.shape[0] - 1, max_tokens, device=x.device).long()]
            s, rep = search_scale(x, [lin.weight for lin in g.linears], scale_rule, grid)
            reference_fold(g, s)
            report[g.name] = rep
    return report


def calibration_texts(path, field: str = "question") -> list[str]:
    """The calibration texts of a local file: a JSONL file's ``field`` (e.g. GSM8K's ``question``) or a text
    file's non-empty lines. An empty file, or a JSONL row without ``field``, is an error naming it."""
    import json
    from pathlib import Path

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--calibration-data {path}: no such file")
    lines = [x for x in path.read_text().splitlines() if x.strip()]
    if path.suffix == ".jsonl":
        out = []
        for i, line in enumerate(lines, 1):
            row = json.loads(line)
            if not isinstance(row.get(field), str) or not row[field].strip():
                raise ValueError(f"--calibration-data {path}: line {i} has no text field {field!r} "
                                 f"(fields: {sorted(row)})")
            out.append(row[field])
        lines = out
    if not lines:
        raise ValueError(f"--calibration-data {path}: holds no text")
    return lines


def calibration_ids(tokenizer, texts: list[str], samples: int, seq_len: int, template: str = "raw") -> torch.Tensor:
    """``[samples, seq_len]`` token ids: the texts (each through :func:`qerl.data.tasks.format_prompt` with
    ``template``, then the EOS token) concatenated in order, repeated if short, cut into rows -- as AWQ's own
    calibration packs its samples."""
    from qerl.data.tasks import format_prompt

    need, stream, i = samples * seq_len, [], 0
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    while len(stream) < need:
        text = format_prompt(texts[i % len(texts)], tokenizer, template)
        stream += tokenizer(text, add_special_tokens=False)["input_ids"] + eos
        i += 1
        if i > 100 * len(texts) and not stream:
            raise ValueError("calibration texts tokenize to nothing")
    return torch.tensor(stream[:need], dtype=torch.long).reshape(samples, seq_len)
