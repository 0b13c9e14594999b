"""Memory planner: the peak GPU memory of a training configuration, estimated before anything loads.

``estimate(shape, base, rows, prompt_len, gen_len, micro, rank, checkpointing, eight_bit, release_cache)``
returns the parts (bytes) of the three phases of a step and their peak; ``qerl plan --config FILE`` prints it;
``qerl train`` refuses a configuration whose estimate exceeds the card (with the parts and what to change).

The model (bf16 activations, LoRA applied in bf16 through :func:`qerl.lora.lean_lora_delta`, SDPA attention,
log-probs in ~1024-token blocks through :func:`qerl.ops.logits.token_logprobs`):

* weights: decoder linears at 2 B (bf16), 0.5625 B (NVFP4: e2m1 codes + e4m3 scale per 16) or 0.5625 B (NF4:
  codes + fp32 absmax per 64) per parameter; embeddings and lm_head in bf16; norms.
* LoRA: ``r · (K + N)`` per projection; fp32 master + fp32 grad + AdamW states (8 B fp32, 2 B 8-bit) + the bf16
  copies the fused rollout kernels read.
* rollout: KV cache ``2 · layers · kv_heads · head_dim · 2 B`` per position and row, the prefill's activations
  (one chunk of ``PREFILL_TOKENS`` prompt positions at a time) and the sampler's fp32 vocabulary rows.
* the full method: bf16 weights, AdamW states and gradients, per process under ZeRO-1 / FSDP2 (:func:`full_bytes`);
  ``optim.offload`` moves the states out of the rollout phase (host memory), and where the KV cache of every
  sequence does not fit beside the rest the engine decodes as many as fit, a finished sequence's slot going to
  the next (``available``).
* update, per micro-batch of ``micro`` sequences of ``T = prompt + gen`` tokens: without checkpointing every
  layer keeps ``ACT_H · H + ACT_I · I + ACT_A · heads · head_dim`` bytes per token for the backward; with
  checkpointing a layer keeps its 2H-byte input and one layer is recomputed at a time; plus the lm_head block
  (``LOGIT_COPIES`` fp32 copies of a ``[~1024 tokens, V]`` block).

The coefficients were counted from the saved tensors of transformers' Qwen2 layer and checked against the
measured peaks of ``qerl bench step`` (``reports/step``; a test compares them with the committed CSV).
"""
from __future__ import annotations


from qerl.methods import METHODS
from qerl.models.shapes import QWEN25, Shape  # (re-exported: plan_config's --shape choices)

GiB = 1024 ** 3
# bytes per token per layer kept for the backward (bf16): norms (fp32 statistics, bf16 outputs, residuals: ~12 H),
# the MLP's gate, up, silu(gate) and product (~7 I: some share storage), attention q/k/v, rotary outputs and SDPA's
# output (~10 · heads · head_dim). Counted, then fitted to the no-checkpointing 7B peaks of reports/step (H100):
# 212 KB per token per layer measured.
ACT_H, ACT_I, ACT_A = 12, 7, 10
LOGIT_COPIES = 4  # fp32 logits, log-softmax, its exp / the gradient: live together in a chunk's backward
# the update with RMSNorm and the SiLU gate fused (qerl.train.fused, CUDA): a norm keeps its bf16 input and an fp32
# statistic per token instead of fp32 copies (-8 H per layer), the gate keeps g and u (-1 I); the fused log-prob
# blocks keep one fp32 logits block and its bf16 gradient (qerl_kernels.token_logprob). Checked against the measured
# 0.5B peaks (H100, micro-batch 64 without checkpointing: 49.2 GB eager, 38.7 GB fused, reports/step).
ACT_H_FUSED, ACT_I_FUSED, LOGIT_COPIES_FUSED = 4, 6, 2
CHUNK_TOKENS = 1024  # qerl.ops.logits.CHUNK_TOKENS
PREFILL_TOKENS = 8192  # qerl.rollout.engine.runner.PREFILL_TOKENS (the engine prefills rows in chunks of this)
ENGINE_WORK = 2 * 1024 ** 3  # the engine's reserve beside its KV cache (+ 24 B per row and vocabulary entry)
PACKED_BYTES = {"bf16": 2.0, "nvfp4": 0.5 + 1 / 16, "nf4": 0.5 + 4 / 64}


PROMPT_TOKENS = 256  # prompt length assumed by the plan (the data is not read before loading)


def weight_bytes(s: Shape, base: str) -> dict[str, float]:
    """Bytes of the frozen weights: the decoder linears in ``base`` (the layers an NVFP4 checkpoint keeps in bf16,
    ``s.bf16_layers``, at 2 B), embeddings / lm_head and norms in bf16."""
    per_layer = sum(k * n for k, n in s.projections().values())
    kept = s.bf16_layers if base != "bf16" else 0
    lin = (s.layers - kept) * per_layer * PACKED_BYTES[base] + kept * per_layer * 2
    emb = s.vocab * s.hidden * 2 * (1 if s.tied else 2)
    return {"linears": lin, "embeddings+lm_head": emb, "norms": (2 * s.layers + 1) * s.hidden * 2}


def lora_bytes(s: Shape, rank: int, eight_bit: bool) -> dict[str, float]:
    n = s.layers * rank * sum(k + n for k, n in s.projections().values())
    return {"lora master+grad": 8 * n, "optimizer states": (2 if eight_bit else 8) * n, "lora bf16 copies": 2 * n}


def full_bytes(s: Shape, eight_bit: bool, world: int = 1, sharding: str = "none") -> tuple[dict, dict, float]:
    """Per process for the full method: (static parts, extra rollout parts, gradient bytes). Every weight trains:
    bf16 weights, AdamW states (2 B 8-bit, 8 B fp32) and bf16 gradients, which exist only in the update phase
    (freed at each optimizer step); ``sharding`` ``optimizer``: the states 1/``world`` per process; ``fsdp``:
    weights, gradients and states 1/``world`` except the lm_head (whole on every rank), and the rollout gathers the
    whole weights (the rest of them as an extra rollout part)."""
    w = weight_bytes(s, "bf16")
    total = sum(w.values())  # bytes at 2 B / parameter
    head = s.vocab * s.hidden * 2  # (the embeddings when tied)
    state = (2 if eight_bit else 8) / 2  # optimizer-state bytes per weight byte
    if sharding == "fsdp" and world > 1:
        body = total - head
        static = {"weights (shard + whole lm_head)": body / world + head,
                  "optimizer states (shard + lm_head)": (body / world + head) * state}
        return static, {"gathered weights": body * (world - 1) / world}, body / world + head
    states = total * state / (world if sharding == "optimizer" and world > 1 else 1)
    return {**w, "optimizer states": states}, {}, total


def kv_bytes(s: Shape, rows: int, positions: int) -> float:
    return 2 * s.layers * s.kv_heads * s.head_dim * 2 * rows * positions


def prefill_rows(rows: int, prompt_len: int) -> int:
    """Rows the engine prefills at once: as many prompts as fit ``PREFILL_TOKENS`` positions (at least one)."""
    return min(rows, max(1, PREFILL_TOKENS // max(1, prompt_len)))


def layer_act_bytes(s: Shape, fused: bool = False) -> float:
    """Bytes per token one layer keeps for its backward (no checkpointing); ``fused``: the fused update's layers."""
    if fused:
        return ACT_H_FUSED * s.hidden + ACT_I_FUSED * s.intermediate + ACT_A * s.heads * s.head_dim
    return ACT_H * s.hidden + ACT_I * s.intermediate + ACT_A * s.heads * s.head_dim


def estimate(s: Shape, base: str, rows: int, prompt_len: int, gen_len: int, micro: int, rank: int = 32,
             checkpointing: bool = True, eight_bit: bool = True, release_cache: bool = True, full: bool = False,
             world: int = 1, sharding: str = "none", offload: bool = False, available: float | None = None,
             dense: bool = False, prompts: int | None = None, fused: bool = False,
             update_tokens: int | None = None) -> dict:
    """Peak bytes of one training step and its parts (see the module docstring). ``rows``: sequences per step (per
    process). ``full``: the full method (``base`` bf16, no adapters; :func:`full_bytes` with ``world`` and
    ``sharding``) instead of a LoRA method. ``offload``: the optimizer states are in host memory during the
    rollout (:mod:`qerl.train.offload`) — a part of the log-prob and update phases instead of a static one
    (``host_bytes`` says how much host memory each process pins for them). ``available``: the GPU's bytes — the
    engine sizes its KV cache from the memory left and the rows that do not fit wait for a finished row's slot, so
    where all rows' cache would not fit the plan counts the rows that do (``wave_rows`` of them at once; ``waves``
    = rows / wave_rows rounded up, the rounds if every row ran to the end: a slower rollout, not a failure; at
    least one row must fit). ``dense``: ``dense_update`` — the NVFP4 base's linears dequantized to bf16 for the
    update phase (:func:`qerl.models.nvfp4_linear.dense_base`), 2 bytes per weight more there. ``prompts``: the
    distinct prompts among the ``rows`` (default: all distinct) — the engine prefills each once and copies its K/V
    to the group's other slots (``RolloutEngine(share_prompts=True)``), so a GRPO step of G samples per prompt
    prefills ``rows / G`` prompts. ``fused``: the update's norms, SiLU gate and log-probs fused (what a CUDA run of
    :func:`qerl.train.update.update_policy` does, :mod:`qerl.train.fused`); the default counts transformers' eager
    layers, which keep more (at 0.5B without checkpointing ~27% more activations): the plan errs on the safe side.
    ``update_tokens``: the tokens of one update micro-batch (``micro_batch_tokens``: packed micro-batches cut by real
    tokens) instead of ``micro x (prompt_len + gen_len)``."""
    T = prompt_len + gen_len
    micro = max(1, min(micro, rows))
    extra: dict = {}
    grads = 0.0
    if full:
        static, extra, grads = full_bytes(s, eight_bit, world, sharding)
    else:
        static = {**weight_bytes(s, base), **lora_bytes(s, rank, eight_bit)}
    kv = kv_bytes(s, rows, T)
    rollout = {**extra, "kv cache": kv,
               "prefill": prefill_rows(min(rows, prompts or rows), prompt_len) * prompt_len
               * (4 * s.hidden + 6 * s.intermediate) * 2,
               "sampler": 6 * rows * s.vocab * 4}
    n = micro * T if update_tokens is None else max(1, int(update_tokens))
    lm = (LOGIT_COPIES_FUSED if fused else LOGIT_COPIES) * min(CHUNK_TOKENS, micro * T) * s.vocab * 4
    if checkpointing:
        act = s.layers * n * 2 * s.hidden + n * layer_act_bytes(s, fused)
    else:
        act = s.layers * n * layer_act_bytes(s, fused)
    update = {"activations": act, "lm_head block": lm, "hidden states+grads": 3 * n * s.hidden * 2}
    if full:  # with several micro-batches all gradients exist through the later ones; with one they fill in as the
        # backward frees the activations (measured: 7B b2 50.5 GB, b8 65.7 GB, micro-batch 2)
        update["gradients"] = grads if rows > micro else max(0.0, grads - sum(update.values()))
    if not release_cache:
        update["kv cache (kept)"] = kv
    if dense and not full and base == "nvfp4":
        per_layer = sum(k * n for k, n in s.projections().values())
        update["dense base (dense_update)"] = (s.layers - s.bf16_layers) * per_layer * 2
    logprob = {"forward transients": n * (4 * s.hidden + 6 * s.intermediate) * 2, "lm_head block": lm / 2}
    host = 0.0
    if offload:
        key = next(k for k in static if k.startswith("optimizer states"))
        host = static.pop(key)
        logprob["optimizer states (back from the host)"] = update["optimizer states (back from the host)"] = host
    total_static = sum(static.values())
    waves, wave_rows = 1, rows
    if available is not None:  # as qerl.rollout.engine.runner plans its slots
        per = kv_bytes(s, 1, T)
        room = available - total_static - sum(rollout.values()) + kv - ENGINE_WORK - 24 * rows * s.vocab
        fit = max(1, int(room // per))
        if fit < rows:
            waves, wave_rows = -(-rows // fit), fit
            del rollout["kv cache"]
            rollout[f"kv cache ({fit} of {rows} sequences at once)"] = fit * per
    phases = {"rollout": sum(rollout.values()), "logprob": sum(logprob.values()), "update": sum(update.values())}
    peak_phase = max(phases, key=phases.get)
    return {"static": static, "rollout": rollout, "logprob": logprob, "update": update, "phases": phases,
            "peak_phase": peak_phase, "peak_bytes": total_static + phases[peak_phase],
            "peak_gb": (total_static + phases[peak_phase]) / 1e9, "host_bytes": host, "waves": waves,
            "wave_rows": wave_rows}


def resolve_checkpointing(mode, hf_config, base: str, rows: int, seq_len: int, micro: int,
                          budget_bytes: float | None = None, **full) -> bool:
    """``on``/``off``/bool as given; ``auto``: on when the estimate without it exceeds ``budget_bytes`` (default: 90%
    of the current CUDA device, or 80 GB without one). ``seq_len``: prompt +
    completion tokens per sequence (the prompt taken as :data:`PROMPT_TOKENS`, at most half of it). ``full``:
    :func:`estimate`'s ``full`` / ``world`` / ``sharding`` for the full method."""
    if mode in (True, False):
        return bool(mode)
    if mode in ("on", "true"):
        return True
    if mode in ("off", "false"):
        return False
    prompt = min(PROMPT_TOKENS, seq_len // 2)
    return needs_checkpointing(Shape.from_config(hf_config), base, rows, prompt, seq_len - prompt, micro,
                               budget_bytes=budget_bytes, **full)


def needs_checkpointing(s: Shape, base: str, rows: int, prompt_len: int, gen_len: int, micro: int, rank: int = 32,
                        eight_bit: bool = True, budget_bytes: float | None = None, release_cache: bool = True,
                        **full) -> bool:
    """The ``auto`` rule: on when the step's estimate without it exceeds ``budget_bytes`` (default: 90% of the
    current CUDA device, or of 80 GB without one). (Until 2026-11-26 it was also on for every 14B+ shape; at 14B,
    batch 64, the step without it is 14% (QeRL) / 8% (bf16 LoRA) faster on an H100 where it fits, reports/step.)"""
    budget = 0.9 * device_bytes() if budget_bytes is None else budget_bytes
    return estimate(s, base, rows, prompt_len, gen_len, micro, rank, False, eight_bit,
                    release_cache, **full)["peak_bytes"] > budget


def device_bytes() -> float:
    """The current CUDA device's memory (bytes), or 80 GB when there is none (the planning default)."""
    try:
        import torch

        if torch.cuda.is_available():
            return float(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)
    except Exception:  # a broken driver is not the planner's business
        pass
    return 80e9


def markdown(est: dict, title: str, available: float | None = None) -> str:
    """The estimate as a small report: parts per phase (GB), the peak, and the verdict against ``available``."""
    lines = [f"# Memory plan: {title}", "", "| part | GB |", "|---|---|"]
    for group in ("static", "rollout", "logprob", "update"):
        for k, v in est[group].items():
            lines.append(f"| {group}: {k} | {v / 1e9:.2f} |")
    lines.append(f"| **peak ({est['peak_phase']} phase)** | **{est['peak_gb']:.2f}** |")
    if available is not None:
        verdict = "fits" if est["peak_bytes"] <= available else "does NOT fit"
        lines += ["", f"{verdict} in {available / 1e9:.1f} GB"]
    return "\n".join(lines) + "\n"


def advice(est: dict, available: float, checkpointing: bool, micro: int) -> list[str]:
    """What would bring a configuration that does not fit under ``available``."""
    out = []
    if not checkpointing and est["phases"]["update"] > est["phases"]["rollout"]:
        out.append("enable gradient checkpointing (gradient_checkpointing: true)")
    if micro > 1 and est["peak_phase"] in ("update", "logprob"):
        out.append(f"lower micro_batch_size (now {micro})")
    if est["peak_phase"] == "rollout":
        out.append("fewer sequences per step (prompts_per_step × group_size) or a shorter rollout.max_new_tokens")
    if "kv cache (kept)" in est["update"]:
        out.append("release the engine's KV cache between rollout and update (rollout.release_cache: true)")
    if "gradients" in est["update"]:
        out.append("the full method over more GPUs with its weights, gradients and states sharded "
                   "(--nproc N, sharding: fsdp)")
    if est["peak_phase"] == "rollout" and not est.get("host_bytes"):
        out.append("the optimizer states in host memory during the rollout (optim.offload: rollout)")
    out.append("a smaller model or a quantized base (method: qerl)")
    return out



MIN_MICRO_WITHOUT_CHECKPOINTING = 2  # auto: below this, checkpointing with a fatter micro-batch (host time per call)
# dense_update auto (with micro_batch_size auto): the dense copy only at micro-batches of at least this many sequences
# and half the one without it. Measured (H100, reports/step): 7B micro-batch 4 with it beats 8 without it (update
# 3.51 / 7.39 s against 3.87 / 8.60 at batch 64 / 128); at micro-batch 2 an update pays its per-call costs twice as
# often (14B QeRL micro-batch 4 without the copy: 8.26 s, bf16 LoRA's micro-batch-2 update — the same GEMMs as the
# copy's — 10.08 s), so 14B keeps micro-batch 4 without it.
MIN_MICRO_DENSE = 4


# The half-group cap below pays off where the update is arithmetic-bound (32B, reports/step); a small model's update is
# host-bound — Python and launches per layer per micro-batch — and wants the fewest micro-batches that fit. Measured
# (H100, 2026-11-26, random 0.5B, 64 sequences of 128 + ~200 tokens, QeRL with dense_update): update 2.31 s at
# micro-batch 4, 0.78 s at 16, 0.54 s at 64 — ~6 ms of host time per decoder layer per micro-batch forward + backward,
# against ~13 ms of arithmetic for a whole micro-batch of 4. The cap applies where the capped micro-batch's arithmetic
# (forward + backward dX at UPDATE_TFLOPS) takes at least its host time (HOST_S_PER_LAYER per decoder layer).
HOST_S_PER_LAYER = 6e-3
UPDATE_TFLOPS = 400.0


def host_bound(s: Shape, micro: int, seq_len: int) -> bool:
    """Whether a micro-batch of ``micro`` sequences of ``seq_len`` tokens is host-bound on a model of shape ``s``: its
    forward + backward arithmetic (``4 x linear weights x tokens`` at :data:`UPDATE_TFLOPS`) takes less than its host
    time (:data:`HOST_S_PER_LAYER` per decoder layer)."""
    return 4.0 * s.linear_weights() * micro * seq_len / (UPDATE_TFLOPS * 1e12) < HOST_S_PER_LAYER * s.layers


def half_group_cap(s: Shape, group: int, gen_len: int) -> bool:
    """Whether micro-batch auto caps a micro-batch at half a GRPO ``group`` (:func:`auto_micro_batch`): groups of at
    least ``2 x MIN_MICRO_DENSE`` whose half-group micro-batch is not :func:`host_bound`."""
    return group >= 2 * MIN_MICRO_DENSE and not host_bound(s, group // 2, PROMPT_TOKENS + gen_len)


def auto_micro_batch(s: Shape, base: str, rows: int, gen_len: int, rank: int = 32, eight_bit: bool = True,
                     checkpointing="auto", available: float | None = None, group: int = 1, **full
                     ) -> tuple[int, bool]:
    """``micro_batch_size: auto``: ``(micro, checkpointing)`` — the largest micro-batch (a power of two up to the
    ``rows`` of a step, or ``rows`` itself; at most half a GRPO ``group``, see below) whose planned peak stays within
    90% of ``available`` (default: the device) without gradient checkpointing (fewer, fatter launches: the update's
    host time per projection is paid once per micro-batch, reports/step), if that is at least
    :data:`MIN_MICRO_WITHOUT_CHECKPOINTING` sequences (or the whole step); else, or where checkpointing is on
    (``True``), the largest that fits with it (at least 1). Measured at 14B, batch 64 (H100, reports/step): QeRL
    micro-batch 4 without checkpointing 25.8 s per step against 29.9 s with it at 32; bf16 LoRA micro-batch 2
    without 33.3 s against 36.2 s at 32 with it.

    Micro-batches are cut from each group's rows sorted by length (:func:`qerl.train.update.by_length`), so one that
    spans a whole group runs every row at the group's longest — with drawn lengths often the cap. Halving it splits
    the long rows from the short: 32B QeRL, one group of 16, checkpointing (H100, reports/step): update 7.82 s at
    micro-batch 16, **5.82 s at 8**, 6.10 s at 4, 7.25 s at 2. Hence at most ``group // 2`` for groups of 8 or more
    (smaller caps would go below the 4 sequences an NVFP4 update wants, :data:`MIN_MICRO_DENSE`) — unless the capped
    micro-batch is host-bound (:func:`host_bound`: small models), where the largest that fits is fastest."""
    budget = 0.9 * (device_bytes() if available is None else available)
    most = group // 2 if half_group_cap(s, group, gen_len) else rows
    sizes = sorted({min(rows, most, 1 << i) for i in range(rows.bit_length() + 1)} | {min(rows, most)}, reverse=True)

    def fits(m: int, ckpt: bool) -> bool:
        return estimate(s, base, rows, PROMPT_TOKENS, gen_len, m, rank, ckpt, eight_bit, True, **full)[
            "peak_bytes"] <= budget

    if checkpointing not in (True, "on", "true"):
        floor = 1 if checkpointing in (False, "off", "false") else min(rows, MIN_MICRO_WITHOUT_CHECKPOINTING)
        for m in sizes:
            if m >= floor and fits(m, False):
                return m, False
    if checkpointing in (False, "off", "false"):
        return 1, False
    return next((m for m in sizes if fits(m, True)), 1), True


def _eight_bit(cfg, sharding: str) -> bool:
    """Whether the optimizer states are 8-bit (bitsandbytes; never under FSDP2): ``optim.eight_bit`` resolved."""
    import importlib.util

    return sharding != "fsdp" and (cfg.optim.eight_bit == "true" or (
        cfg.optim.eight_bit == "auto" and importlib.util.find_spec("bitsandbytes") is not None))


def step_rows(cfg, world: int = 1) -> tuple[int, int]:
    """``(rows, prompts)`` of one process's step: its sequences (``prompts_per_step × group_size / world``) and the
    distinct prompts among them (the engine prefills each once for its group: :func:`estimate`'s ``prompts``)."""
    rows = max(1, cfg.prompts_per_step * cfg.algorithm.group_size // max(1, world))
    return rows, max(1, rows // cfg.algorithm.group_size)


def resolve_micro_batch(cfg, s: Shape, world: int = 1, available: float | None = None):
    """``cfg`` with ``micro_batch_size: auto`` resolved by :func:`auto_micro_batch` for a model of shape ``s``
    (one process of ``world``), and a line saying what was chosen (None when the size was given)."""
    import dataclasses

    from qerl.train.config import resolve_sharding

    if cfg.micro_batch_size != "auto":
        return cfg, None
    method = METHODS[cfg.method]
    sharding = resolve_sharding(cfg, world)
    rows, prompts = step_rows(cfg, world)
    eight = _eight_bit(cfg, sharding)
    group = cfg.algorithm.group_size
    fk = {"dense": cfg.dense_update is True} if method.lora else {"full": True, "world": world, "sharding": sharding}
    fk["prompts"] = prompts
    micro, ckpt = auto_micro_batch(s, method.base, rows, cfg.rollout.max_new_tokens,
                                   cfg.lora.r, eight, cfg.gradient_checkpointing, available, group, **fk)
    said = (f"micro_batch_size auto: {micro} of {rows} sequences per update forward/backward (the largest the "
            f"memory planner fits{' with' if ckpt else ' without'} gradient checkpointing"
            f"{f', at most half a group of {group}' if half_group_cap(s, group, cfg.rollout.max_new_tokens) else ''})")
    if cfg.dense_update == "auto" and method.lora and method.base == "nvfp4" and not ckpt:
        dm, dckpt = auto_micro_batch(s, method.base, rows, cfg.rollout.max_new_tokens, cfg.lora.r, eight, False,
                                     available, group, dense=True, prompts=prompts)
        if not dckpt and dm >= max(MIN_MICRO_DENSE, micro // 2):  # (a size >= 2 returned without checkpointing fits)
            return dataclasses.replace(cfg, micro_batch_size=dm, dense_update=True), (
                f"micro_batch_size auto: {dm} of {rows} sequences per update forward/backward with dense_update "
                f"(the NVFP4 base dequantized once per update phase; without it {micro} would fit)")
        return dataclasses.replace(cfg, micro_batch_size=micro, dense_update=False), said
    return dataclasses.replace(cfg, micro_batch_size=micro), said


def resolve_dense_update(cfg, s: Shape, world: int = 1, available: float | None = None):
    """``cfg`` with ``dense_update: auto`` resolved for a GPU run whose micro-batch is set: on for an NVFP4 LoRA
    method when the planned peak with the dense copy stays within 90% of ``available`` (default: the device).
    (With ``micro_batch_size: auto``, :func:`resolve_micro_batch` decides both: the dense copy at the largest
    micro-batch that fits with it, when that is at least half the one without it and at least
    :data:`MIN_MICRO_DENSE` sequences — measured,
    H100, 7B batch 64 / 128 with realistic lengths: micro-batch 4 with the copy 8.96 / 13.97 s per step against 9.32
    / 15.28 s at micro-batch 8 without it, reports/step.)"""
    import dataclasses

    if cfg.dense_update != "auto":
        return cfg
    method = METHODS[cfg.method]
    if not (method.lora and method.base == "nvfp4") or cfg.micro_batch_size == "auto":
        return dataclasses.replace(cfg, dense_update=False) if cfg.micro_batch_size != "auto" else cfg
    rows, prompts = step_rows(cfg, world)
    eight = _eight_bit(cfg, "none")
    budget = 0.9 * (device_bytes() if available is None else available)
    ckpt = cfg.gradient_checkpointing is True or (cfg.gradient_checkpointing == "auto" and needs_checkpointing(
        s, method.base, rows, PROMPT_TOKENS, cfg.rollout.max_new_tokens, cfg.micro_batch_size, cfg.lora.r, eight,
        budget, prompts=prompts))
    peak = estimate(s, method.base, rows, PROMPT_TOKENS, cfg.rollout.max_new_tokens, cfg.micro_batch_size, cfg.lora.r,
                    ckpt, eight, True, dense=True, prompts=prompts)["peak_bytes"]
    return dataclasses.replace(cfg, dense_update=peak <= budget)


TOKEN_STEP = 256  # micro_batch_tokens auto: a multiple of this many tokens


def auto_micro_tokens(s: Shape, base: str, rows: int, gen_len: int, rank: int = 32, eight_bit: bool = True,
                      checkpointing: bool = False, available: float | None = None, **full) -> int | None:
    """``micro_batch_tokens: auto``: the most real tokens one packed update micro-batch may hold — the largest
    multiple of :data:`TOKEN_STEP` (or all ``rows x (PROMPT_TOKENS + gen_len)`` tokens of the step) whose planned peak
    (:func:`estimate` with ``update_tokens``) stays within 90% of ``available`` (default: the device), with or without
    gradient ``checkpointing``; None where not even one sequence of ``PROMPT_TOKENS + gen_len`` tokens fits.

    Packed micro-batches (:mod:`qerl.ops.packed`) hold real tokens only, so a budget in tokens is what memory bounds;
    the rows a micro-batch takes then depend on the rollout's lengths, not on the longest a row could be. Measured
    (H100, 7B QeRL, batch 64, realistic lengths, packed, no checkpointing; reports/step): update 3.94 s at 4 rows a
    micro-batch, 2.55 s at 8, 2.46 s at 16 (peak 72.8 GB)."""
    budget = 0.9 * (device_bytes() if available is None else available)
    T = PROMPT_TOKENS + gen_len

    def fits(n: int) -> bool:
        return estimate(s, base, rows, PROMPT_TOKENS, gen_len, 1, rank, checkpointing, eight_bit, True,
                        update_tokens=n, **full)["peak_bytes"] <= budget

    if fits(rows * T):
        return rows * T
    if not fits(T):
        return None
    lo, hi = T, rows * T  # fits(lo), not fits(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return max(T, lo // TOKEN_STEP * TOKEN_STEP)


def update_tokens(cfg) -> int | None:
    """A resolved config's tokens per update micro-batch (``micro_batch_tokens`` as an int), or None (rows)."""
    t = cfg.micro_batch_tokens
    return t if isinstance(t, int) and not isinstance(t, bool) else None


def resolve_micro_tokens(cfg, s: Shape, world: int = 1, available: float | None = None, rows_auto: bool = True,
                         dense_auto: bool = False):
    """``cfg`` with ``micro_batch_tokens: auto`` resolved for a GPU run of a model of shape ``s`` (one process of
    ``world``), and a line saying what was chosen (None when nothing was). On where the micro-batch size was left to
    the planner (``rows_auto``: the config said ``micro_batch_size: auto``) and the update may pack
    (``packed_sequences`` not false): the :func:`auto_micro_tokens` budget without gradient checkpointing if one
    longest sequence fits in it (``gradient_checkpointing: auto`` then resolves off), else with it (auto: on);
    ``gradient_checkpointing: true`` / ``false`` are kept. Elsewhere ``micro_batch_tokens`` resolves to false (the
    micro-batches hold ``micro_batch_size`` rows).

    ``dense_auto`` (the config said ``dense_update: auto``; an NVFP4 LoRA method): the dense copy only where it costs
    no tokens, i.e. the budget with it is the budget without it (the whole step fits either way). Its bf16 weights
    otherwise take the memory of fewer, fuller micro-batches, which is worth more (H100, batch 64, realistic lengths,
    reports/step): 14B QeRL update 7.18 s with the copy (2,816 tokens) against 5.05 s without (5,632 tokens); 7B
    2.29 s (8,192) against 2.27 s (10,496)."""
    import dataclasses

    from qerl.train.config import resolve_sharding

    if cfg.micro_batch_tokens != "auto":
        return cfg, None
    off = dataclasses.replace(cfg, micro_batch_tokens=False)
    if not rows_auto or cfg.packed_sequences is False:
        return off, None
    method = METHODS[cfg.method]
    sharding = resolve_sharding(cfg, world)
    rows, prompts = step_rows(cfg, world)
    fk = {"full": True, "world": world, "sharding": sharding} if not method.lora else {}
    args = (s, method.base, rows, cfg.rollout.max_new_tokens, cfg.lora.r, _eight_bit(cfg, sharding))
    choose = dense_auto and method.lora and method.base == "nvfp4"
    denses = (False, True) if choose else (cfg.dense_update is True,)
    for ckpt in (False, True):
        if cfg.gradient_checkpointing is (not ckpt):  # (a setting given as true / false is kept)
            continue
        got = {d: auto_micro_tokens(*args, checkpointing=ckpt, available=available, prompts=prompts,
                                    **({"dense": d} if method.lora else fk)) for d in denses}
        if got[denses[0]] is None:
            continue
        dense = got[True] is not None and got[True] >= got[False] if choose else denses[0]
        n = got[dense]
        new = dataclasses.replace(cfg, micro_batch_tokens=n, gradient_checkpointing=ckpt,
                                  dense_update=dense if method.lora else cfg.dense_update)
        return new, (
            f"micro_batch_tokens auto: {n} real tokens per update micro-batch, packed (the most the memory "
            f"planner fits{' with' if ckpt else ' without'} gradient checkpointing"
            + (f", dense_update {str(dense).lower()}" if choose else "")
            + f"; micro_batch_size {cfg.micro_batch_size} is the rows a micro-batch of the longest sequences would "
              "hold)")
    return off, None


def plan_config(cfg, shape: str | None = None, available: float | None = None, world: int = 1,
                config_path: str | Path | None = None) -> dict:
    """The estimate for a :class:`~qerl.train.config.TrainConfig` (``shape``: a Qwen2.5 size instead of the
    model's ``config.json``; ``config_path``: that file where ``model.path`` is a hub id, the downloaded copy's;
    ``world``: data-parallel processes, each holding ``1/world`` of a step's sequences):
    ``{"estimate", "fits", "available", "advice", "markdown"}`` for one process."""
    import json
    from pathlib import Path

    from qerl.train.config import ConfigError

    if shape is not None:
        s = QWEN25[shape]
    else:
        path = Path(config_path) if config_path is not None else Path(cfg.model.path) / "config.json"
        if not path.exists():
            raise ConfigError(f"{path}: no config.json to plan from (a local model directory is needed; "
                              "or pass --shape 3B|7B|14B|32B)")
        s = Shape.from_config(json.loads(path.read_text()))
    from qerl.train.config import resolve_sharding

    rows_auto, dense_auto = cfg.micro_batch_size == "auto", cfg.dense_update == "auto"
    if rows_auto:
        cfg, _ = resolve_micro_batch(cfg, s, world, available)
    cfg = resolve_dense_update(cfg, s, world, available)
    cfg, _ = resolve_micro_tokens(cfg, s, world, available, rows_auto, dense_auto)
    tokens = update_tokens(cfg)
    method = METHODS[cfg.method]
    full = not method.lora
    sharding = resolve_sharding(cfg, world)
    rows, prompts = step_rows(cfg, world)
    gen = cfg.rollout.max_new_tokens
    eight = _eight_bit(cfg, sharding)
    fk = {"full": full, "world": world, "sharding": sharding, "dense": cfg.dense_update is True, "prompts": prompts,
          "update_tokens": tokens}
    available = device_bytes() if available is None else available
    mode = cfg.gradient_checkpointing
    ckpt = mode is True or (mode == "auto" and needs_checkpointing(
        s, method.base, rows, PROMPT_TOKENS, gen, cfg.micro_batch_size, cfg.lora.r, eight, 0.9 * available,
        cfg.rollout.release_cache is not False, **fk))
    release = cfg.rollout.release_cache
    if release == "auto":  # keep the engine's cache (no recapture per step) when the update fits beside it
        release = full or estimate(s, method.base, rows, PROMPT_TOKENS, gen, cfg.micro_batch_size, cfg.lora.r, ckpt,
                                   eight, False, **fk)["peak_bytes"] > KEEP_CACHE_FRACTION * available
    args = (s, method.base, rows, PROMPT_TOKENS, gen, cfg.micro_batch_size, cfg.lora.r, ckpt, eight, release)
    est = estimate(*args, **fk)
    offload = cfg.optim.offload == "rollout"
    if offload or (cfg.optim.offload == "auto" and est["peak_bytes"] > OFFLOAD_FRACTION * available):
        parked = estimate(*args, **fk, offload=True)
        if offload or parked["peak_bytes"] < est["peak_bytes"]:  # auto: when it lowers the peak (a rollout peak)
            offload = True
    est = estimate(*args, **fk, offload=offload, available=available)
    fits = est["peak_bytes"] <= available
    title = (f"{cfg.method}, {rows} sequences{f' per process ({world} processes)' if world > 1 else ''} × "
             f"({PROMPT_TOKENS} + {gen}) tokens, micro-batch "
             f"{cfg.micro_batch_size}{f' (packed: at most {tokens} tokens)' if tokens else ''}, "
             f"{'all weights trained, sharding ' + sharding if full else f'LoRA r={cfg.lora.r}'}, "
             f"checkpointing {'on' if ckpt else 'off'}, " + ("dense update, " if fk["dense"] else "") +
             f"{'8-bit' if eight else 'fp32'} AdamW, engine cache {'released' if release else 'kept'} between steps"
             + (f", optimizer states in host memory during the rollout ({est['host_bytes'] / 1e9:.1f} GB per process)"
                if offload else "")
             + (f", rollout {est['wave_rows']} sequences at once (the KV cache of every sequence does not fit; "
                f"up to {est['waves']} rounds)" if est["waves"] > 1 else ""))
    md = markdown(est, title, available)
    tips = [] if fits else advice(est, available, ckpt, cfg.micro_batch_size)
    if tips:
        md += "\nTo fit: " + "; ".join(tips) + ".\n"
    return {"estimate": est, "fits": fits, "available": available, "checkpointing": ckpt, "advice": tips,
            "release_cache": release, "offload": offload, "markdown": md}


KEEP_CACHE_FRACTION = 0.85  # release_cache: auto keeps the cache when the planned peak with it stays below this
OFFLOAD_FRACTION = 0.9  # optim.offload: auto parks the optimizer states during the rollout above this share


def keep_engine_cache(cfg, world: int = 1, memory: dict | None = None) -> bool:
    """``rollout.release_cache`` resolved for this run: ``false`` -> keep, ``true`` -> release; ``auto`` -> keep
    when the planned peak with the cache kept stays below :data:`KEEP_CACHE_FRACTION` of the GPU (CUDA, a local
    model with a ``config.json``, a LoRA method), else release (also when the planner cannot tell). ``memory``: the
    run's memory plan where it was made already (:func:`check_fits`), read instead of planning again."""
    mode = cfg.rollout.release_cache
    if mode in (True, False):
        return not mode
    from pathlib import Path

    if not METHODS[cfg.method].lora:
        return False
    if memory is not None:
        return not memory["release_cache"]
    if not (Path(cfg.model.path) / "config.json").exists():
        return False
    return not plan_config(cfg, world=world)["release_cache"]


def check_fits(cfg, hf_config_path, available: float | None = None, world: int = 1) -> dict:
    """Raise :class:`~qerl.train.config.ConfigError` with the estimate's parts when ``cfg`` cannot fit the
    current CUDA device (called by ``qerl train`` before loading the model; ``world`` processes share a step).
    Returns the plan (:func:`plan_config`) when it fits."""
    from qerl.train.config import ConfigError

    res = plan_config(cfg, available=available, world=world, config_path=hf_config_path)
    if not res["fits"]:
        e = res["estimate"]
        parts = ", ".join(f"{k} {v / 1e9:.1f}" for g in ("static", e["peak_phase"]) for k, v in e[g].items() if v > 1e8)
        raise ConfigError(f"{hf_config_path}: this configuration needs ~{e['peak_gb']:.1f} GB at its "
                          f"{e['peak_phase']} phase (GB: {parts}); the GPU has {res['available'] / 1e9:.1f} GB. "
                          f"To fit: {'; '.join(res['advice'])} (estimate: `qerl plan --config ...`)")
    return res
