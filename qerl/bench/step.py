"""``qerl bench step``: full GRPO steps (rollout + old log-probs + update) of bf16 LoRA, QLoRA and QeRL.

Random-weight Qwen2.5 7B / 14B / 32B shapes built on the GPU layer by layer (:mod:`qerl.models.random`),
LoRA rank 32 on the seven projections. One step, as ``qerl train`` runs it (:mod:`qerl.train.loop`):

1. **rollout** — ``batch`` sequences of ``prompt_len`` random tokens, ``gen_len`` sampled tokens each (EOS never
   sampled; with ``--lengths SPEC`` each row stops at a seeded drawn length as if it sampled EOS there, the same
   global rows on any number of ranks — so slot refill, compaction and the ranks' unequal shares are measured) through :func:`qerl.rollout.generate` (the engine on CUDA); QeRL with AQN noise (σ = 0.01) written
   into the norms for the rollout; the engine's KV cache is then released (``rollout.release_cache``);
2. **logprob** and 3. **update** — the trainer's own update phase (:func:`qerl.train.update.update_policy`): the
   old policy's teacher-forced log-probs (no grad, micro-batches), then GRPO on random rewards in groups of 16
   (:func:`_bench_config`), backward per micro-batch (gradient checkpointing as configured), gradient clipping,
   one AdamW step (bitsandbytes 8-bit when importable, else torch AdamW).

Each configuration runs a warm-up step (``--warmup-gen`` sampled tokens, the completions padded with random
tokens to the measured length, so its update compiles and tunes for the same shapes; with ``--lengths`` a whole step
with the measured step's lengths, whose rows leave the batch at the same steps), then the measured step (which
captures its own decode graphs, as every training step does once the cache is released). Peak memory = ``torch.cuda.max_memory_allocated`` over the measured step. On a card larger than
``--cap-gb`` the process is capped there (``torch.cuda.set_per_process_memory_fraction``), so an H200 answers
"does it fit in 80 GB". An OOM is a row with ``status = oom``.

``--nproc N`` (N GPUs of one machine; relaunches itself under torchrun, NCCL): data parallel as ``qerl train
--nproc`` runs it — each rank generates ``batch / N`` sequences with its own engine, the rollouts are gathered, each
rank computes its share's log-probs and runs its micro-batches through DDP (one gradient all-reduce), then every
rank steps; ``rollout_s`` is the
slowest rank's, ``rank_idle_s`` how long the fastest rank waited for it. Rows of 1 and N GPUs give the scaling
table of the Markdown (:func:`scaling_lines`: against one GPU at the same batch per step and at the same batch per
GPU, and the idle share).

Columns: ``device, model, method, batch, prompt_len, gen_len, lengths (``fixed``, or the ``--lengths`` spec each
row's completion was stopped at: :mod:`qerl.bench.lengths`), nproc, status, rollout_s, logprob_s, update_s,
total_s, tokens_per_s, peak_gb, rank_idle_s, checkpointing, micro_batch, engine_cache (released | kept between
steps, ``--keep-cache``), optimizer_states (gpu | parked in host memory during the rollout, ``--offload``: the park
is timed in the rollout phase and the restore in the logprob phase, as ``qerl train`` runs them), optimizer,
samples_per_prompt (1: a distinct prompt per sequence; G with ``--grpo-shaped``: ``batch / G`` prompts x G samples,
which the engine prefills once per prompt), dense_update (``--dense-update``: the NVFP4 base dequantized once per
update phase, config ``dense_update``), prefill_s / capture_s / host_s (the engine's split of ``rollout_s``:
prompts prefilled, decode graphs captured, GPU idle during the host's checks for finished rows), fused_update,
packed_update, micro_tokens (``--micro-tokens``: the update's micro-batches cut by this many tokens, config
``micro_batch_tokens``; empty: ``micro_batch`` rows each), note``. Writes ``<device>.csv / .md`` under
``--output``; the Markdown puts the paper's numbers (Tables 3, 5–8) beside ours.
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import gc
import json
import sys
import time
from pathlib import Path

import torch

from qerl.bench.report import existing_csv
from qerl.models.shapes import SHAPES

from qerl.rollout.engine.runner import SPLIT as ENGINE_SPLIT  # the engine's split of rollout_s (prefill_s, ...)
from qerl.files import atomic_open, write_text_atomic

COLUMNS = ["device", "model", "method", "batch", "prompt_len", "gen_len", "lengths", "nproc", "status", "rollout_s", "logprob_s",
           "update_s", "total_s", "tokens_per_s", "peak_gb", "rank_idle_s", "checkpointing", "micro_batch",
           "engine_cache", "optimizer_states", "optimizer", "samples_per_prompt", "dense_update", "prefill_s",
           "capture_s", "host_s", "fused_update", "packed_update", "micro_tokens", "note"]
BASE = {"lora": "bf16", "qlora": "nf4", "qerl": "nvfp4", "full": "bf16"}  # full: every weight trained
#: the paper's one-H100 efficiency numbers (docs/paper.md): rollout tok/s at batch 8 / 2, weight GB, step s.
PAPER = {
    ("7B", "lora"): "rollout 1,641 tok/s (b8), 115 (b2); weights 15.2 GB", ("7B", "qlora"): "rollout 1,362 tok/s (b8); 5.7 GB",
    ("7B", "qerl"): "rollout 2,092 tok/s (b8), 152 (b2); 5.9 GB; step ×1.2–1.5 vs LoRA",
    ("14B", "lora"): "rollout 737 tok/s (b8), 65 (b2); 29.6 GB", ("14B", "qlora"): "rollout 45 tok/s (b2); 10.2 GB",
    ("14B", "qerl"): "rollout 1,091 tok/s (b8), 95 (b2); 10.6 GB; step ×1.2–1.4 vs LoRA",
    ("32B", "lora"): "OOM on one H100; 62.3 GB", ("32B", "qlora"): "rollout 25 tok/s (b2)",
    ("32B", "qerl"): "10.6 s/step (b2), 12.2 s/step (b8); rollout 688 tok/s (b8); 20.7 GB",
}


def cap_memory(cap_gb: float) -> float | None:
    """Cap this process at ``cap_gb`` GB on a larger card; returns the fraction set (None: card ≤ cap)."""
    total = torch.cuda.get_device_properties(0).total_memory
    if total <= cap_gb * 1e9 * 1.01:
        return None
    frac = cap_gb * 1e9 / total
    torch.cuda.set_per_process_memory_fraction(frac)
    return frac


def _sync_time() -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter()


PACKED = ["auto"]  # config packed_sequences of the measured steps (--packed-sequences)
TOKENS = [False]  # config micro_batch_tokens of the measured steps (--micro-tokens, resolved per configuration)


def _bench_config(batch: int, world: int, gen_len: int, micro: int, dense: bool = False):
    """The :class:`~qerl.train.config.TrainConfig` the trainer would run this step with: GRPO, groups of 16 (or the
    largest of 8, 4, 2 that gives every rank whole groups), temperature 1, ``gen_len`` new tokens, AQN on the
    rollout only (the default ``apply_to``), gradient clip 1."""
    from qerl.train.config import AlgorithmConfig, TrainConfig
    from qerl.rollout import SamplingSettings

    G = next((g for g in (16, 8, 4, 2) if batch % (g * world) == 0), None)
    if G is None:
        raise ValueError(f"batch {batch}: must be a multiple of 2 x {world} process(es) (whole GRPO groups per rank)")
    a = AlgorithmConfig(name="grpo", group_size=G).resolved()
    return TrainConfig(micro_batch_size=micro, prompts_per_step=batch // G, algorithm=a, dense_update=dense,
                       packed_sequences=PACKED[0], micro_batch_tokens=TOKENS[0],
                       rollout=SamplingSettings(temperature=1.0, max_new_tokens=gen_len))


class _Phases:
    """``phase(name)`` contexts for :func:`qerl.train.update.update_policy`: CUDA-synchronised seconds of each
    phase and a ``torch.profiler`` range ``step:<name>``."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str):
        from torch.profiler import record_function

        t0 = _sync_time()
        with record_function(f"step:{name}"):
            yield
        self.seconds[name] = self.seconds.get(name, 0.0) + _sync_time() - t0


def one_step(policy, tok, aqn, batch: int, prompt_len: int, gen_len: int, micro: int, optimizer, seed: int,
             pad_to: int | None = None, prof=None, d=None, scorer=None, keep_cache: bool = False,
             parking=None, lengths=None, grouped: bool = False, dense: bool = False) -> dict:
    """One GRPO step: a rollout of ``batch`` random prompts (this rank's share), then the trainer's own update
    phase (:func:`qerl.train.update.update_policy`: old log-probs, one optimizer step over micro-batches of
    ``micro``) on the gathered batch with random rewards. Returns the seconds of the three phases
    (CUDA-synchronised, each a ``torch.profiler`` range ``step:<phase>``) and the generated tokens. ``pad_to``:
    extend the completions with random tokens to that length before the update (a warm-up step whose update has
    the measured step's shapes, cheaply). ``prof``: a ``torch.profiler.profile`` started for the logprob and update
    phases only. ``d`` / ``scorer``: this rank of a data-parallel step (``batch`` is the global batch) and the
    DDP-wrapped :class:`~qerl.train.update.LogprobModule`; the phases are then the slowest rank's,
    ``rank_idle_s`` the fastest rank's wait at the end of the rollout (each rank's generation time, taken before
    the gather that synchronises them). ``keep_cache``: keep the engine's KV cache
    and graphs for the next step (``rollout.release_cache: false``). ``parking``: a
    :class:`~qerl.train.offload.StateOffload` — the optimizer states leave the GPU before the rollout and come back
    before the log-probs (``offload_s``, ``parked_gb``; ``rollout_peak_gb``: the rollout phase's peak).
    ``lengths``: a :class:`qerl.bench.lengths.Lengths` — each row stops at its drawn length (global rows, seeded by
    ``seed``)."""
    from torch.profiler import record_function

    from qerl.models.random import prompts
    from qerl.rollout import generate
    from qerl.rollout.engine import cached_engine, release_engine
    from qerl.train import dist
    from qerl.train.steps import merge, rollout_to
    from qerl.train.update import LogprobModule, update_policy

    d = d or dist.Dist()
    scorer = scorer if scorer is not None else LogprobModule(policy)
    cfg = _bench_config(batch, d.world, gen_len, micro, dense)
    mine = batch // d.world  # this rank's sequences
    G = cfg.algorithm.group_size if grouped else 1  # GRPO-shaped: mine / G prompts x G samples each
    ps = prompts(mine // G, prompt_len, policy.config.vocab_size, seed=seed * 1000 + d.rank)
    t0 = _sync_time()
    policy.eval()
    parked = parking.park() if parking is not None else 0
    if parked and torch.cuda.is_available():  # the rollout phase's own peak, without the states just parked (the
        torch.cuda.reset_peak_memory_stats()  # step's peak stays the update's: weights + states + gradients + ...)
    with record_function("step:rollout"), (aqn.noise(0.01, seed) if aqn is not None else contextlib.nullcontext()):
        eos_at = None if lengths is None or lengths.fixed else lengths.draw(mine, gen_len, seed, d.rank * mine)
        r = generate(policy, tok, ps, cfg.rollout, seed=seed, num_samples=G, first_row=d.rank * mine, eos_at=eos_at)
        eng = cached_engine(policy)
        split = {k: eng.last_stats.get(k, 0.0) for k in ENGINE_SPLIT} if eng is not None else {}
        if not keep_cache:
            release_engine(policy)
    t_gen = _sync_time()  # this rank's own rollout, before the gather makes every rank wait for the slowest
    rollout_peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0
    if pad_to is not None and pad_to > gen_len:
        extra = torch.randint(100, policy.config.vocab_size - 100, (mine, pad_to - gen_len), device=r.completion_ids.device)
        r.completion_ids = torch.cat([r.completion_ids, extra], 1)
        r.completion_mask = torch.cat([r.completion_mask, torch.ones_like(extra)], 1)
        r.logprobs = torch.cat([r.logprobs, torch.zeros(extra.shape, device=extra.device)], 1)
    tokens = int(r.completion_mask.sum())
    if d.on:  # every rank continues on the whole batch, as the trainer's rollout gather leaves it
        device = r.completion_ids.device
        r = merge([rollout_to(p, device) for p in dist.gather(d, rollout_to(r, "cpu"), "gathering the rollouts")],
                  tok.pad_token_id)
    t1 = _sync_time()
    if prof is not None:
        prof.start()
    rewards = torch.randn(batch, generator=torch.Generator(device="cpu").manual_seed(seed))
    if parking is not None:
        parking.restore()
    phases = _Phases()
    update_policy(policy, scorer, r, rewards, cfg, aqn, 0.0, 0, optimizer, d, phase=phases)
    t3 = _sync_time()
    if prof is not None:
        prof.stop()
    st = {"rollout_s": t1 - t0, "logprob_s": phases.seconds["logprob"], "update_s": phases.seconds["update"],
          "total_s": t3 - t0, "tokens": tokens, "gen_s": t_gen - t0, **split}
    if parking is not None:
        st.update(offload_s=parking.seconds, parked_gb=parked / 1e9, rollout_peak_gb=rollout_peak / 1e9)
    if not d.on:
        st.pop("gen_s")
        return {**st, "rank_idle_s": 0.0}
    parts = dist.gather(d, st, "timing the step")
    gen = [p["gen_s"] for p in parts]
    return {"rollout_s": max(p["rollout_s"] for p in parts), "logprob_s": max(p["logprob_s"] for p in parts),
            "update_s": max(p["update_s"] for p in parts), "total_s": max(p["total_s"] for p in parts),
            "tokens": sum(p["tokens"] for p in parts), "rank_idle_s": max(gen) - min(gen),
            **{k: max(p.get(k, 0.0) for p in parts) for k in ENGINE_SPLIT if k in st}}


def _optimizer(params, lr: float = 1e-5):
    try:
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit(params, lr=lr), "adamw8bit"
    except ImportError:
        return torch.optim.AdamW(params, lr=lr, fused=True), "adamw (fp32 states; bitsandbytes not importable)"


def _profile(policy, tok, aqn, batch, prompt_len, gen_len, micro, opt, out: Path, name: str, lengths=None,
             grouped: bool = False, dense: bool = False) -> Path:
    """One more step with its logprob and update phases under ``torch.profiler`` (the rollout is split in
    ``reports/rollout``): the ops by total CUDA time and by CPU time, and the ops with their input shapes by their
    own CUDA time (which sizes the elementwise kernels run on), as text."""
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True)
    st = one_step(policy, tok, aqn, batch, prompt_len, gen_len, micro, opt, seed=3, prof=prof, lengths=lengths,
                  grouped=grouped, dense=dense)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"profile_{name}.txt"
    ka = prof.key_averages()
    phases = {e.key: (e.cpu_time_total / 1e3, e.device_time_total / 1e3) for e in ka if e.key.startswith("step:")}
    split = "\n".join(f"{k}: host {c:.1f} ms, device {d:.1f} ms (device work issued inside the range)"
                      for k, (c, d) in sorted(phases.items()))
    write_text_atomic(path, f"{name}: {json.dumps({k: round(v, 3) for k, v in st.items()})}\n{split}\n\n"
                    + ka.table(sort_by="cuda_time_total", row_limit=40) + "\n\n"
                    + ka.table(sort_by="cpu_time_total", row_limit=40) + "\n\n"
                    + prof.key_averages(group_by_input_shape=True).table(sort_by="self_cuda_time_total",
                                                                          row_limit=60, max_name_column_width=60,
                                                                          max_shapes_column_width=90) + "\n")
    return path


def run_config(model: str, method: str, batches, gen_lens, prompt_len: int, micro: int, checkpointing: str,
               device: str, progress=print, warmup_gen: int = 16, profile: Path | None = None, d=None,
               keep_cache: bool = False, offload: bool = False, lengths=None, grouped: bool = False,
               dense: bool = False) -> list[dict]:
    """Every (batch, gen_len) of one (model, method): the model is built once; each configuration runs a
    ``warmup_gen``-token step first (compilation, autotuning), then the measured step; ``profile``: one
    profiled step of the first configuration written there; ``lengths``: the measured step's completion lengths
    (:mod:`qerl.bench.lengths`; the warm-up's stay fixed, padded to ``gen_len``)."""
    profiled: list = []
    from qerl.lora import LoraSettings, apply_lora
    from qerl.rl.aqn import AQN, AQNSettings
    from qerl.rollout.engine import release_engine
    from qerl.models.random import build
    from qerl.models.random import CountTokenizer
    from qerl.train import dist
    from qerl.train.plan import resolve_checkpointing
    from qerl.train.update import LogprobModule

    d = d or dist.Dist()
    rows = []
    base = {"device": device, "model": model, "method": method, "prompt_len": prompt_len, "micro_batch": micro,
            "nproc": d.world, "engine_cache": "kept" if keep_cache else "released",
            "optimizer_states": "parked" if offload else "gpu", "lengths": str(lengths) if lengths else "fixed",
            "samples_per_prompt": 1, "dense_update": dense, "fused_update": fused_on(), "packed_update": packed_on()}
    try:
        lm = build(model, BASE[method])
    except torch.cuda.OutOfMemoryError as e:
        torch.cuda.empty_cache()
        return [{**base, "batch": b, "gen_len": g, "status": "oom", "note": f"building the model: {_first(e)}"}
                for b in batches for g in gen_lens]
    policy = lm.requires_grad_(True) if method == "full" else apply_lora(lm, LoraSettings(r=32, alpha=32))
    aqn = AQN(policy, AQNSettings()) if method == "qerl" else None
    opt, opt_name = _optimizer([p for p in policy.parameters() if p.requires_grad])
    from qerl.train.offload import StateOffload

    parking = StateOffload(opt) if offload else None
    scorer = dist.wrap(LogprobModule(policy), d, torch.device("cuda", torch.cuda.current_device()))
    tok = CountTokenizer()
    for b in batches:
        for g in gen_lens:
            if b % d.world:
                raise ValueError(f"--batches {b}: not divisible by --nproc {d.world}")
            fk = {"full": True} if method == "full" else {"dense": dense}
            TOKENS[0], ckpt = micro_tokens(lm.config, BASE[method], b // d.world, g, checkpointing, fk)
            if ckpt is None:
                ckpt = resolve_checkpointing(checkpointing, lm.config, BASE[method], b // d.world, prompt_len + g,
                                             micro, **fk, update_tokens=TOKENS[0] or None)
            _set_checkpointing(policy, ckpt)
            row = {**base, "batch": b, "gen_len": g, "checkpointing": ckpt, "optimizer": opt_name,
                   "micro_tokens": TOKENS[0] or "",
                   "samples_per_prompt": _bench_config(b, d.world, g, micro).algorithm.group_size if grouped else 1}
            try:
                if lengths is None or lengths.fixed:
                    first = one_step(policy, tok, aqn, b, prompt_len, min(warmup_gen, g), micro, opt, seed=1,
                                     pad_to=g, d=d, scorer=scorer, grouped=grouped, dense=dense)
                else:  # rows finishing at other steps visit the engine's smaller batch buckets, each with its own
                    # kernels to compile: a whole warm-up step with the measured step's lengths
                    first = one_step(policy, tok, aqn, b, prompt_len, g, micro, opt, seed=2, d=d, scorer=scorer,
                                     lengths=lengths, grouped=grouped, dense=dense)
                if keep_cache:  # a step whose rollout captures the graphs the measured one replays
                    one_step(policy, tok, aqn, b, prompt_len, g, micro, opt, seed=3, d=d, scorer=scorer, keep_cache=True,
                             lengths=lengths, grouped=grouped, dense=dense)
                if parking is not None:  # the host arena is built at the first park: not in the measured step
                    parking.park(), parking.restore()
                torch.cuda.reset_peak_memory_stats()
                st = one_step(policy, tok, aqn, b, prompt_len, g, micro, opt, seed=2, d=d, scorer=scorer,
                              keep_cache=keep_cache, parking=parking, lengths=lengths, grouped=grouped, dense=dense)
                parks = {k: st.pop(k) for k in ("offload_s", "parked_gb", "rollout_peak_gb") if k in st}
                row.update(status="ok", **{k: round(v, 3) for k, v in st.items() if k != "tokens"},
                           tokens_per_s=round(st["tokens"] / st["total_s"], 1),
                           peak_gb=round(torch.cuda.max_memory_allocated() / 1e9, 2),
                           note=f"after a {warmup_gen if lengths is None or lengths.fixed else g}-token warm-up step "
                                f"of {first['total_s']:.1f} s (compilation)"
                                + ("; engine cache kept between steps (graphs replayed)" if keep_cache else "")
                                + (f"; optimizer states parked during the rollout: {parks['parked_gb']:.1f} GB "
                                   f"out and back in {parks['offload_s']:.2f} s, rollout-phase peak "
                                   f"{parks['rollout_peak_gb']:.1f} GB" if parks else ""))
                if profile is not None and not profiled:
                    profiled.append(_profile(policy, tok, aqn, b, prompt_len, g, micro, opt, profile,
                                             f"{model}_{method}_b{b}_g{g}" + ("" if lengths is None or lengths.fixed
                                                                               else f"_mb{micro}_lengths"), lengths,
                                             grouped, dense))
            except torch.cuda.OutOfMemoryError as e:
                row.update(status="oom", peak_gb=round(torch.cuda.max_memory_allocated() / 1e9, 2), note=_first(e))
            finally:
                opt.zero_grad(set_to_none=True)
                release_engine(policy)
                gc.collect()
                torch.cuda.empty_cache()
            rows.append(row)
            progress(json.dumps(row))
    del policy, lm, opt, scorer, parking
    gc.collect()
    torch.cuda.empty_cache()
    return rows


MICRO_TOKENS = [None]  # --micro-tokens: None (rows), an int, or "auto"
CAP_BYTES = [80e9]  # --cap-gb: the memory the planner sizes --micro-tokens auto for


def micro_tokens(hf_config, base: str, rows: int, gen_len: int, checkpointing: str, fk: dict):
    """``(micro_batch_tokens, checkpointing or None)`` of one configuration from ``--micro-tokens``: ``(False, None)``
    without it (rows per micro-batch; checkpointing as ``--checkpointing`` resolves it), the number given, or
    ``auto``: the memory planner's budget (:func:`qerl.train.plan.auto_micro_tokens`) without gradient checkpointing
    where one longest sequence fits (``--checkpointing auto`` then off), else with it — as ``qerl train`` resolves
    ``micro_batch_tokens: auto`` (the dense copy stays as ``--dense-update`` says)."""
    from qerl.models.shapes import Shape
    from qerl.train.plan import auto_micro_tokens, device_bytes

    want = MICRO_TOKENS[0]
    if want is None:
        return False, None
    if want != "auto":
        return int(want), None
    s = Shape.from_config(hf_config)
    cap = min(device_bytes(), CAP_BYTES[0])
    for ckpt in {"auto": (False, True), "on": (True,), "off": (False,)}[checkpointing]:
        n = auto_micro_tokens(s, base, rows, gen_len, checkpointing=ckpt, available=cap, **fk)
        if n is not None:
            return n, ckpt
    raise ValueError(f"--micro-tokens auto: not one sequence of {gen_len} new tokens fits (memory planner)")


def packed_on() -> str:
    """How the update runs its micro-batches (``--packed-sequences``): "True" (each one packed row), "False" (padded) or
    "auto" (packed where padding would be :data:`qerl.ops.packed.PACK_RATIO` times the real tokens or more, on CUDA
    with torch's varlen attention: :func:`qerl.train.update.packing_mode`); older rows of the CSV, without the column,
    ran padded."""
    from qerl.ops.packed import varlen_ok

    if PACKED[0] == "auto":
        return "auto" if torch.cuda.is_available() and varlen_ok("cuda") else "False"
    return str(PACKED[0] is True)


def fused_on() -> bool:
    """Whether the update runs with its norms and SiLU gate fused (:mod:`qerl.train.fused`: on CUDA, unless
    ``FUSED[0]`` is off); older rows of the CSV, without the column, ran without."""
    from qerl.train.fused import FUSED

    return bool(FUSED[0] and torch.cuda.is_available())


def _first(e: BaseException) -> str:
    return str(e).splitlines()[0][:160] if str(e) else type(e).__name__


def _set_checkpointing(policy, on: bool) -> None:
    if on:
        policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    elif getattr(policy, "is_gradient_checkpointing", False):
        policy.gradient_checkpointing_disable()


def write(rows: list[dict], out: Path, device: str) -> tuple[Path, Path]:
    """``<device>.csv`` and ``.md`` (atomic), the paper's numbers beside each (model, method), and the
    ``.png`` of the step splits (:mod:`qerl.bench.step_plot`) where a row succeeded."""
    out.mkdir(parents=True, exist_ok=True)
    stem = out / device.replace(" ", "_")
    with atomic_open(stem.with_suffix(".csv"), newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        w.writeheader()
        w.writerows({k: r.get(k, "") for k in COLUMNS} for r in rows)
    lines = [f"# GRPO step on {device}", "",
             "One step = rollout (engine; `lengths` fixed: every completion `gen` tokens, else each stopped at a "
             "seeded drawn length, qerl.bench.lengths) + old log-probs + update (GRPO loss, backward, "
             "AdamW). LoRA rank 32 on the seven projections; `batch` = sequences per step; times of the second "
             "step; peak = max allocated.", "",
             "| model | method | batch | prompt | gen | lengths | GPUs | status | rollout s | logprob s | update s | total s | "
             "tok/s | peak GB | ckpt | micro-batch | engine cache | optimizer states | rollout: prefill / capture / "
             "host-check s | paper (one H100) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def f(r, k):
        v = r.get(k, "")
        return "" if v in ("", None) else (f"{v:.2f}" if isinstance(v, float) else str(v))

    for r in rows:
        lines.append(f"| {r['model']} | {r['method']} | {r['batch']} | {r['prompt_len']} | {r['gen_len']} | "
                     f"{r.get('lengths') or 'fixed'}{_per_prompt(r)} | {r.get('nproc') or 1} | {r['status']} | {f(r, 'rollout_s')} | {f(r, 'logprob_s')} | "
                     f"{f(r, 'update_s')} | {f(r, 'total_s')} | {f(r, 'tokens_per_s')} | {f(r, 'peak_gb')} | "
                     f"{f(r, 'checkpointing')} | {_micro(r)} | {r.get('engine_cache') or 'released'} | "
                     f"{r.get('optimizer_states') or 'gpu'} | "
                     f"{' / '.join(f(r, k) for k in ENGINE_SPLIT) if r.get('prefill_s') not in ('', None) else ''} | "
                     f"{PAPER.get((r['model'], r['method']), '')} |")
    lines += scaling_lines(rows)
    if any(r.get("status") == "ok" for r in rows):
        from qerl.bench.step_plot import plot

        plot(rows, stem.with_suffix(".png"), device)
        lines[4:4] = [f"![step split]({stem.with_suffix('.png').name})", ""]
    write_text_atomic(stem.with_suffix(".md"), "\n".join(lines) + "\n")
    return stem.with_suffix(".csv"), stem.with_suffix(".md")


def _per_prompt(r: dict) -> str:
    """The Markdown's note on a GRPO-shaped row (``--grpo-shaped``: ``batch / G`` prompts x ``G`` samples)."""
    g = r.get("samples_per_prompt")
    out = f", {g} samples per prompt" if g not in ("", None, 1, "1") else ""
    return out + (", dense update" if r.get("dense_update") in (True, "True") else "")


def scaling_lines(rows: list[dict]) -> list[str]:
    """Markdown: each configuration measured on N GPUs against one GPU, both ways data parallelism is read:

    * **same batch per step** (strong scaling): the 1-GPU step at the same batch B; speed-up ``T₁(B) / T_N(B)``,
      efficiency = speed-up / N;
    * **same batch per GPU** (weak scaling, throughput): the 1-GPU step at B / N; sequences per second on N GPUs
      over one GPU's, ``N · T₁(B/N) / T_N(B)`` (N at best);

    and the share of the N-GPU step that the fastest rank waited for the slowest one's rollout."""
    def config(r):
        return (r["model"], r["method"], r["batch"], r["prompt_len"], r["gen_len"], r.get("micro_batch"),
                r.get("micro_tokens") or "", r.get("engine_cache") or "released", r.get("optimizer_states") or "gpu",
                str(r.get("dense_update") or False), str(r.get("packed_update") or False), r.get("lengths") or "fixed",
                r.get("samples_per_prompt") or 1)

    one = {config(r): r for r in rows if (r.get("nproc") or 1) == 1 and r["status"] == "ok"}
    out = []
    for r in rows:
        n = r.get("nproc") or 1
        if n == 1 or r["status"] != "ok":
            continue
        key = config(r)
        same_batch = one.get(key)
        per_gpu = one.get((key[0], key[1], r["batch"] // n, *key[3:]))
        if same_batch is None and per_gpu is None:
            continue
        strong = weak = "—"
        if same_batch is not None:
            up = same_batch["total_s"] / r["total_s"]
            strong = f"{same_batch['total_s']:.2f} s: **{up:.2f}×** ({up / n:.0%})"
        if per_gpu is not None:
            weak = f"{per_gpu['total_s']:.2f} s: **{n * per_gpu['total_s'] / r['total_s']:.2f}×**"
        idle = r.get("rank_idle_s") or 0.0
        out.append(f"| {r['model']} | {r['method']} | {r['gen_len']} | {r.get('lengths') or 'fixed'} | {n} | {r['batch']} | {r['batch'] // n} | "
                   f"{r['total_s']:.2f} | {strong} | {weak} | {idle:.2f} s ({idle / r['total_s']:.1%}) |")
    measured = ["", "## Data-parallel scaling (measured)", "",
                "Against one GPU at the same batch per step (speed-up, efficiency = speed-up / N) and at the same "
                "batch per GPU (throughput in sequences per second, N at best).", "",
                "| model | method | gen | lengths | GPUs | batch per step | per GPU | N-GPU step s | 1 GPU, same batch per "
                "step: speed-up | 1 GPU, same batch per GPU: throughput | fastest rank's rollout wait |",
                "|---|---|---|---|---|---|---|---|---|---|---|", *out] if out else []
    return measured + projected_scaling_lines(rows, config)


def projected_scaling_lines(rows: list[dict], config, n: int = 2) -> list[str]:
    """Markdown: the ``n``-GPU data-parallel speed-up that one-GPU rows imply. A rank of an ``n``-GPU step at batch
    B does what one GPU does at B / n (its share of the rollouts, log-probs and micro-batches) plus an all-gather of
    the rollouts and one all-reduce of the adapter gradients (overlapped with the last backward; not modelled),
    so the bound is ``T₁(B) / T₁(B / n)``, for every B whose B / n was measured too. Equal-length completions:
    no rank waits for another's rollout here (with EOS, the longest share sets the pace)."""
    one = {config(r): r for r in rows if (r.get("nproc") or 1) == 1 and r["status"] == "ok"}
    out = []
    for key, r in one.items():
        part = one.get((key[0], key[1], r["batch"] // n, *key[3:])) if r["batch"] % n == 0 else None
        if part is not None:
            up = r["total_s"] / part["total_s"]
            out.append(f"| {r['model']} | {r['method']} | {r['batch']} | {r['gen_len']} | {r['total_s']:.2f} | "
                       f"{part['total_s']:.2f} | {r['rollout_s'] / part['rollout_s']:.2f}× | {up:.2f}× | "
                       f"{up / n:.0%} |")
    if not out:
        return []
    return ["", f"## Projected {n}-GPU data-parallel scaling, from the one-GPU rows (upper bound, not a {n}-GPU "
            "measurement)", "",
            f"A rank of a {n}-GPU step at batch B does the one-GPU step at B / {n}, plus collectives not modelled "
            "here.", "",
            f"| model | method | batch B | gen | 1-GPU step s at B | 1-GPU step s at B / {n} | rollout speed-up | "
            "step speed-up | efficiency |", "|---|---|---|---|---|---|---|---|---|", *out]


def _micro(r: dict) -> str:
    """The Markdown's micro-batch cell: rows, or "≤ N tok" where the micro-batches were cut by tokens."""
    return f"≤ {r['micro_tokens']} tok" if r.get("micro_tokens") not in ("", None) else str(r.get("micro_batch", ""))


def _typed(r: dict) -> dict:
    """A CSV row back to numbers (the Markdown formats floats)."""
    out = {}
    for k, v in r.items():
        try:
            ints = ("batch", "prompt_len", "gen_len", "micro_batch", "nproc", "samples_per_prompt", "micro_tokens")
            out[k] = int(v) if k in ints else (float(v) if k.endswith(("_s", "_gb")) else v)
        except ValueError:
            out[k] = v
    return out


def _merge_rows(paths) -> tuple[dict, set]:
    rows: dict = {}
    devices = set()
    for path in paths:
        with open(path, newline="") as f:
            for r in csv.DictReader(f):
                devices.add(r["device"])
                r.setdefault("engine_cache", "released")  # files written before the column: every step released it
                r["engine_cache"] = r["engine_cache"] or "released"
                r["optimizer_states"] = r.get("optimizer_states") or "gpu"  # (before the column: on the GPU)
                r["lengths"] = r.get("lengths") or "fixed"  # (before the column: every completion gen_len tokens)
                r["samples_per_prompt"] = r.get("samples_per_prompt") or "1"  # (before the column: one per prompt)
                r["dense_update"] = r.get("dense_update") or "False"  # (before the column: dequantized per call)
                r["packed_update"] = r.get("packed_update") or "False"  # (before the column: padded micro-batches)
                rows[(r["model"], r["method"], r["batch"], r["prompt_len"], r["gen_len"], r["lengths"],
                      r["samples_per_prompt"], r["dense_update"], r["packed_update"],
                      r.get("nproc") or "1", r["micro_batch"], r.get("micro_tokens") or "", r["engine_cache"],
                      r["optimizer_states"])] = _typed(r)
    return rows, devices


def merge(paths: list[Path], out: Path) -> tuple[Path, Path]:
    """One file set from several runs on one device (e.g. 7B, then 14B + 32B in a second process), merged into the
    one already at ``out`` for that device (its rows stay unless a given file has the same key): a later file's row
    replaces an earlier one with the same (model, method, batch, prompt_len, gen_len, lengths, GPUs, micro-batch,
    engine cache, optimizer states)."""
    rows, devices = _merge_rows(paths)
    if len(devices) != 1:
        raise ValueError(f"--merge: the CSVs come from different devices {sorted(devices)}; merge one device's runs")
    existing = existing_csv(out, next(iter(devices)), paths)
    if existing is not None:
        rows = {**_merge_rows([existing])[0], **rows}
    order = {"7B": 0, "14B": 1, "32B": 2}
    merged = sorted(rows.values(), key=lambda r: (order.get(r["model"], 9), r["method"], r["lengths"] != "fixed",
                                                  r["lengths"], r.get("samples_per_prompt") or 1, -r["batch"], r["gen_len"],
                                                  r.get("nproc") or 1, r["micro_batch"], r["engine_cache"] != "released",
                                                  r["optimizer_states"] != "gpu"))
    return write(merged, out, devices.pop())


def build_parser() -> argparse.ArgumentParser:
    from qerl.argtypes import HelpFormatter
    from qerl.bench.lengths import argtype as lengths_arg

    p = argparse.ArgumentParser(prog="qerl bench step", description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--output", default="reports/step", help="directory of the <device>.csv / .md set")
    p.add_argument("--models", nargs="+", default=["7B", "14B", "32B"], choices=list(SHAPES),
                   help="Qwen2.5 shapes (random weights)")
    p.add_argument("--methods", nargs="+", default=["lora", "qlora", "qerl"], choices=list(BASE),
                   help="training methods to time")
    p.add_argument("--batches", nargs="+", type=int, default=[2, 8], help="sequences per step")
    p.add_argument("--gen-lens", nargs="+", type=int, default=[1024, 2048], help="completion lengths")
    p.add_argument("--long-gen", type=int, default=4096, help="extra completion length for 32B QeRL (0: none)")
    p.add_argument("--prompt-len", type=int, default=256, help="prompt tokens")
    p.add_argument("--lengths", type=lengths_arg, default=None, metavar="SPEC",
                   help="completion lengths of the measured steps: fixed | lognormal:median=M,sigma=S | "
                        "uniform:low=A,high=B (each row stopped at a seeded drawn length, as if it sampled EOS)")
    p.add_argument("--grpo-shaped", action="store_true",
                   help="roll out batch / G prompts x G samples each (G: the update's GRPO group size, 16 where it "
                        "divides the batch), as training does, instead of a distinct prompt per sequence")
    p.add_argument("--dense-update", action="store_true",
                   help="NVFP4 base: the update multiplies a bf16 copy of the weights made once per update phase "
                        "(config dense_update: true) instead of dequantizing per call")
    p.add_argument("--packed-sequences", choices=["auto", "true", "false"], default="auto",
                   help="config packed_sequences of the measured steps: each update micro-batch as one row of its "
                        "real tokens (true), padded rows (false), or auto: micro-batches padded to >= 1.25x their real "
                        "tokens packed, on CUDA with torch's varlen attention")
    p.add_argument("--micro-batch", type=int, default=2, help="sequences per forward/backward of the update")
    p.add_argument("--micro-tokens", default=None, metavar="N|auto",
                   help="cut the update's micro-batches by tokens instead of --micro-batch rows (config "
                        "micro_batch_tokens): at most N tokens each, or auto: the most the memory planner fits")
    p.add_argument("--checkpointing", choices=["auto", "on", "off"], default="auto",
                   help="gradient checkpointing (auto: the memory planner decides)")
    p.add_argument("--cap-gb", type=float, default=80.0, help="cap the process's GPU memory on a larger card")
    p.add_argument("--warmup-gen", type=int, default=16, help="completion tokens of the warm-up step")
    p.add_argument("--profile", type=Path, default=None,
                   help="also write a torch.profiler table of one step per (model, method) here")
    p.add_argument("--keep-cache", action="store_true",
                   help="keep the engine's KV cache and graphs between steps (rollout.release_cache: false)")
    p.add_argument("--offload", action="store_true",
                   help="park the optimizer states in host memory during the rollout (optim.offload: rollout)")
    p.add_argument("--nproc", type=int, default=1,
                   help="GPUs of this machine, data parallel (relaunches itself under torchrun; batches divisible)")
    p.add_argument("--merge", nargs="+", metavar="CSV", type=Path,
                   help="only merge runs of one device into --output's file set (later files win; no GPU)")
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    if a.merge:
        print(merge(a.merge, Path(a.output)))
        return 0
    if not torch.cuda.is_available():
        raise SystemExit("qerl bench step needs a CUDA GPU (use --merge CSV... to combine runs)")
    PACKED[0] = {"true": True, "false": False}.get(a.packed_sequences, "auto")
    if a.micro_tokens not in (None, "auto") and not (a.micro_tokens.isdigit() and int(a.micro_tokens) > 0):
        raise SystemExit(f"--micro-tokens: a positive integer or auto, got {a.micro_tokens!r}")
    MICRO_TOKENS[0] = a.micro_tokens
    import os

    from qerl.train import dist

    if a.nproc > 1 and "WORLD_SIZE" not in os.environ:
        import subprocess

        from qerl.train.launch import strip_launch_args, torchrun_argv

        if torch.cuda.device_count() < a.nproc and not os.environ.get("QERL_DIST_BACKEND"):  # (gloo: may share)
            raise SystemExit(f"--nproc {a.nproc}: this machine has {torch.cuda.device_count()} GPU(s)")
        bad = [b for b in a.batches if b % a.nproc]
        if bad:
            raise SystemExit(f"--batches {bad}: not divisible by --nproc {a.nproc}")
        return subprocess.call(torchrun_argv(a.nproc, strip_launch_args(list(argv if argv is not None else
                                                                             sys.argv[1:])), command=("bench", "step")))
    from qerl.models.random import nf4_available

    d = dist.from_env(torch.device("cuda"))
    device = torch.cuda.get_device_name()
    CAP_BYTES[0] = a.cap_gb * 1e9
    frac = cap_memory(a.cap_gb)
    if d.main:
        print(json.dumps({"device": device, "memory_fraction": frac, "nproc": d.world}), flush=True)
    rows = []
    for m in a.models:
        for method in a.methods:
            if method == "qlora" and not nf4_available():
                print(json.dumps({"skip": f"{m} qlora: bitsandbytes is not importable"}), flush=True)
                continue
            gens = list(a.gen_lens) + ([a.long_gen] if a.long_gen and m == "32B" and method == "qerl" else [])
            rows += run_config(m, method, a.batches, gens, a.prompt_len, a.micro_batch, a.checkpointing, device,
                               progress=lambda s: print(s, flush=True) if d.main else None, warmup_gen=a.warmup_gen,
                               profile=a.profile if not d.on else None, d=d, keep_cache=a.keep_cache,
                               offload=a.offload, lengths=a.lengths, grouped=a.grpo_shaped, dense=a.dense_update)
            if d.main:
                write(rows, Path(a.output), device)
    if d.main:
        print(json.dumps({"csv": str(Path(a.output) / (device.replace(' ', '_') + '.csv'))}))
    dist.close(d)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
