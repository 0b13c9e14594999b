"""``qerl bench rollout``: rollout throughput of the engine vs the reference sampler and ``transformers``.

Random-weight Qwen2.5 7B / 14B / 32B shapes (:mod:`qerl.models.random`, built on the GPU layer by
layer), LoRA rank 32 on the seven projections, bases bf16 / NVFP4 (/ NF4 when bitsandbytes imports),
prompts of ``--prompt-len`` tokens, ``--gen-len`` generated tokens with EOS ignored, batches ``--batches``.
Engines: ``qerl`` (:mod:`qerl.rollout.engine`), ``reference`` (:mod:`qerl.rollout.sampler`) and
``transformers`` (``generate`` on the same PEFT model; both at ``--slow-gen-len`` tokens and batches
``--slow-batches``, said in the row's ``note``).

Realistic rollouts: ``--lengths SPEC ...`` (:mod:`qerl.bench.lengths`; e.g. ``lognormal:median=300,sigma=0.9``)
stops each engine row at a seeded drawn length as if it sampled EOS there, so rows finish at different steps and
the engine's slot refill and batch compaction are measured; ``--group-size G`` makes the batch GRPO-shaped
(``batch / G`` prompts, ``G`` samples each). The slow engines always run fixed lengths.

Columns: ``device, model, base, engine, batch, group_size, lengths, prompt_len, gen_len, tok_s, ms_per_step,
floor_ms, frac_of_floor, peak_gb, note``. ``tok_s`` = generated tokens / (prefill + decode seconds) — the one-time
CUDA-graph capture excluded and reported in ``note`` (it is paid once per engine, not per rollout);
``floor_ms`` = bytes one decode step must read (weights incl. lm_head and adapters + the KV cache at the
average length) ÷ the card's measured copy bandwidth (fixed lengths only). Writes ``<device>.csv / .md / .png`` under ``--output``.
"""
from __future__ import annotations

import argparse
import csv
import gc
import json
import re
import time
from pathlib import Path

import torch

from qerl.bench.report import existing_csv
from qerl.models.random import CountTokenizer, prompts
from qerl.models.shapes import MODELS_HELP, model_arg
from qerl.files import atomic_open, write_text_atomic

COLUMNS = ["device", "model", "base", "engine", "batch", "group_size", "lengths", "prompt_len", "gen_len", "tok_s",
           "ms_per_step", "floor_ms", "frac_of_floor", "peak_gb", "note"]
#: columns added later: rows of older files read as these
DEFAULTS = {"group_size": 1, "lengths": "fixed"}


def floor_ms(wbytes: int, lm, batch: int, prompt_len: int, gen_len: int, copy_gbps: float) -> float:
    cfg = lm.config
    kv_tok = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 2
    avg_len = prompt_len + gen_len / 2
    return (wbytes + batch * kv_tok * avg_len) / (copy_gbps * 1e9) * 1e3


def run_one(model, lm, tok, engine: str, batch: int, prompt_len: int, gen_len: int, lengths=None,
            group_size: int = 1) -> dict:
    """One row: ``batch`` sequences (``batch / group_size`` prompts × ``group_size`` samples) of ``gen_len``
    tokens, or each stopped at its drawn length (``lengths``, a :class:`qerl.bench.lengths.Lengths`; the
    engine only)."""
    from qerl.bench.lengths import summary
    from qerl.rollout import SamplingSettings, sampler
    from qerl.rollout.engine import engine_for
    from qerl.rollout.engine.runner import PDL_CHAIN
    from qerl_kernels import ops

    if batch % group_size:
        raise ValueError(f"batch {batch}: not a multiple of --group-size {group_size}")
    ps = prompts(batch // group_size, prompt_len, lm.config.vocab_size)
    s = SamplingSettings(temperature=1.0, max_new_tokens=gen_len)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    note = ""
    if engine == "qerl":
        eos_at = None if lengths is None or lengths.fixed else lengths.draw(batch, gen_len)
        eng = engine_for(model, tok)
        eng.generate(ps, SamplingSettings(temperature=1.0, max_new_tokens=2), num_samples=group_size)  # compile
        torch.cuda.reset_peak_memory_stats()
        r = eng.generate(ps, s, num_samples=group_size, eos_at=eos_at)
        st = eng.last_stats
        secs, steps = st["prefill_s"] + st["decode_s"], max(1, st["decode_steps"])
        ms_step = 1e3 * st["decode_s"] / steps
        note = f"capture {st['capture_s']:.1f} s excluded; {st['rows']} rows on {st['slots']} KV slots"
        if not PDL_CHAIN[0]:
            note += "; launch chain off"
        if not ops.TRANSFER:
            note += "; untuned shapes on the heuristic"
        if "layout_s" in st:  # weight_layout="tiled": the in-place reorder and its undo, also excluded
            note += (f"; tiled weights ({st['tiled_projs']} of {len(eng.view.projs)} projections, reorder "
                     f"{st['layout_s']:.2f} s excluded)")
        if eos_at is not None:
            tokens = int(r.completion_mask.sum())
            note += (f"; lengths {summary(r.lengths.tolist(), gen_len)}; {steps} decode steps, "
                     f"{st['admitted_later']} rows admitted into freed slots")
            return {"tok_s": tokens / secs, "ms_per_step": ms_step, "gen_len": gen_len,
                    "peak_gb": torch.cuda.max_memory_allocated() / 1e9, "note": note}
    elif engine == "reference":
        sampler.generate(model, tok, ps[:1], SamplingSettings(max_new_tokens=2))
        t0 = time.perf_counter()
        sampler.generate(model, tok, ps, s)
        torch.cuda.synchronize()
        secs = time.perf_counter() - t0
        ms_step = 1e3 * secs / gen_len
    else:  # transformers generate on the same (PEFT) model, sampling, EOS never reached
        enc = tok(ps)
        ids, mask = enc.input_ids.cuda(), enc.attention_mask.cuda()
        kw = dict(do_sample=True, temperature=1.0, top_p=1.0, top_k=0, pad_token_id=0, eos_token_id=None)
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, min_new_tokens=2, **kw)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=gen_len, min_new_tokens=gen_len, **kw)
        torch.cuda.synchronize()
        secs = time.perf_counter() - t0
        gen_len = out.shape[1] - ids.shape[1]
        ms_step = 1e3 * secs / gen_len
    return {"tok_s": batch * gen_len / secs, "ms_per_step": ms_step, "gen_len": gen_len,
            "peak_gb": torch.cuda.max_memory_allocated() / 1e9, "note": note}


def _replays(b, pos: int, n: int = 10) -> list[float]:
    """Milliseconds of ``n`` replays of bucket ``b``'s captured decode step at position ``pos``."""
    full = []
    for _ in range(n):
        a, z = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        b.col.zero_()
        b.pos.fill_(pos)
        a.record()
        b.graph.replay()
        z.record()
        torch.cuda.synchronize()
        full.append(a.elapsed_time(z))
    return full


def _captured(eng, batch: int):
    """The engine's bucket of ``batch`` rows whose decode step is captured (after a rollout at that batch)."""
    return next(bb for key, bb in eng._buckets.items() if key[0] == batch and bb.graph is not None)


def step_split(eng, batch: int, prompt_len: int, gen_len: int) -> dict:
    """Milliseconds of one decode step's parts at ``batch`` rows, each timed as its own CUDA graph: all
    projections (base + LoRA), all attention calls (KV at the average length), lm_head + sampling; ``other``
    = the captured full step minus those (norms, rotary, residuals, cache writes, embedding)."""
    from qerl.rollout import SamplingSettings
    from qerl.rollout.engine import forward as fw
    from qerl.bench.timing import graph_times as _graph_times

    v, dev = eng.view, eng.device
    inter = v.layers[0].down.module.in_features if hasattr(v.layers[0].down.module, "in_features") else None
    x = torch.randn(batch, v.hidden, device=dev, dtype=v.dtype)
    xa = torch.randn(batch, v.heads * v.head_dim, device=dev, dtype=v.dtype)
    xi = torch.randn(batch, inter, device=dev, dtype=v.dtype)
    q = torch.randn(batch, v.heads, v.head_dim, device=dev, dtype=v.dtype)
    slot = torch.arange(batch, device=dev) % (eng.kc[0].shape[0] - 1)
    lengths = torch.full((batch,), prompt_len + gen_len // 2, device=dev)
    seed, step = torch.arange(batch, device=dev), torch.zeros((), dtype=torch.long, device=dev)
    s = SamplingSettings(temperature=1.0)
    from qerl.rollout.engine.forward import _qkv

    projs = [lambda L=L: (_qkv(L, x), L.o(xa), L.gate_up(x) if L.gate_up else (L.gate(x), L.up(x)), L.down(xi))
             for L in v.layers]
    attn = [lambda i=i: eng.attention(q, eng.kc[i], eng.vc[i], slot, lengths, v.head_dim ** -0.5)
            for i in range(len(v.layers))]
    head = [lambda: eng.sample(fw._head(v, fw.norm(v.final_norm, x, False)), s, seed, step)]
    b = _captured(eng, batch)
    b.pos.fill_(prompt_len + gen_len // 2)
    b.slot.copy_(slot)
    from qerl.rollout.engine.runner import _launch_mode

    with eng.weights_in_layout(batch), _launch_mode("graph"):  # (tiled: the layout the step's graphs were captured on)
        t = _graph_times({"projections": projs, "attention": attn, "head_sampling": head}, reps=10)
        full = _replays(b, prompt_len + gen_len // 2)
    n = {"projections": len(projs), "attention": len(attn), "head_sampling": 1}  # _graph_times: time per call
    out = {k: 1e3 * val * n[k] for k, val in t.items()}
    out["step"] = sorted(full)[len(full) // 2]
    out["other"] = out["step"] - out["projections"] - out["attention"] - out["head_sampling"]
    return {k: round(val, 3) for k, val in out.items()}


def step_trace(eng, batch: int, prompt_len: int, gen_len: int) -> tuple[dict, list[dict]]:
    """One replay of the captured decode step at ``batch`` rows (KV at the average length), kernel by kernel
    (:mod:`qerl.bench.trace`): ``({part: ms, gaps, step, kernels, replay}, the kernels by name)`` — ``replay``: the
    same replay's milliseconds without the profiler (median of 10)."""
    from qerl.bench import trace

    b = _captured(eng, batch)

    def reset():  # each replay writes the same generation columns of the dummy slot (as _replays)
        b.col.zero_()
        b.pos.fill_(prompt_len + gen_len // 2)

    with eng.weights_in_layout(batch):
        ks = trace.trace_kernels(b.graph.replay, setup=reset)
        plain = _replays(b, prompt_len + gen_len // 2)
    sp = trace.split(ks)
    sp["replay"] = round(sorted(plain)[len(plain) // 2], 4)  # the same replay without the profiler (median)
    return sp, trace.by_name(ks, top=12)


def write_traces(traces: list[tuple[dict, dict, list[dict]]], out: Path, device: str) -> Path:
    """``<device>_trace.md``: per traced row, the step split of one replay and its longest kernels."""
    lines = [f"# Decode step kernel timelines on {device}", "",
             "One CUDA-graph replay of the engine's decode step (KV at the average length), traced with "
             "torch.profiler (qerl.bench.trace): each moment of the step goes to the earliest-started kernel still "
             "running (the one the programmatic dependents started under it wait for), or to gaps when none runs. "
             "`replay` is the same replay timed without the profiler (median of 10): the profiler's per-kernel records lengthen the traced step, almost all of it as gaps, so the parts "
             "are the measurement and `replay` minus their sum bounds the real gaps. In the launch chain "
             "(qerl_kernels.launch.chain) a kernel starts under the one before it and waits for it, so the per-kernel "
             "totals below include that wait: they are not the kernels' own time (the split above is).", ""]
    for row, sp, top in traces:
        lines += [f"## {row['model']} {row['base']} batch {row['batch']} (prompt {row['prompt_len']}, "
                  f"gen {row['gen_len']})", "",
                  "| " + " | ".join(sp) + " |", "|" + "---|" * len(sp), "| " + " | ".join(str(v) for v in sp.values())
                  + " |", "", "| kernel | part | calls | total µs | mean µs |", "|---|---|---|---|---|"]
        lines += [f"| `{k['name'][:90]}` | {k['part']} | {k['calls']} | {k['total_us']} | {k['mean_us']} |"
                  for k in top]
        lines.append("")
    path = out / (device.replace(" ", "_") + "_trace.md")
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, "\n".join(lines))
    return path


def _release(model) -> None:
    from qerl.rollout.engine import drop_engine

    eng = drop_engine(model)
    if eng is not None:
        eng.release()
    gc.collect()
    torch.cuda.empty_cache()


def bench(args) -> list[dict]:
    from qerl.lora import LoraSettings, apply_lora
    from qerl.rollout.engine import cached_engine
    from qerl.bench.timing import copy_bandwidth
    from qerl.models.random import build, nf4_available, weight_bytes

    device = torch.cuda.get_device_name()
    bw = copy_bandwidth()
    print(json.dumps({"device": device, "copy_GBps": round(bw)}), flush=True)
    tok = CountTokenizer()
    rows, traces = [], []
    for m in args.models:
        for base in args.bases:
            if base == "nf4" and not nf4_available():
                continue
            lm = build(m, base)
            model = apply_lora(lm, LoraSettings(r=32, alpha=32))
            g = torch.Generator(device="cuda").manual_seed(1)
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.data.copy_(torch.randn(p.shape, device="cuda", generator=g) * 0.01)
            wb = weight_bytes(model)
            for engine in args.engines:
                slow = engine != "qerl"
                if slow:  # the engine's KV cache and graphs go first: the slow rows' peak_gb is theirs alone
                    _release(model)
                for batch, spec in ([(b, None) for b in args.slow_batches] if slow else
                                    [(b, sp) for sp in args.lengths for b in args.batches]):
                    gen = args.slow_gen_len if slow else args.gen_len
                    group = 1 if slow else args.group_size
                    row = {"device": device, "model": m, "base": base, "engine": engine, "batch": batch,
                           "group_size": group, "lengths": str(spec) if spec is not None else "fixed",
                           "prompt_len": args.prompt_len}
                    try:
                        r = run_one(model, lm, tok, engine, batch, args.prompt_len, gen, spec, group)
                    except torch.cuda.OutOfMemoryError as e:
                        r = {"tok_s": float("nan"), "ms_per_step": float("nan"), "gen_len": gen, "peak_gb": float("nan"),
                             "note": f"OOM: {str(e).splitlines()[0][:120]}"}
                        torch.cuda.empty_cache()
                    if slow:
                        r["note"] = (r["note"] + f"; {gen} generated tokens").lstrip("; ")
                    fixed = spec is None or spec.fixed
                    if engine == "qerl" and fixed and batch in args.split_batches and r["tok_s"] == r["tok_s"]:
                        sp = step_split(cached_engine(model), batch, args.prompt_len, gen)
                        r["note"] += "; step split ms: " + ", ".join(f"{k} {val}" for k, val in sp.items())
                    if engine == "qerl" and fixed and batch in args.trace_batches and r["tok_s"] == r["tok_s"]:
                        sp, top = step_trace(cached_engine(model), batch, args.prompt_len, gen)
                        r["note"] += "; trace ms: " + ", ".join(f"{k} {val}" for k, val in sp.items())
                        traces.append(({**row, "gen_len": r["gen_len"]}, sp, top))
                        write_traces(traces, Path(args.output), device)
                    fl = floor_ms(wb, lm, batch, args.prompt_len, r["gen_len"], bw) if fixed else float("nan")
                    row.update(r, floor_ms=fl, frac_of_floor=r["ms_per_step"] / fl)
                    rows.append(row)
                    print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)
                    write(rows, Path(args.output), device, bw)
            _release(model)
            del model, lm
            gc.collect()
            torch.cuda.empty_cache()
    return rows


def write(rows: list[dict], out: Path, device: str, copy_gbps: float) -> Path:
    """CSV + Markdown (+ PNG when matplotlib imports), written atomically."""
    out.mkdir(parents=True, exist_ok=True)
    stem = out / device.replace(" ", "_")
    with atomic_open(stem.with_suffix(".csv"), newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        for r in rows:
            w.writerow({k: (round(v, 4) if isinstance(v, float) else v)
                        for k, v in ((k, r.get(k, DEFAULTS.get(k))) for k in COLUMNS)})
    lines = [f"# Rollout throughput on {device}", "",
             f"Copy bandwidth {copy_gbps:.0f} GB/s; LoRA rank 32 on all seven projections; EOS never sampled: "
             "`lengths` fixed = every row generates `gen` tokens, else each row stops at a seeded drawn length "
             "(qerl.bench.lengths); `group` = samples per prompt. "
             "`tok_s` = generated tokens / (prefill + decode) seconds (graph capture excluded, see note).", "",
             "| model | base | engine | batch | group | lengths | prompt | gen | tok/s | ms/step | floor ms | × floor | "
             "peak GB | note |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['base']} | {r['engine']} | {r['batch']} | "
                     f"{r.get('group_size', 1)} | {r.get('lengths', 'fixed')} | {r['prompt_len']} | {r['gen_len']} | "
                     f"{r['tok_s']:.0f} | {r['ms_per_step']:.2f} | {_num(r['floor_ms'])} | {_num(r['frac_of_floor'])} | "
                     f"{r['peak_gb']:.1f} | {r['note']} |")
    write_text_atomic(stem.with_suffix(".md"), "\n".join(lines) + "\n")
    plot(rows, stem.with_suffix(".png"), device)
    return stem.with_suffix(".csv")


def plot(rows: list[dict], path: Path, device: str) -> Path | None:
    """tok/s vs batch, one panel per base, a line per (model, engine)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    bases = sorted({r["base"] for r in rows})
    fig, axes = plt.subplots(1, len(bases), figsize=(5 * len(bases), 4), squeeze=False)
    for ax, base in zip(axes[0], bases):
        for key in sorted({(r["model"], r["engine"], _variant(r)) for r in rows if r["base"] == base}):
            pts = sorted((r["batch"], r["tok_s"]) for r in rows
                         if r["base"] == base and (r["model"], r["engine"], _variant(r)) == key)
            ax.plot(*zip(*pts), marker="o", ls="-" if not key[2] else "--", label=" ".join(filter(None, key)))
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch (sequences)")
        ax.set_ylabel("generated tokens / s")
        ax.set_title(f"{base} + LoRA-32")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"Rollout throughput, {device}")
    fig.tight_layout()
    from qerl.figures import save_figure

    return save_figure(fig, path)


def _num(v) -> str:
    return "—" if v != v else f"{v:.2f}"  # NaN: not computed (floor: fixed lengths only)


def _variant(r: dict) -> str:
    """A row's completion shape for labels: '' (fixed lengths, one sample per prompt) or e.g. 'G16 lognormal'."""
    g, lens = int(r.get("group_size") or 1), str(r.get("lengths") or "fixed")
    return " ".join(filter(None, [f"G{g}" if g > 1 else "", lens.split(":")[0] if lens != "fixed" else ""]))


def read(path: Path) -> list[dict]:
    """Rows of a written CSV with their numeric columns typed (files written before the ``group_size`` /
    ``lengths`` columns read as one sample per prompt, fixed lengths)."""
    ints, floats = ("batch", "prompt_len", "gen_len", "group_size"), ("tok_s", "ms_per_step", "floor_ms",
                                                                      "frac_of_floor", "peak_gb")
    with open(path) as f:
        rows = list(csv.DictReader(f))
    if not rows or set(COLUMNS) - set(DEFAULTS) - set(rows[0]):
        raise ValueError(f"{path}: not a `qerl bench rollout` CSV (expected columns {', '.join(COLUMNS)})")
    rows = [{**DEFAULTS, **{k: v for k, v in r.items() if v not in (None, "") or k not in DEFAULTS}} for r in rows]
    return [{**r, **{k: int(r[k]) for k in ints}, **{k: float(r[k]) for k in floats}} for r in rows]


def _merge_rows(paths) -> tuple[dict, set]:
    rows: dict = {}
    devices = set()
    for path in paths:
        for r in read(path):
            devices.add(r["device"])
            rows[(r["model"], r["base"], r["engine"], r["batch"], r["group_size"], r["lengths"])] = r
    return rows, devices


def merge(paths: list[Path], out: Path) -> Path:
    """One file set from several runs on one device (e.g. 7B, then 14B + 32B in a second process), merged into the
    one already at ``out`` for that device (its rows stay unless a given file has the same key): a later file's row
    replaces an earlier one with the same (model, base, engine, batch, group size, lengths)."""
    rows, devices = _merge_rows(paths)
    if len(devices) != 1:
        raise ValueError(f"--merge: the CSVs come from different devices {sorted(devices)}; merge one device's runs")
    existing = existing_csv(out, next(iter(devices)), paths)
    if existing is not None:
        rows = {**_merge_rows([existing])[0], **rows}
    order = {"7B": 0, "14B": 1, "32B": 2}
    merged = sorted(rows.values(), key=lambda r: (r["base"] != "nvfp4", order.get(r["model"], 9), r["engine"],
                                                  r["lengths"] != "fixed", r["lengths"], r["group_size"], r["batch"]))
    device = devices.pop()
    m = re.search(r"Copy bandwidth (\d+) GB/s", (paths[-1].with_suffix(".md")).read_text()) \
        if paths[-1].with_suffix(".md").exists() else None
    return write(merged, out, device, float(m.group(1)) if m else float("nan"))


def build_parser() -> argparse.ArgumentParser:
    from qerl.argtypes import HelpFormatter
    from qerl.bench.lengths import argtype as lengths_arg

    p = argparse.ArgumentParser(prog="qerl bench rollout", description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--output", default="reports/rollout", help="directory of the <device>.csv / .md / .png set")
    p.add_argument("--models", nargs="+", default=["7B", "14B", "32B"], type=model_arg, metavar="MODEL",
                   help="shapes of the random-weight models (built as Qwen2 models of those sizes): " + MODELS_HELP)
    p.add_argument("--bases", nargs="+", default=["bf16", "nvfp4", "nf4"], choices=["bf16", "nvfp4", "nf4"],
                   help="base formats")
    p.add_argument("--engines", nargs="+", default=["qerl", "reference", "transformers"],
                   choices=["qerl", "reference", "transformers"], help="generators to time")
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8, 64, 256], help="sequences per rollout")
    p.add_argument("--slow-batches", nargs="+", type=int, default=[8], help="batches of the reference / transformers")
    p.add_argument("--prompt-len", type=int, default=256, help="prompt tokens")
    p.add_argument("--gen-len", type=int, default=1024, help="generated tokens of the engine")
    p.add_argument("--slow-gen-len", type=int, default=64, help="generated tokens of the reference / transformers")
    p.add_argument("--lengths", nargs="+", type=lengths_arg, default=None, metavar="SPEC",
                   help="completion lengths of the engine rows: fixed | lognormal:median=M,sigma=S | "
                        "uniform:low=A,high=B (each row stopped at a seeded drawn length; one set of rows per spec)")
    p.add_argument("--group-size", type=int, default=1,
                   help="samples per prompt of the engine rows (GRPO-shaped: batch / G prompts x G samples)")
    p.add_argument("--weight-layout", default="auto", choices=["auto", "rows", "tiled"],
                   help="the engine's NVFP4 weight layout during generation: rows (the checkpoint's), tiled "
                        "(reordered in place into the tile-contiguous layout and back around each generation) or "
                        "auto (the engine's default: on CUDA, tiled where the decode batch's config reads the layout "
                        "as tuned)")
    p.add_argument("--pdl-chain", default="on", choices=["on", "off"],
                   help="the decode step's launch chain (qerl_kernels.launch.chain) and the norm / SiLU-gate kernels "
                        "it needs (on, the engine's default) or the torch.compile'd norms and plain launches (off)")
    p.add_argument("--untuned", choices=["transfer", "heuristic"], default="transfer",
                   help="kernel configs of projections without tuned entries: borrowed from the nearest tuned shape "
                        "(the default) or the heuristic (the comparison; said in the row's note)")
    p.add_argument("--split-batches", nargs="*", type=int, default=[8], help="batches whose step is split into parts")
    p.add_argument("--trace-batches", nargs="*", type=int, default=[8],
                   help="batches whose decode step is traced kernel by kernel (one graph replay; the split with gaps "
                        "goes to the note, the longest kernels to <device>_trace.md)")
    p.add_argument("--plot", metavar="CSV", help="only redraw the figure of a written CSV (no GPU)")
    p.add_argument("--merge", nargs="+", metavar="CSV", type=Path,
                   help="only merge runs of one device into --output's file set (later files win; no GPU)")
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    if a.lengths is None:
        from qerl.bench.lengths import Lengths

        a.lengths = [Lengths()]  # fixed
    bad = [b for b in a.batches if b % a.group_size]
    if a.group_size < 1 or bad:
        raise SystemExit(f"--group-size {a.group_size}: must be >= 1 and divide every batch (not {bad})")
    if a.merge:
        print(merge(a.merge, Path(a.output)))
        return 0
    if a.plot:
        with open(a.plot) as f:
            rows = [{**r, "batch": int(r["batch"]), "tok_s": float(r["tok_s"])} for r in csv.DictReader(f)]
        print(plot(rows, Path(a.plot).with_suffix(".png"), rows[0]["device"]))
        return 0
    if not torch.cuda.is_available():
        raise SystemExit("qerl bench rollout needs a CUDA GPU (use --plot CSV to redraw a figure)")
    from qerl.rollout.engine import forward, runner

    from qerl_kernels import ops

    ops.TRANSFER = a.untuned == "transfer"
    runner.WEIGHT_LAYOUT[0] = a.weight_layout
    runner.PDL_CHAIN[0] = forward.NORM_KERNELS[0] = a.pdl_chain == "on"
    bench(a)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
