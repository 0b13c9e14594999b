"""AWQ for NVFP4: activation-aware per-input-channel scales and weight clipping, searched on calibration text and
folded into the weights, so the NVFP4 checkpoint keeps its format and costs nothing at run time.

AWQ (Lin et al. 2024, "Activation-aware Weight Quantization"; llm-awq's ``auto_scale`` / ``auto_clip``) protects the
weight columns that meet large activations. For a linear ``y = x Wᵀ`` and a positive per-input-channel scale
``s [K]``,

    y = (x / s) (W diag(s))ᵀ   exactly,   so   ŷ(s) = (x / s) Q(W diag(s))ᵀ = x (Q(W diag(s)) diag(1/s))ᵀ

is what the quantized layer computes once ``1 / s`` is folded into what produces ``x``. The search (per group of
linears that read the same ``x``) takes ``s = mean|x|^α`` (per channel, over the calibration tokens, normalised by
``sqrt(max s · min s)``) for ``α`` on a grid in [0, 1) and keeps the ``α`` with the least squared error of the
**block's output**, as llm-awq inspects it: the attention block's output for q / k / v (the scaled-and-quantized
q / k / v inside the real attention: rotary, softmax, o), the MLP's output for gate / up, the linear's own output for
o and down. ``α = 0`` is round-to-nearest, so the calibration loss never exceeds RTN's. ``Q`` is NVFP4
quantize-dequantize under the checkpoint's scale rule (``max6`` or ``four-over-six``) with the group's fused global
scale, as the checkpoint will hold it.

Then the clipping search (``auto_clip``; not for q / k, whose error the attention's q·k product amplifies): per
output row and 16-element NVFP4 block, the largest ``|w|`` is clipped to ``r · max|w|`` for ``r`` in
{1, 0.95, …, 0.5}, each block keeping the ``r`` with the least squared error of its part of the output on the
calibration inputs (at most :data:`CLIP_TOKENS` of them, evenly spaced).

Groups in a Qwen2 / Llama decoder layer and where ``1 / s`` goes:

* q / k / v (read ``input_layernorm``'s output): the norm's weight;
* gate / up (read ``post_attention_layernorm``'s output): the norm's weight;
* o (reads attention's output, linear in v): v's rows — only without grouped-query attention
  (``v.out_features == o.in_features``), as AWQ does;
* down (reads ``act(gate) · up``): up's rows.

A norm divided by ``s`` also divides AQN's noise on it (QeRL adds its noise to the norm's weight): the effective
per-channel noise of a folded norm is ``σ · s_j`` of the unfolded one; the report gives the quantiles of ``s``.

The layers run one after another on the calibration hidden states of the bf16 model, one forward each: it captures
every group's and block's input and output, then the groups are searched, folded and clipped. :func:`smooth`
changes the model in place; :func:`reference_fold` is the readable one-group fold the tests check against;
:func:`kl_to` measures the end-to-end guard (AWQ's KL on held-out tokens against its own α = 0 base's).
"""
from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from qerl.quant import nvfp4

GRID = 20  # alpha in {0, 1/20, ..., 19/20}
CLIP_GRID = 11  # clip ratios 1, 0.95, ..., 0.5
CLIP_TOKENS = 512  # calibration tokens a clip search reads (llm-awq's n_sample_token)
BLOCK = 16  # NVFP4's block along K
CHUNK_TOKENS = 16384  # calibration tokens one forward of a layer or block reads (rows of [n, L] at a time): bounded
#                       memory at any calibration size (the paper's 256 x 2,048 in one forward materialises a 56 GiB
#                       fp32 attention matrix [256, heads, 2048, 2048] where attention falls back to the math kernel)


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


def folded_quant(w: torch.Tensor, s: torch.Tensor, gs: torch.Tensor, scale_rule: str) -> torch.Tensor:
    """``Q(W diag(s)) diag(1 / s)`` (fp32): the weight that, fed the unfolded input ``x``, computes what the folded
    and quantized linear computes on ``x / s``."""
    return fake_quant(w.float() * s[None, :], gs, scale_rule) / s[None, :]


def fused_global_scale(ws: list[torch.Tensor], scale_rule: str, s: torch.Tensor | None = None) -> torch.Tensor:
    """The global scale a group's linears share in the checkpoint (the least of theirs), of ``W diag(s)``."""
    return torch.stack([nvfp4.compute_global_scale(w.float() * (1 if s is None else s[None, :]), scale_rule)
                        for w in ws]).amin(0)


@contextmanager
def swapped(linears: list, weights: list[torch.Tensor]):
    """The linears compute with ``weights`` inside the block, with their own weights again after it."""
    old = [lin.weight.data for lin in linears]
    try:
        for lin, w in zip(linears, weights):
            lin.weight.data = w.to(lin.weight.dtype)
        yield
    finally:
        for lin, w in zip(linears, old):
            lin.weight.data = w


def _rows(obj, a: int, b: int, n: int):
    """``obj`` (a tensor, or tuples / lists / dicts of them) cut to calibration rows ``a:b`` along every leading
    dimension of size ``n`` (the rows); anything else (a broadcast mask ``[1, …]``, a flag) as it is."""
    if isinstance(obj, torch.Tensor):
        return obj[a:b] if obj.dim() and obj.shape[0] == n else obj
    if isinstance(obj, (tuple, list)):
        return type(obj)(_rows(o, a, b, n) for o in obj)
    if isinstance(obj, dict):
        return {k: _rows(v, a, b, n) for k, v in obj.items()}
    return obj


def row_chunks(n: int, seq_len: int, tokens: int = CHUNK_TOKENS) -> list[tuple[int, int]]:
    """``[(a, b), …]``: the calibration rows ``[0, n)`` in chunks of at most ``max(1, tokens // seq_len)`` rows."""
    step = max(1, tokens // max(1, seq_len))
    return [(a, min(n, a + step)) for a in range(0, n, step)]


def block_loss(module, chunks: list[tuple], linears: list) -> Callable:
    """``loss(weights) = Σ_chunks ‖module(…) − reference‖²`` with ``linears`` computing with ``weights``: the error of
    a block's output (attention for q / k / v, the MLP for gate / up) as llm-awq's search measures it. ``chunks``:
    ``[(args, kwargs, reference output), …]``, the block's captured inputs and outputs a chunk of rows at a time."""
    def loss(weights: list[torch.Tensor]) -> float:
        total = 0.0
        with swapped(linears, weights):
            for args, kwargs, reference in chunks:
                out = module(*args, **kwargs)
                out = out[0] if isinstance(out, tuple) else out
                total += float((out.float() - reference.float()).square().sum())
        return total
    return loss


def search_scale(x: torch.Tensor, ws: list[torch.Tensor], scale_rule: str = nvfp4.DEFAULT_RULE, grid: int = GRID,
                 block: Callable | None = None) -> tuple[torch.Tensor, dict]:
    """The best per-channel scale ``s [K]`` (fp32) for the group's weights ``ws`` on inputs ``x [T, K]`` and its
    report ``{"alpha", "loss", "loss_rtn"}``. ``block``: the group's block-output loss (:func:`block_loss`) judged
    on ``Q(W diag(s)) diag(1 / s)``; without it, the linears' own outputs (:func:`group_loss`)."""
    x = x.float()
    x_mean = x.abs().mean(0).clamp(min=1e-8)
    best, best_s, rtn = None, torch.ones_like(x_mean), None
    alpha_best = 0.0
    for i in range(grid):
        alpha = i / grid
        s = x_mean.pow(alpha)
        s = (s / (s.max() * s.min()).sqrt()).clamp(min=1e-4)
        if block is None:
            loss = group_loss(x, ws, s, scale_rule)
        else:
            gs = fused_global_scale(ws, scale_rule, s)
            loss = block([folded_quant(w, s, gs, scale_rule) for w in ws])
        if i == 0:
            rtn = loss
        if best is None or loss < best:
            best, best_s, alpha_best = loss, s, alpha
    return best_s, {"alpha": alpha_best, "loss": best, "loss_rtn": rtn}


def _spaced(x: torch.Tensor, n: int | None) -> torch.Tensor:
    """At most ``n`` rows of ``x``, evenly spaced (all of them for ``n`` None)."""
    if n is None or x.shape[0] <= n:
        return x
    return x[torch.linspace(0, x.shape[0] - 1, n, device=x.device).long()]


def search_clip(x: torch.Tensor, w: torch.Tensor, gs: torch.Tensor, scale_rule: str = nvfp4.DEFAULT_RULE, grid: int = CLIP_GRID,
                tokens: int | None = CLIP_TOKENS, rows: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """llm-awq's ``auto_clip`` for NVFP4: per output row and 16-element block of ``w [N, K]``, the clip ratio ``r``
    in {1, 0.95, …} whose clipped-and-quantized block errs least on its share of the output on inputs ``x [T, K]``
    (``Σ_t (x_tb · (w_nb − Q(clip(w_nb, r))))²``). Returns the clipped weight (fp32) and the ratios ``[N, K / 16]``."""
    x, w = _spaced(x.float(), tokens), w.float()
    n, k = w.shape
    g = k // BLOCK
    xb = x.reshape(x.shape[0], g, BLOCK)
    wb = w.reshape(n, g, BLOCK)
    amax = wb.abs().amax(-1, keepdim=True)
    best_err = torch.full((n, g), float("inf"), device=w.device)
    best_r = torch.ones((n, g), device=w.device)
    for i in range(grid):
        r = 1.0 - 0.05 * i
        lim = r * amax
        diff = (wb - fake_quant(torch.maximum(torch.minimum(wb, lim), -lim).reshape(n, k), gs, scale_rule)
                .reshape(n, g, BLOCK))
        err = torch.cat([torch.einsum("tgb,ngb->tng", xb, diff[a:a + rows]).square().sum(0)
                         for a in range(0, n, rows)])
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_r = torch.where(better, torch.full_like(best_r, r), best_r)
    lim = best_r[..., None] * amax
    return torch.maximum(torch.minimum(wb, lim), -lim).reshape(n, k), best_r


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


@dataclass
class Captured:
    """What one forward of a decoder layer shows: each group's input ``[tokens, K]``, the attention and MLP blocks'
    inputs and outputs a chunk of rows at a time (``{"attn" | "mlp": [(args, kwargs, output), …]}``), and the
    layer's output ``[n, L, D]``."""

    x: dict
    blocks: dict
    out: torch.Tensor


def _capture(layer, groups: list[Group], hidden: torch.Tensor, kwargs: dict,
             chunk_tokens: int = CHUNK_TOKENS) -> Captured:
    """Run ``layer`` on ``hidden [n, L, D]`` (``kwargs``: its position embeddings, mask, …, over the same ``n`` rows)
    a chunk of rows at a time (:func:`row_chunks`), and capture each group's input (its first linear's) and the
    attention / MLP blocks' inputs and outputs (none without ``groups``)."""
    seen, blocks, hooks, outs = {}, {"attn": [], "mlp": []}, [], []
    for g in groups:
        def hook(mod, args, g=g):
            seen.setdefault(g.name, []).append(args[0].detach().reshape(-1, args[0].shape[-1]).float())
        hooks.append(g.linears[0].register_forward_pre_hook(hook))
    if groups:
        for name, mod in (("attn", layer.self_attn), ("mlp", layer.mlp)):
            def pre(m, args, kw, name=name):
                blocks[name].append([args, dict(kw), None])

            def post(m, args, kw, out, name=name):
                blocks[name][-1][2] = (out[0] if isinstance(out, tuple) else out).detach()
            hooks.append(mod.register_forward_pre_hook(pre, with_kwargs=True))
            hooks.append(mod.register_forward_hook(post, with_kwargs=True))
    n = hidden.shape[0]
    try:
        for a, b in row_chunks(n, hidden.shape[1], chunk_tokens):
            out = layer(hidden[a:b], **_rows(kwargs, a, b, n))
            outs.append(out[0] if isinstance(out, tuple) else out)
    finally:
        for h in hooks:
            h.remove()
    return Captured({k: torch.cat(v) for k, v in seen.items()}, {k: [tuple(c) for c in v] for k, v in blocks.items()},
                    torch.cat(outs))


def _quantiles(s: torch.Tensor) -> dict:
    q = torch.quantile(s.float().cpu(), torch.tensor([0.0, 0.5, 1.0]))
    return {"s_min": float(q[0]), "s_median": float(q[1]), "s_max": float(q[2])}


@torch.no_grad()
def smooth(model, input_ids: torch.Tensor, scale_rule: str = nvfp4.DEFAULT_RULE, skip_layers: set[int] = frozenset(),
           grid: int = GRID, max_tokens: int | None = None, clip: bool = True, clip_tokens: int | None = CLIP_TOKENS,
           progress: bool = False, chunk_tokens: int = CHUNK_TOKENS) -> dict:
    """Search and fold AWQ scales into ``model`` (a transformers Qwen2 / Llama causal LM) in place, layer by layer,
    on calibration ``input_ids [n, L]``, then clip its weights (``clip``; :func:`search_clip`). ``skip_layers``:
    decoder layers left as they are (those kept in bf16). ``max_tokens``: at most this many calibration tokens
    (evenly spaced) enter the linears' own losses (o, down; default all); the block losses read every token.
    ``chunk_tokens``: the rows a forward reads at a time (memory; the result is the same up to fp32 summation order).
    Returns a report ``{group name: {"alpha", "loss", "loss_rtn", "loss_on", "tokens", "s_min", "s_median",
    "s_max", "clip": {linear: {"ratio_mean", "clipped_frac"}}}}``."""
    from tqdm.auto import tqdm

    dec = model.get_decoder()
    device = next(model.parameters()).device
    ids = input_ids.to(device)
    hidden = dec.embed_tokens(ids)
    pos = torch.arange(ids.shape[1], device=device)[None, :].expand(ids.shape[0], -1)
    kwargs = {"position_embeddings": dec.rotary_emb(hidden, pos), "position_ids": pos, "attention_mask": None}
    try:
        from transformers.masking_utils import create_causal_mask

        # (one row's mask, [1, 1, L, L] or None: every row is causal and unpadded alike, so it broadcasts)
        kwargs["attention_mask"] = create_causal_mask(config=model.config, inputs_embeds=hidden[:1],
                                                      attention_mask=torch.ones_like(ids[:1]), past_key_values=None,
                                                      position_ids=pos[:1], cache_position=pos[0])
    except (ImportError, TypeError):  # (the layer builds a causal mask itself when given none)
        pass
    report = {}
    for i, layer in enumerate(tqdm(dec.layers, desc="awq", disable=not progress)):
        groups = [] if i in skip_layers else layer_groups(layer, f"layers.{i}")
        # One forward of the bf16 layer gives every group's and block's input and output: a fold is exact, so
        # folding one group changes neither another group's input nor what the layer computes (rounding aside).
        cap = _capture(layer, groups, hidden, kwargs, chunk_tokens)
        scales = {}
        for g in groups:
            x, kind = cap.x[g.name], g.name.rsplit(".", 1)[1]
            block = {"qkv": "attn", "gate_up": "mlp"}.get(kind)
            loss = None if block is None else block_loss(layer.self_attn if block == "attn" else layer.mlp,
                                                         cap.blocks[block], g.linears)
            xl = x if block else _spaced(x, max_tokens)
            s, rep = search_scale(xl, [lin.weight for lin in g.linears], scale_rule, grid, loss)
            reference_fold(g, s)
            scales[g.name] = s
            report[g.name] = {**rep, "loss_on": {"attn": "attention output", "mlp": "MLP output"}.get(
                block, "the linear's own output"), "tokens": int(xl.shape[0]), "tokens_total": int(x.shape[0]),
                **_quantiles(s), "clip": {}}
        for g in groups if clip else []:  # clipping after every fold of the layer: on the final weights
            x = _spaced(cap.x[g.name], clip_tokens) / scales[g.name][None, :]  # (spaced first: no full copy)
            gs = fused_global_scale([lin.weight for lin in g.linears], scale_rule)
            for lin in g.linears:
                name = next(n for n, m in layer.named_modules() if m is lin).rsplit(".", 1)[-1]
                if name in ("q_proj", "k_proj") or lin.weight.shape[1] % BLOCK:
                    continue
                w, r = search_clip(x, lin.weight, gs, scale_rule, tokens=clip_tokens)
                lin.weight.data = w.to(lin.weight.dtype)
                report[g.name]["clip"][name] = {"ratio_mean": float(r.mean()),
                                                "clipped_frac": float((r < 1).float().mean())}
        hidden = cap.out
    return report


@contextmanager
def fake_quantized(model, scale_rule: str = nvfp4.DEFAULT_RULE, skip_layers: set[int] = frozenset()):
    """Inside the block every decoder linear (but the layers in ``skip_layers``) computes with its NVFP4
    quantize-dequantize, each group under its fused global scale, as the checkpoint will; the weights come back
    after it (the originals wait on the CPU)."""
    saved = []
    try:
        for i, layer in enumerate(model.get_decoder().layers):
            if i in skip_layers:
                continue
            a, m = layer.self_attn, layer.mlp
            for lins in ([a.q_proj, a.k_proj, a.v_proj], [a.o_proj], [m.gate_proj, m.up_proj], [m.down_proj]):
                gs = fused_global_scale([lin.weight for lin in lins], scale_rule)
                for lin in lins:
                    saved.append((lin, lin.weight.data.to("cpu", copy=True)))
                    lin.weight.data = fake_quant(lin.weight, gs, scale_rule).to(lin.weight.dtype)
        yield model
    finally:
        for lin, w in saved:
            lin.weight.data = w.to(lin.weight.device)


@torch.no_grad()
def logprobs(model, ids: torch.Tensor) -> torch.Tensor:
    """Next-token log-probabilities ``[n, L, V]`` (fp32) of ``ids [n, L]``."""
    return torch.log_softmax(model(ids.to(next(model.parameters()).device)).logits.float(), -1)


@torch.no_grad()
def kl_to(reference: torch.Tensor, model, ids: torch.Tensor, scale_rule: str = nvfp4.DEFAULT_RULE,
          skip_layers: set[int] = frozenset()) -> float:
    """Mean over tokens of KL(reference ‖ NVFP4 of ``model``) (nats), ``reference``: :func:`logprobs` of the bf16
    model on ``ids``: the guard's end-to-end measure."""
    with fake_quantized(model, scale_rule, skip_layers):
        q = logprobs(model, ids)
    return float((reference.exp() * (reference - q)).sum(-1).mean())


def calibration_texts(path, field: str = "question", solution_field: str | None = None) -> list[tuple[str, str]]:
    """The calibration samples of a local file, ``(prompt, completion)`` pairs: a JSONL file's ``field`` (e.g.
    GSM8K's ``question``) and, with ``solution_field``, its worked solution (GSM8K's ``answer``: the tokens a policy
    writes, which AWQ should see as well as the prompt's), or a text file's non-empty lines (no completion). An empty
    file, or a JSONL row without ``field`` / ``solution_field``, is an error naming the file, the line and the
    field."""
    import json
    from pathlib import Path

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--calibration-data {path}: no such file")
    lines = [x for x in path.read_text().splitlines() if x.strip()]
    if path.suffix == ".jsonl":
        out = []
        for i, line in enumerate(lines, 1):
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"--calibration-data {path}: line {i} is not JSON ({e.msg})") from None
            if not isinstance(row, dict) or not isinstance(row.get(field), str) or not row[field].strip():
                raise ValueError(f"--calibration-data {path}: line {i} has no text field {field!r} "
                                 f"(fields: {sorted(row) if isinstance(row, dict) else type(row).__name__})")
            if solution_field is not None and (not isinstance(row.get(solution_field), str)
                                               or not row[solution_field].strip()):
                raise ValueError(f"--calibration-data {path}: line {i} has no solution field {solution_field!r} "
                                 f"(fields: {sorted(row)}); calibrating on prompt + solution tokens needs a worked "
                                 "solution on every row (--calibration-solution-field)")
            out.append((row[field], row[solution_field] if solution_field else ""))
        pairs = out
    else:
        if solution_field is not None:
            raise ValueError(f"--calibration-data {path}: a text file has no fields; --calibration-solution-field "
                             f"{solution_field!r} needs a JSONL file")
        pairs = [(x, "") for x in lines]
    if not pairs:
        raise ValueError(f"--calibration-data {path}: holds no text")
    return pairs


def calibration_ids(tokenizer, texts: list, samples: int, seq_len: int, template: str = "raw") -> torch.Tensor:
    """``[samples, seq_len]`` token ids: the samples (each prompt through :func:`qerl.data.tasks.format_prompt` with
    ``template``, then its completion, then the EOS token) concatenated in order, repeated if short, cut into rows
    -- as AWQ's own calibration packs its samples. ``texts``: ``(prompt, completion)`` pairs or plain strings."""
    from qerl.data.tasks import format_prompt

    need, stream, i = samples * seq_len, [], 0
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    while len(stream) < need:
        item = texts[i % len(texts)]
        prompt, completion = (item, "") if isinstance(item, str) else item
        text = format_prompt(prompt, tokenizer, template) + completion
        stream += tokenizer(text, add_special_tokens=False)["input_ids"] + eos
        i += 1
        if i > 100 * len(texts) and not stream:
            raise ValueError("calibration texts tokenize to nothing")
    return torch.tensor(stream[:need], dtype=torch.long).reshape(samples, seq_len)
