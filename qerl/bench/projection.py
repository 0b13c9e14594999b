"""Projected GPU time of a training run (``qerl plan --cost``) and of the paper's tables (``qerl bench cost``),
from rates measured on the GPU with the product's own path.

**What was measured** (:data:`REHEARSALS`: ``qerl bench rehearsal``, reports/reproduce, one H100): one GRPO step of
the paper's Table 1 QeRL setting — 16 prompts x G = 8 = 128 sequences, μ = 4 updates, micro-batch 16, gradient
checkpointing, LoRA 32, AQN — on random-weight stand-ins whose completions all run to the cap (random weights
never sample EOS): 3B at 4,096 tokens, 7B at 2,048. Each gives a rollout time per decode step at 128 rows and an
effective rate of the log-prob + update phases (FLOPs below / seconds). 14B and 32B were not rehearsed: their decode
step comes from the rollout benchmark (reports/rollout, NVFP4, batch 64 and 256, interpolated at 128) times the
7B ratio of the training loop's rollout to the benchmark's engine (:data:`BENCH_TO_TRAIN`), their update rate is
the 7B one (larger GEMMs are at least as efficient on the same path). Each assumption is stated in the output.

**The model of one step** (``rows`` completions of lengths ``L_i`` after a ``P``-token prompt):

* rollout: ``Σ_t (a + b · n_t)`` over decode steps ``t``, ``n_t`` the rows decoding at step t — with
  ``slots`` rows at most at once (the memory planner's KV-cache slots; a finished row's slot goes to the next row):
  ``a · makespan + b · Σ L_i`` (:func:`rollout_seconds`). ``a + b · rows`` is the measured time of one decode step
  with every row active; the split between the weight-bound intercept ``a`` and the per-row slope ``b`` is the
  rollout benchmark's (7B NVFP4, batch 64 -> 256: ``a`` is :data:`INTERCEPT_SHARE` of the step at 128 rows);
* log-prob + update: ``FLOPs = 2 · W · Σ (P + L_i) · passes`` at the measured rate, ``W`` the weights of the
  linear layers (projections and lm_head: :func:`linear_weights`), ``passes = μ · (forward + backward-to-inputs
  (+ weight gradients for the full method) + the checkpointed forward again) + the no-grad old-log-prob pass
  (unless μ = 1 with ``old_logprob_pass`` off) + the reference pass (KL > 0)``;
* evaluation: the rollout model on the benchmark's problems x samples in batches of ``evaluation.batch_size``.

**Methods** (relative to QeRL, measured in reports/step and reports/rollout, 7B, H100): bf16 LoRA decodes at
:data:`BF16_ROLLOUT` x QeRL's step time at 128 rows; QLoRA's rollout (bitsandbytes NF4, no engine graphs) at
:data:`QLORA_ROLLOUT` x; full fine-tuning decodes as bf16 and adds the weight-gradient pass. The update of every
LoRA method costs the same FLOPs.

Completion lengths: every completion at the cap (the upper bound: what the rehearsal ran) and an assumed
distribution per dataset (:data:`ASSUMED_LENGTHS`, :mod:`qerl.bench.lengths` specs, seeded), both reported.
"""
from __future__ import annotations

import dataclasses
import heapq
from dataclasses import dataclass

from qerl.models.shapes import QWEN25, Shape
from qerl.data.tasks import REGISTERED_BENCHMARKS

DEVICE = "NVIDIA H100 80GB HBM3"
PROMPT = 256  # prompt tokens (the planner's PROMPT_TOKENS)


@dataclass(frozen=True)
class Rehearsal:
    """One measured Table 1 step (reports/reproduce/rehearsal_<device>.csv, 2026-11-25)."""

    shape: str
    rows: int
    cap: int
    generated: int  # completion tokens of the step
    rollout_s: float
    update_s: float  # log-prob + update phases
    updates: int  # μ
    checkpointing: bool = True

    @property
    def decode_ms(self) -> float:
        """One decode step with every row active (the whole rollout / the cap's decode steps)."""
        return self.rollout_s / self.cap * 1e3

    @property
    def update_tflops(self) -> float:
        tokens = self.rows * PROMPT + self.generated
        return update_flops(QWEN25[self.shape], tokens, self.updates, self.checkpointing) / self.update_s / 1e12


REHEARSALS = {
    "3B": Rehearsal("3B", 128, 4096, 519574, 72.12, 213.79, 4),
    "7B": Rehearsal("7B", 128, 2048, 261388, 53.2, 163.7, 4),
}
#: rollout benchmark (reports/rollout, H100, 2026-11-24/25), NVFP4 engine, prompt 256, 1,024 tokens: ms per
#: decode step at batch 64 and 256 — the measurements with the GEMM the rehearsals ran (v12), so that the
#: loop / benchmark ratio (:func:`bench_to_train`) compares one code; later code decodes faster (7B 6.25 / 14.68 ms,
#: 14B 12.51 and 32B 21.43 ms at batch 64, 2026-11-26), so the projections lean long until the rehearsals are repeated
BENCH_STEP_MS = {"7B": (8.28, 20.43), "14B": (15.76, 27.08), "32B": (25.44, 32.94)}


def bench_step_ms(shape: str, rows: int = 128) -> float:
    """The rollout benchmark's decode step at ``rows`` rows, on the line through its batch-64 and batch-256 steps."""
    lo, hi = BENCH_STEP_MS[shape]
    return lo + (hi - lo) * (rows - 64) / 192


#: the weight-bound share of a 7B decode step at 128 rows: the intercept of that line over its value at 128
#: (a = 4.23 ms, a + 128 b = 12.33 ms)
INTERCEPT_SHARE = bench_step_ms("7B", 0) / bench_step_ms("7B")
BF16_ROLLOUT = 9513 / 9055  # 7B batch 128, fixed lengths: NVFP4 / bf16 tokens per second (bf16 is this much slower; v12)
QLORA_ROLLOUT = 65.68 / 4.99  # 7B batch 8, 1,024 tokens: QLoRA / QeRL rollout seconds (reports/step)
#: assumed completion lengths (stated in every projection): GSM8K answers of the Qwen2.5 Instruct models run a few
#: hundred tokens (the benchmarks' realistic spec); BigMath / DAPO reasoning runs longer
ASSUMED_LENGTHS = {"gsm8k": "lognormal:median=300,sigma=0.9", "bigmath": "lognormal:median=1500,sigma=0.8"}


def bench_to_train() -> float:
    """The 7B training loop's decode step over the benchmark engine's at 128 rows (longer contexts, the loop's
    host work): measured 26.0 ms (rehearsal, 2,048 tokens) vs 12.3 ms (benchmark, 1,024 tokens) = 2.1."""
    return REHEARSALS["7B"].decode_ms / bench_step_ms("7B")


def linear_weights(s: Shape) -> int:
    """Weights of the linear layers a token passes through: :meth:`Shape.linear_weights`."""
    return s.linear_weights()


def update_flops(s: Shape, tokens: int, updates: int, checkpointing: bool = True, full: bool = False,
                 old_pass: bool | None = None, ref_pass: bool = False) -> float:
    """FLOPs of the log-prob + update phases over ``tokens`` (prompt + completion) tokens (module docstring)."""
    per_update = 2 + (1 if checkpointing else 0) + (1 if full else 0)  # fwd, bwd dX, (re-fwd), (dW)
    old = (updates > 1) if old_pass is None else old_pass
    passes = updates * per_update + (1 if old else 0) + (1 if ref_pass else 0)
    return 2.0 * linear_weights(s) * tokens * passes


def rollout_seconds(lengths: list[int], step_ms: float, rows_at_step: int, slots: int | None = None) -> float:
    """Decode time of completions ``lengths`` (tokens each) with at most ``slots`` rows at once (a finished row's slot
    taken by the next waiting row, in order): ``a · makespan + b · Σ L`` with ``a + b · rows_at_step = step_ms``
    (:data:`INTERCEPT_SHARE` of it the intercept)."""
    if not lengths:
        return 0.0
    slots = len(lengths) if slots is None else max(1, min(slots, len(lengths)))
    a = INTERCEPT_SHARE * step_ms
    b = (1 - INTERCEPT_SHARE) * step_ms / rows_at_step
    ends = [0] * slots  # list scheduling: each row starts when the earliest slot frees
    heapq.heapify(ends)
    for n in lengths:
        heapq.heappush(ends, heapq.heappop(ends) + n)
    return (a * max(ends) + b * sum(lengths)) / 1e3


def decode_step_ms(shape: str) -> tuple[float, str]:
    """The training loop's decode step at 128 rows for ``shape`` and where it comes from."""
    if shape in REHEARSALS:
        r = REHEARSALS[shape]
        return r.decode_ms, f"rehearsed ({r.cap}-token cap)"
    return bench_step_ms(shape) * bench_to_train(), "rollout benchmark x the 7B loop / benchmark ratio"


def update_rate(shape: str) -> tuple[float, str]:
    """Effective TFLOP/s of the log-prob + update phases for ``shape`` and where it comes from."""
    if shape in REHEARSALS:
        return REHEARSALS[shape].update_tflops, "rehearsed"
    return REHEARSALS["7B"].update_tflops, "the 7B rate (not rehearsed)"


@dataclass
class StepCost:
    rollout_s: float
    update_s: float


def step_cost(shape: str, method: str, rows: int, lengths: list[int], updates: int, checkpointing: bool = True,
              slots: int | None = None, old_pass: bool | None = None, ref_pass: bool = False) -> StepCost:
    """One step of ``method`` (qerl / nvfp4_lora / lora / qlora / full) at ``shape``."""
    step_ms, _ = decode_step_ms(shape)
    factor = {"lora": BF16_ROLLOUT, "full": BF16_ROLLOUT, "qlora": QLORA_ROLLOUT}.get(method, 1.0)
    roll = rollout_seconds(lengths, step_ms * factor, 128, slots)
    tokens = rows * PROMPT + sum(lengths)
    flops = update_flops(QWEN25[shape], tokens, updates, checkpointing, method == "full", old_pass, ref_pass)
    return StepCost(roll, flops / (update_rate(shape)[0] * 1e12))


def lpt_makespan(hours: list[float], gpus: int) -> float:
    """Wall-clock hours of independent one-GPU runs on ``gpus`` GPUs (longest first to the least loaded GPU)."""
    loads = [0.0] * max(1, gpus)
    for h in sorted(hours, reverse=True):
        loads[loads.index(min(loads))] += h
    return max(loads)


def _lengths(spec: str, rows: int, cap: int, seed: int) -> list[int]:
    from qerl.bench.lengths import draw, parse

    return draw(parse(spec), rows, cap, seed=seed)


def family(dataset: dict) -> str:
    """The length family of a workflow dataset entry (its task: gsm8k -> ``gsm8k``, else ``bigmath``)."""
    return "gsm8k" if str(dataset.get("task", "")).startswith("gsm8k") else "bigmath"


def run_cost(cfg, shape: str, lengths_spec: str | None, gpu_gb: float = 80.0, seed: int = 0) -> dict:
    """Projected hours of one ``qerl train`` config (a :class:`~qerl.train.config.TrainConfig`) at ``shape``:
    ``cfg.steps`` steps, completions at the cap (``lengths_spec`` None) or drawn from the spec (a new draw per step,
    seeded). The KV-cache slots and whether the run fits one GPU come from the memory planner."""
    from qerl.train.plan import plan_config

    plan = plan_config(cfg, shape=shape, available=gpu_gb * 1e9)
    micro = cfg.micro_batch_size
    if not plan["fits"] and micro != "auto":  # what `micro_batch_size: auto` would run (same FLOPs)
        from qerl.train.plan import resolve_micro_batch

        try:
            resolved, _ = resolve_micro_batch(dataclasses.replace(cfg, micro_batch_size="auto"), QWEN25[shape],
                                              available=gpu_gb * 1e9)
            auto = plan_config(resolved, shape=shape, available=gpu_gb * 1e9)
        except (ValueError, RuntimeError):  # nothing fits: several GPUs
            auto = {"fits": False}
        if auto["fits"]:
            plan, micro = auto, resolved.micro_batch_size
    est = plan["estimate"]
    a = cfg.algorithm
    rows = cfg.prompts_per_step * a.group_size
    cap = cfg.rollout.max_new_tokens
    one_pass = a.updates_per_batch == 1 and not a.old_logprob_pass
    draws = 8  # steps drawn (the mean of their costs stands for every step)
    costs = []
    for k in range(draws if lengths_spec else 1):
        lens = [cap] * rows if not lengths_spec else _lengths(lengths_spec, rows, cap, seed + k)
        costs.append(step_cost(shape, cfg.method, rows, lens, a.updates_per_batch, plan["checkpointing"],
                               est["wave_rows"], not one_pass, a.kl_coef > 0))
    roll = sum(c.rollout_s for c in costs) / len(costs)
    upd = sum(c.update_s for c in costs) / len(costs)
    return {"shape": shape, "method": cfg.method, "steps": cfg.steps, "rows": rows, "cap": cap,
            "lengths": lengths_spec or "every completion at the cap", "slots": est["wave_rows"], "micro_batch": micro,
            "fits_one_gpu": plan["fits"], "peak_gb": est["peak_gb"], "rollout_s": roll, "update_s": upd,
            "step_s": roll + upd, "hours": cfg.steps * (roll + upd) / 3600}


def eval_hours(shape: str, problems: int, samples: int, batch: int, cap: int, lengths_spec: str | None,
               base: str = "nvfp4", seed: int = 0) -> float:
    """Hours to evaluate ``problems`` x ``samples`` completions in batches of ``batch`` (no update)."""
    step_ms, _ = decode_step_ms(shape)
    step_ms *= BF16_ROLLOUT if base == "bf16" else 1.0
    n = problems * samples
    lens = [cap] * n if not lengths_spec else _lengths(lengths_spec, n, cap, seed)
    return sum(rollout_seconds(lens[i:i + batch], step_ms, 128) for i in range(0, n, batch)) / 3600


#: problems per benchmark (the paper's test sets)
BENCHMARK_PROBLEMS = {n: b.problems for n, b in REGISTERED_BENCHMARKS.items() if b.problems}  # (the table's)


def _evals(shape: str, benches: list[str], base: str, spec: str, ev: dict, seed: int) -> tuple[float, float]:
    """Hours to evaluate one model on ``benches`` (``evaluation`` settings ``ev``): every completion at the cap, and
    with the lengths ``spec``."""
    samples, batch, cap = int(ev.get("samples", 8)), int(ev.get("batch_size", 64)), int(ev.get("max_new_tokens", 4096))
    return tuple(sum(eval_hours(shape, BENCHMARK_PROBLEMS.get(b, 500), samples, batch, cap, lens, base, seed)
                     for b in benches) for lens in (None, spec))


def paper_projection(config: dict, gpus: int = 8, gpu_gb: float = 80.0, seed: int = 0) -> dict:
    """Every table of a workflow config (``report.table*``): per run the projected hours at the cap and with the
    assumed lengths, the evaluations (each trained run's, and each model's untrained bases), the
    table's GPU-hours on one GPU and its wall-clock on ``gpus`` GPUs (runs on one GPU each, longest first; a run
    that does not fit one GPU is spread over all of them, FSDP, at the same GPU-hours)."""
    from qerl.train.config import TrainConfig, from_dict, validate
    from qerl.workflow_config import runs, train_config, untrained_bases

    ev = config.get("evaluation", {})
    tables = {}
    for name, t in sorted((config.get("report") or {}).items()):
        if not name.startswith("table"):
            continue
        rows = []
        for r in runs(config):
            if r.model not in t.get("models", []) or r.algo != t.get("algorithm", r.algo) or \
                    ("dataset" in t and r.dataset != t["dataset"]):
                continue
            shape = str(config["models"][r.model].get("paper_column") or "")
            if shape not in QWEN25:
                continue
            cfg = validate(from_dict(TrainConfig, train_config(config, r, "sqlite:///mlflow.db"), "config"))
            fam = family(config["datasets"][r.dataset])
            cap = run_cost(cfg, shape, None, gpu_gb, seed)
            real = run_cost(cfg, shape, ASSUMED_LENGTHS[fam], gpu_gb, seed)
            benches = [t["benchmark"]] if "benchmark" in t else list(t.get("benchmarks", []))
            base = "bf16" if r.method in ("lora", "full") else "nvfp4"
            e_cap, e_real = _evals(shape, benches, base, ASSUMED_LENGTHS[fam], ev, seed)
            rows.append({"run": r.path, "shape": shape, "method": r.method, "steps": cfg.steps, "rows": cap["rows"],
                         "cap": cap["cap"], "updates": cfg.algorithm.updates_per_batch, "slots": cap["slots"],
                         "fits_one_gpu": cap["fits_one_gpu"], "step_s_cap": cap["step_s"],
                         "step_s_assumed": real["step_s"], "rollout_s_assumed": real["rollout_s"],
                         "update_s_assumed": real["update_s"], "train_h_cap": cap["hours"],
                         "train_h_assumed": real["hours"], "eval_h_cap": e_cap, "eval_h_assumed": e_real,
                         "lengths": ASSUMED_LENGTHS[fam], "benchmarks": " ".join(benches)})
        if not rows:
            continue
        seen = {}  # the untrained bases of each model on the table's benchmarks (the table's first rows)
        for x in rows:
            seen.setdefault(x["run"].split("/")[0], x)
        for model, x in seen.items():
            fam_spec, benches = x["lengths"], x["benchmarks"].split()
            for base in untrained_bases(config).get(model, []):
                e_cap, e_real = _evals(x["shape"], benches, base, fam_spec, ev, seed)
                rows.append({"run": f"{model}/untrained {base}", "shape": x["shape"], "method": f"untrained {base}",
                             "steps": 0, "rows": 0, "cap": int(ev.get("max_new_tokens", 4096)), "updates": 0,
                             "slots": x["slots"],
                             "fits_one_gpu": True, "step_s_cap": 0.0, "step_s_assumed": 0.0, "rollout_s_assumed": 0.0,
                             "update_s_assumed": 0.0, "train_h_cap": 0.0, "train_h_assumed": 0.0, "eval_h_cap": e_cap,
                             "eval_h_assumed": e_real, "lengths": fam_spec, "benchmarks": x["benchmarks"]})
        out = {}
        for key in ("cap", "assumed"):
            per = [x[f"train_h_{key}"] + x[f"eval_h_{key}"] for x in rows]
            single = [h for h, x in zip(per, rows) if x["fits_one_gpu"]]
            spread = sum(h for h, x in zip(per, rows) if not x["fits_one_gpu"]) / max(1, gpus)
            out[key] = {"gpu_hours": sum(per), "wall_h_1gpu": sum(per) if all(x["fits_one_gpu"] for x in rows)
                        else None, f"wall_h_{gpus}gpu": lpt_makespan(single, gpus) + spread}
        tables[name] = {"runs": rows, **out}
    return {"device": DEVICE, "gpus": gpus, "tables": tables,
            "assumptions": {"lengths": ASSUMED_LENGTHS, "bench_to_train": bench_to_train(),
                            "intercept_share": INTERCEPT_SHARE, "bf16_rollout": BF16_ROLLOUT,
                            "qlora_rollout": QLORA_ROLLOUT,
                            "decode_ms": {k: decode_step_ms(k) for k in QWEN25},
                            "update_tflops": {k: update_rate(k) for k in QWEN25}}}
