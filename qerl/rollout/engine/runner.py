"""The rollout engine: batched sampling on the trainer's own model with a slot KV cache, decode steps
replayed from CUDA graphs, sampling on the device and finished rows compacted away.

One ``generate`` call (same signature and :class:`~qerl.rollout.sampler.Rollout` as the reference sampler):

1. sync: the active LoRA adapters are copied into the engine's activation-dtype buffers and the AQN noise
   drawn on the norms (:func:`qerl.rl.aqn.active_noise`) into its fp32 buffers — the graphs read those fixed addresses, so an
   optimizer step or a new noise draw needs no re-capture, and the model's own weights are never written (except
   with ``weight_layout="tiled"``: the NVFP4 weights reordered in place for the call and restored after it);
2. plan: the KV cache (one slot of ``prompt + max_new_tokens`` positions per row) is sized from free memory;
   rows that do not fit wait, and each slot a finished row frees goes to the next waiting row (prefilled at the
   next host check, then decoded beside the others: every row carries its own generation step);
3. prefill (SDPA) writes each row's prompt into its slot and samples the first token — once per distinct prompt:
   the other samples of a GRPO group get a copy of its K/V and draw their own first token from its logits;
4. decode: each step reads the rows' tokens / positions / slots from static buffers, writes K/V, attends
   (Triton flash-decoding on CUDA), samples (:mod:`~qerl.rollout.sampling`) and records token and
   log-prob on the device. Steps are replayed ``check_every`` at a time without a host sync; then the host
   reads the finished flags (EOS on the device; stop strings decoded on the host for the new tokens only) and,
   when the live rows fit a smaller batch bucket, continues with that bucket's graph on the live rows only
   (their KV stays in place: rows point at slots). A finished row thus costs at most ``check_every`` steps.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import math
import time

import torch

from qerl.rollout.engine import forward as fw
from qerl.rollout.engine.model_view import EngineUnsupported, restore_weight_layout, set_weight_layout, view_model
from qerl.rl.aqn import active_noise
from qerl.rollout.sampler import Rollout, encode_prompts
from qerl.rollout.sampling import SamplingSettings, row_budget, row_seeds, sample

PREFILL_TOKENS = 8192  # prompt positions per prefill call (rows chunked so the activations stay bounded)
#: KV cache positions are allocated in multiples of this: a real run's longest prompt grows over its first steps, and
#: each larger cache meant new decode graphs (0.2-3 s of captures a step for a real 0.5B model, issue 45)
POSITION_STEP = 256
#: ``last_stats`` keys splitting a ``generate`` call's time: prompts prefilled, decode graphs captured, and the GPU
#: idle while the host checked for finished rows between windows of decode steps (the rest is decoding)
SPLIT = ("prefill_s", "capture_s", "host_s")
#: the engines' default ``weight_layout``: ``rows`` (the checkpoint's), ``tiled`` (each generation reorders the NVFP4
#: weights in place into the tile-contiguous layout and back: the decode kernels' 4 KB steps are contiguous,
#: reports/kernels "Tile-contiguous weights") or ``auto`` (on CUDA, tiled where the decode batch's routed config reads
#: the layout as tuned, :func:`qerl_kernels.ops.tiled_keeps`; rows elsewhere. On an H100 the 7B rollout made 2,115 /
#: 10,569 tok/s at batch 8 / 64 tiled against 2,003 / 10,415 row-major, one machine, reports/rollout).
#: ``qerl bench rollout --weight-layout`` sets it
WEIGHT_LAYOUT = ["auto"]
#: the decode step's launch chain (:func:`qerl_kernels.launch.chain`): its graphs captured with every kernel that can
#: launched as a programmatic dependent of the one before — it starts, and a projection streams its first weights,
#: while the previous kernel still runs. ``qerl bench rollout --pdl-chain off`` turns it off
PDL_CHAIN = [True]

log = logging.getLogger(__name__)


def _torch_attention(q, kc, vc, slot, lengths, scale):
    """Decode attention in plain torch (the reference of ``qerl_kernels.decode_attention``)."""
    B, Hq, D = q.shape
    Hkv = kc.shape[2]
    k, v = kc[slot].float(), vc[slot].float()
    s = torch.einsum("bhgd,bthd->bhgt", q.float().view(B, Hkv, Hq // Hkv, D), k) * scale
    keep = torch.arange(k.shape[1], device=q.device)[None, :] < lengths[:, None]
    p = s.masked_fill(~keep[:, None, None, :], float("-inf")).softmax(-1)
    return torch.einsum("bhgt,bthd->bhgd", p, v).reshape(B, Hq, D).to(q.dtype)


def _triton_attention():
    from qerl_kernels.decode_attention import decode_attention

    return decode_attention


def _triton_sampler():
    from qerl_kernels.sample import gumbel_sample

    return gumbel_sample


def shared_prompts(right: torch.Tensor, plen: torch.Tensor, rows: list[int]) -> list[int]:
    """For each of ``rows`` (of the right-padded prompts ``right [N, P]`` with lengths ``plen [N]``) the position in
    ``rows`` of the first row with the same prompt — itself when it is the first."""
    first: dict = {}
    return [first.setdefault(right[r, : int(plen[r])].numpy().tobytes(), j) for j, r in enumerate(rows)]


def buckets(n: int) -> list[int]:
    """Batch-size buckets up to n: powers of two, then n."""
    out = [1 << i for i in range(max(1, n).bit_length()) if 1 << i < n]
    return out + [n]


class _Bucket:
    """Static inputs of the decode step for ``size`` rows (+ its CUDA graph once captured)."""

    def __init__(self, size: int, device):
        self.size = size
        self.tok = torch.zeros(size, dtype=torch.long, device=device)
        self.pos = torch.zeros(size, dtype=torch.long, device=device)
        self.slot = torch.zeros(size, dtype=torch.long, device=device)
        self.seed = torch.zeros(size, dtype=torch.long, device=device)
        self.col = torch.zeros(size, dtype=torch.long, device=device)  # each row's generation step
        self.graph = None


class RolloutEngine:
    """See module docstring. ``attention``: ``auto`` (Triton on CUDA, torch elsewhere) | ``triton`` |
    ``torch``. ``graphs``: capture decode steps in CUDA graphs (default: on CUDA when every projection runs
    on plain tensors; NF4 through bitsandbytes runs eagerly). ``check_every``: decode steps between host
    syncs. ``max_slots``: cap on rows decoded together (default: what free memory allows). ``fuse``: run
    q/k/v and gate/up as one projection each (their base tensors moved into one buffer that the modules view:
    :func:`~qerl.rollout.engine.model_view.fuse`). ``compile``: RMSNorm and rotary through ``torch.compile``
    (:class:`~qerl.rollout.engine.forward.Elementwise`; default: when CUDA graphs are used). ``sampler``: ``auto``
    (the fused Triton draw, ``qerl_kernels.sample``, on CUDA; torch elsewhere) | ``triton`` | ``torch``
    (:func:`~qerl.rollout.sampling.sample`, the definition; also whenever top-k / top-p filter). ``share_prompts``:
    rows with the same prompt (``num_samples`` > 1: a GRPO group) prefilled once, its K/V copied to the others
    (``last_stats["prefill_rows"]``: the rows actually prefilled). ``weight_layout``: ``auto`` | ``rows`` | ``tiled``
    (default :data:`WEIGHT_LAYOUT`; ``tiled``: each ``generate`` reorders the NVFP4 weights in place into the
    tile-contiguous layout and back, ``last_stats["layout_s"]``; ``auto``: on CUDA the projections whose decode
    config stays as tuned on tiled weights, :func:`qerl_kernels.ops.tiled_keeps`; rows elsewhere). ``nf4``: an NF4
    (bitsandbytes) base run ``eager`` through its modules or ``dense`` from weights dequantized once
    (:func:`~qerl.rollout.engine.model_view.view_model`; ``SamplingSettings.nf4_weights``)."""

    def __init__(self, model, tokenizer, attention: str = "auto", graphs: bool | None = None,
                 check_every: int = 16, max_slots: int | None = None, fuse: bool = True, compile: bool | None = None,
                 sampler: str = "auto", share_prompts: bool = True, weight_layout: str | None = None,
                 nf4: str = "eager"):
        self.tokenizer = tokenizer  # (the model object is not kept: the registry of qerl.rollout.engine keys it weakly)
        layout = WEIGHT_LAYOUT[0] if weight_layout is None else weight_layout
        if layout not in ("auto", "rows", "tiled"):
            raise ValueError(f"weight_layout must be auto, rows or tiled, got {layout!r}")
        self.context = getattr(getattr(model, "config", None), "max_position_embeddings", None)
        self.nf4 = nf4
        self.view = view_model(model, fuse_siblings=fuse, nf4=nf4)
        self.device = self.view.device
        cuda = self.device.type == "cuda"
        self.weight_layout = "rows" if layout == "auto" and not cuda else layout
        if attention not in ("auto", "triton", "torch"):
            raise ValueError(f"attention must be auto, triton or torch, got {attention!r}")
        use_triton = attention == "triton" or (attention == "auto" and cuda)
        self.attention = _triton_attention() if use_triton else _torch_attention
        if sampler not in ("auto", "triton", "torch"):
            raise ValueError(f"sampler must be auto, triton or torch, got {sampler!r}")
        self._gumbel = _triton_sampler() if sampler == "triton" or (sampler == "auto" and cuda) else None
        self.use_graphs = (cuda and self.view.graphable) if graphs is None else bool(graphs)
        if self.use_graphs and not (cuda and self.view.graphable):
            raise EngineUnsupported("CUDA graphs need a CUDA model whose projections are all NVFP4 or dense")
        self.ew = fw.Elementwise(self.use_graphs if compile is None else bool(compile))
        if check_every < 1:
            raise ValueError(f"check_every must be >= 1, got {check_every}")
        self.check_every, self.max_slots, self.share_prompts = check_every, max_slots, bool(share_prompts)
        self.kc = self.vc = None
        self.cos = self.sin = None
        self._buckets: dict = {}
        self._warmed: set = set()  # decode-step shapes already run eagerly (compiled) in this process: kept by release()
        self._synced = None  # when the last host check's sync returned (host_s: the GPU's idle time until the next launch)
        self._pool = None
        for n in [layer.input_norm for layer in self.view.layers] + [layer.post_norm for layer in self.view.layers] + [
                self.view.final_norm]:
            n.noise = torch.zeros(n.weight.shape, dtype=torch.float32, device=self.device)
        self.last_stats: dict = {}

    # -- state shared with the graphs -------------------------------------------------------------------
    def _sync(self) -> bool:
        """Adapters and AQN noise into the engine's buffers; returns whether noise is active."""
        for p in self.view.projs:
            before = (p.a.data_ptr() if p.a is not None else None)
            p.sync(self.view.dtype)
            if p.a is not None and before is not None and p.a.data_ptr() != before:
                self._buckets.clear()  # reallocated adapter buffers: graphs would read stale memory
        noisy = False
        norms = [n for layer in self.view.layers for n in (layer.input_norm, layer.post_norm)] + [self.view.final_norm]
        for n in norms:
            z = active_noise(n.module)
            if z is None:
                n.noise.zero_()
            else:
                n.noise.copy_(z)
                noisy = True
        return noisy

    def _ensure_cache(self, slots: int, positions: int) -> None:
        """A KV cache of at least ``slots`` slots of ``positions`` positions (kept when the present one is as large).
        A new one holds positions rounded up to :data:`POSITION_STEP` (at most the model's context): a step whose
        longest prompt is a few tokens longer reuses it and its captured graphs instead of capturing them again."""
        L, Hkv, D = len(self.view.layers), self.view.kv_heads, self.view.head_dim
        if self.kc is not None and self.kc[0].shape[0] >= slots + 1 and self.kc[0].shape[1] >= positions:
            return
        positions = max(positions, min(self.context or positions, -(-positions // POSITION_STEP) * POSITION_STEP))
        self.release()
        shape = (slots + 1, positions, Hkv, D)  # the last slot takes the padding rows of a bucket
        self.kc = [torch.zeros(shape, dtype=self.view.dtype, device=self.device) for _ in range(L)]
        self.vc = [torch.zeros(shape, dtype=self.view.dtype, device=self.device) for _ in range(L)]
        self.cos, self.sin = fw.rope_tables(self.view, positions)
        self.gen_tok = self.gen_lp = None

    def release(self) -> None:
        """Free the KV cache and the captured graphs (e.g. before a training update)."""
        self.kc = self.vc = None
        self._buckets.clear()
        self._pool = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def kv_bytes_per_slot(self, positions: int) -> int:
        v = self.view
        return 2 * len(v.layers) * positions * v.kv_heads * v.head_dim * torch.tensor([], dtype=v.dtype).element_size()

    def _plan_slots(self, rows: int, positions: int) -> int:
        if self.max_slots:
            rows = min(rows, self.max_slots)
        if self.device.type != "cuda":
            return rows
        per = self.kv_bytes_per_slot(positions)
        have = 0 if self.kc is None else per * (self.kc[0].shape[0] - 1) * (self.kc[0].shape[1] >= positions)
        free, _ = torch.cuda.mem_get_info(self.device)
        free += torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device) + have
        work = 2 * 1024 ** 3 + 24 * rows * self.view.vocab  # logits + sampling temporaries, graph pool
        fit = int((free - work) // per)
        if fit < 1:
            raise torch.cuda.OutOfMemoryError(
                f"rollout engine: one sequence of {positions} positions needs {per / 2**30:.2f} GiB of KV cache "
                f"+ {work / 2**30:.1f} GiB of work space; {free / 2**30:.1f} GiB free on {self.device}")
        return min(rows, fit)

    def sample(self, logits: torch.Tensor, s: SamplingSettings, seed: torch.Tensor, step: torch.Tensor):
        """``logits [B, V]`` fp32 -> (tokens, log-probs): the fused kernel when it applies (no top-k / top-p
        filter), else :func:`~qerl.rollout.sampling.sample` — the same tokens (``tests/kernels/test_sample.py``)."""
        if self._gumbel is not None and not s.top_k and s.top_p >= 1.0:
            return self._gumbel(logits, seed, step, s.temperature)
        return sample(logits, s, seed, step)

    # -- one decode step, eager or as a CUDA graph ---------------------------------------------------------
    def _step(self, b: _Bucket, s: SamplingSettings, noisy: bool) -> None:
        logits = fw.decode_step(self.view, self.kc, self.vc, self.cos, self.sin, b.tok, b.pos, b.slot, noisy,
                                self.attention, self.ew)
        tok, lp = self.sample(logits, s, b.seed, b.col)
        self.gen_tok.index_put_((b.slot, b.col), tok)
        self.gen_lp.index_put_((b.slot, b.col), lp)
        b.tok.copy_(tok)
        b.pos.add_(1)
        b.col.add_(1)

    def _bucket(self, size: int, s: SamplingSettings, noisy: bool) -> _Bucket:
        key = (size, s.temperature, s.top_p, s.top_k, noisy, self.kc[0].shape)
        b = self._buckets.get(key)
        if b is not None:
            return b
        b = _Bucket(size, self.device)
        self._buckets[key] = b
        if not self.use_graphs:
            return b
        t0 = time.perf_counter()
        dummy = self.kc[0].shape[0] - 1
        b.slot.fill_(dummy)
        b.col.zero_()  # warm-up and capture write generation columns 0..2 of the dummy slot only
        # compile / autotune outside the capture: twice the first time this step's shapes run, not again when the
        # graph is captured anew (after release(), between training steps: the KV cache moved) — a warm-up is an
        # eager decode step, tens of ms of host time each (reports/step: 0.9 -> 0.3 s of a 7B rollout's captures)
        shapes = key[:5] + (tuple(self.kc[0].shape[1:]), self.gen_tok.shape[1])
        with _launch_mode("graph"), _chain(PDL_CHAIN[0]):  # (the warm-up compiles what the capture launches)
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(0 if shapes in self._warmed else 2):
                    self._step(b, s, noisy)
            torch.cuda.current_stream(self.device).wait_stream(side)
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            b.graph = torch.cuda.CUDAGraph()
            # relaxed: Triton's launcher may query the driver (allowed; nothing allocates outside the pool)
            with torch.cuda.graph(b.graph, pool=self._pool, capture_error_mode="relaxed"):
                self._step(b, s, noisy)
        self._warmed.add(shapes)
        b.pos.zero_()
        b.col.zero_()
        torch.cuda.synchronize(self.device)
        self._timing["capture_s"] += time.perf_counter() - t0
        if self._synced is not None:
            self._synced = time.perf_counter()  # (host_s counts the checks' idle time, not the capture's)
        return b

    def _run_steps(self, b: _Bucket, n: int, s: SamplingSettings, noisy: bool) -> None:
        for _ in range(n):
            if b.graph is not None:
                b.graph.replay()
            else:
                self._step(b, s, noisy)

    # -- generate -------------------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, prompts: list[str], settings: SamplingSettings, seed: int = 0, num_samples: int = 1,
                 first_row: int = 0, eos_at=None) -> Rollout:
        """See the module docstring. ``eos_at`` (benchmarks; a sequence of one length per row): row ``i`` ends
        after ``eos_at[i]`` tokens as if it had sampled EOS there — found at the next host check like an EOS,
        its slot refilled, the row counted as ended — so a random-weight model that never samples EOS runs a
        completion-length distribution (:mod:`qerl.bench.lengths`)."""
        tk = self.tokenizer
        eos, pad, ids, mask = encode_prompts(tk, prompts, num_samples)
        n, P = ids.shape
        plen = mask.sum(1)
        if int(plen.min()) < 1:
            raise ValueError("rollout engine: an empty prompt (no tokens after tokenization)")
        G = settings.max_new_tokens
        limit = self.context
        if limit and P + G > limit:
            raise ValueError(f"rollout engine: prompt of {P} tokens + max_new_tokens {G} = {P + G} positions exceeds "
                             f"the model's max_position_embeddings {limit}")
        self._timing = {"prefill_s": 0.0, "capture_s": 0.0, "decode_s": 0.0, "host_s": 0.0, "prefill_rows": 0}
        self._synced = None
        noisy = self._sync()
        slots = self._plan_slots(n, P + G)
        self._ensure_cache(slots, P + G)
        S = self.kc[0].shape[0]
        if self.gen_tok is None or self.gen_tok.shape != (S, G):
            self._buckets.clear()  # the graphs write into these buffers
            self.gen_tok = torch.zeros(S, G, dtype=torch.long, device=self.device)
            self.gen_lp = torch.zeros(S, G, dtype=torch.float32, device=self.device)
        right = torch.full((n, P), pad, dtype=torch.long)
        for i in range(n):  # right-padded copy: row i's prompt at positions 0 .. plen_i - 1
            right[i, : plen[i]] = ids[i, P - plen[i]:]
        seeds = row_seeds(seed, first_row, n)
        comp_tok = torch.full((n, G), pad, dtype=torch.long)
        comp_lp = torch.zeros(n, G)
        ends = torch.full((n,), G, dtype=torch.long)  # generated length per row
        ended = torch.zeros(n, dtype=torch.bool)
        self._eos_at = row_budget(eos_at, n, G)
        ctx = _launch_mode("graph") if self.use_graphs else contextlib.nullcontext()
        with self.weights_in_layout(slots), ctx:
            steps_run, later = self._run_rows(n, slots, right, plen, seeds, settings, noisy, comp_tok, comp_lp, ends,
                                              ended, eos)
        T = int(ends.max())
        cmask = (torch.arange(G)[None, :] < ends[:, None]).long()[:, :T]
        comp = torch.where(cmask.bool(), comp_tok[:, :T], torch.full_like(comp_tok[:, :T], pad))
        lps = torch.where(cmask.bool(), comp_lp[:, :T], torch.zeros_like(comp_lp[:, :T]))
        texts = [tk.decode(comp[i][cmask[i].bool()].tolist(), skip_special_tokens=True) for i in range(n)]
        self.last_stats = {"rows": n, "slots": slots, "waves": math.ceil(n / slots), "admitted_later": later,
                           "decode_steps": steps_run, "graphs": self.use_graphs, **self._timing}
        dev = self.device
        return Rollout(ids.to(dev), mask.to(dev), comp.to(dev), cmask.to(dev), lps.to(dev), (~ended).to(dev), texts)

    @contextlib.contextmanager
    def weights_in_layout(self, rows: int = 8):
        """Inside: the NVFP4 weights in the engine's ``weight_layout`` — with ``tiled`` (``auto``: the projections
        whose forward of ``rows`` rows, the decode batch, keeps its tuned config on tiled weights), reordered in
        place into the tile-contiguous layout on entry and back to the modules' own layout on exit, whatever happens
        inside
        (:func:`~qerl.rollout.engine.model_view.set_weight_layout`; the time goes to ``last_stats["layout_s"]``).
        The model's own forward must not run inside."""
        if self.weight_layout == "rows":
            yield
            return
        keep = None
        if self.weight_layout == "auto":
            from qerl_kernels.ops import tiled_keeps

            keep = functools.partial(tiled_keeps, rows, device=self.device)  # (N, K) -> bool
        timing = getattr(self, "_timing", None)
        t0 = self._clock()
        moved = set_weight_layout(self.view, True, keep)
        spent = self._clock() - t0
        try:
            yield
        finally:
            t1 = self._clock()
            restore_weight_layout(self.view)
            spent += self._clock() - t1
            if timing is not None and moved:  # (none moved: a bf16 model, or no whole tiles)
                timing["layout_s"] = timing.get("layout_s", 0.0) + spent
                timing["tiled_projs"] = moved

    def _prefill(self, rows: list[int], slots: list[int], right, plen, seeds, s, noisy) -> None:
        """Prompts of ``rows`` into ``slots`` (row chunks of ``PREFILL_TOKENS`` positions) and their first tokens
        (generation step 0) into ``gen_tok`` / ``gen_lp``. Rows with the same prompt (a GRPO group's samples) are
        prefilled once (``share_prompts``): the others get a copy of its K/V and draw their first token, each with
        its own seed, from its logits."""
        dev = self.device
        t0 = self._clock()
        rt = torch.tensor(rows)
        src = shared_prompts(right, plen, rows) if self.share_prompts else list(range(len(rows)))
        uniq = sorted(set(src))
        r, slot_of = torch.tensor([rows[j] for j in uniq]), torch.tensor([slots[j] for j in uniq], device=dev)
        step0 = torch.zeros((), dtype=torch.long, device=dev)
        chunk = max(1, PREFILL_TOKENS // right.shape[1])
        logits = []
        for c0 in range(0, len(uniq), chunk):  # prefill in row chunks (bounded activations)
            sl = slice(c0, min(len(uniq), c0 + chunk))
            ids = right[r[sl]].to(dev)
            P = int(plen[r[sl]].max())
            logits.append(fw.prefill(self.view, self.kc, self.vc, self.cos, self.sin, ids[:, :P], plen[r[sl]].to(dev),
                                     slot_of[sl], noisy, self.ew))
        at = {j: i for i, j in enumerate(uniq)}
        pick = torch.tensor([at[j] for j in src], device=dev)
        copies = [(slots[src[j]], slots[j]) for j in range(len(rows)) if src[j] != j]
        if copies:  # the shared prompt's K/V into the other slots of its group (positions past a prompt are junk,
            P = int(plen[rt].max())  # rewritten by decoding before anything reads them)
            a, b = (torch.tensor(x, device=dev) for x in zip(*copies))
            for kc, vc in zip(self.kc, self.vc):
                kc[b, :P] = kc[a, :P]
                vc[b, :P] = vc[a, :P]
        all_slots = torch.tensor(slots, device=dev)
        tok, lp = self.sample(torch.cat(logits)[pick], s, seeds[rt].to(dev), step0)
        self.gen_tok[all_slots, 0] = tok
        self.gen_lp[all_slots, 0] = lp
        self._timing["prefill_s"] += self._clock() - t0
        self._timing["prefill_rows"] += len(uniq)

    def _run_rows(self, n, slots, right, plen, seeds, s, noisy, comp_tok, comp_lp, ends, ended, eos):
        """Generate rows ``0 .. n-1`` on ``slots`` KV slots: the first ``slots`` rows start together; every
        ``check_every`` steps the host reads the finished rows out, hands their slots to waiting rows (prefilled
        then) and continues with a batch bucket of the live rows, each at its own generation step. Fills the
        outputs; returns (decode steps run, rows admitted after the start)."""
        dev, G = self.device, s.max_new_tokens
        waiting = list(range(n))
        free = list(range(slots))
        live: dict[int, list] = {}  # slot -> [row, generated tokens t, tokens checked for stop strings, stop at]
        steps = later = 0
        capture0, t_start = self._timing["capture_s"], self._clock()
        prefill0 = self._timing["prefill_s"]
        while True:
            if waiting and free:
                take = min(len(waiting), len(free))
                rows, use = waiting[:take], free[:take]
                waiting, free = waiting[take:], free[take:]
                later += take if steps else 0
                self._prefill(rows, use, right, plen, seeds, s, noisy)
                for row, sl in zip(rows, use):
                    live[sl] = [row, 1, 0, None]
            done = self._finished_slots(live, eos, s, G)
            for sl in done:
                self._finish(sl, live.pop(sl), comp_tok, comp_lp, ends, ended, eos)
                free.append(sl)
            if done and waiting:
                continue  # admit into the freed slots before decoding on
            if not live:
                break
            order = sorted(live)
            size = next(x for x in buckets(len(self.kc[0]) - 1) if x >= len(order))
            b = self._bucket(size, s, noisy)
            pad = size - len(order)
            lv = torch.tensor(order, device=dev)
            rows_t = torch.tensor([live[sl][0] for sl in order])
            t_t = torch.tensor([live[sl][1] for sl in order])
            zeros = torch.zeros(pad, dtype=torch.long, device=dev)
            b.slot.copy_(torch.cat([lv, torch.full((pad,), self.kc[0].shape[0] - 1, device=dev)]))
            b.tok.copy_(torch.cat([self.gen_tok[lv, t_t.to(dev) - 1], zeros]))
            b.pos.copy_(torch.cat([(plen[rows_t] + t_t - 1).to(dev), zeros]))
            b.seed.copy_(torch.cat([seeds[rows_t].to(dev), zeros]))
            b.col.copy_(torch.cat([t_t.to(dev), zeros]))
            k = min(self.check_every, G - int(t_t.max()))  # (every live row has t < G)
            if self._synced is not None:  # the GPU idled from the host check's sync until this launch
                self._timing["host_s"] += time.perf_counter() - self._synced
            self._run_steps(b, k, s, noisy)
            for sl in order:
                live[sl][1] += k
            steps += k
        self._timing["decode_s"] += (self._clock() - t_start - (self._timing["capture_s"] - capture0)
                                     - (self._timing["prefill_s"] - prefill0))
        return steps, later

    def _finished_slots(self, live: dict, eos, s, G: int) -> list[int]:
        """Slots of ``live`` whose row is done: EOS among its tokens, a stop string in the tokens generated since
        its last check (recorded in the row's state), or ``G`` tokens (its ``eos_at`` length if given)."""
        if not live:
            return []
        order = sorted(live)
        tmax = max(live[sl][1] for sl in order)
        toks = self.gen_tok[torch.tensor(order, device=self.device), :tmax].cpu()
        self._synced = time.perf_counter()  # (the copy waited for the GPU: from here until the next launch it idles)
        max_stop = max((len(self.tokenizer.encode(x, add_special_tokens=False)) for x in s.stop), default=0)
        done = []
        for sl, row_toks in zip(order, toks):
            st = live[sl]
            t = st[1]
            row_toks = row_toks[:t]
            hit = (row_toks == eos).nonzero()
            first_eos = int(hit[0]) if len(hit) else t
            if s.stop and st[3] is None:
                for step in range(st[2], min(t, first_eos)):
                    tail = self.tokenizer.decode(row_toks[max(0, step - max_stop - 1): step + 1].tolist())
                    if any(x in tail for x in s.stop):
                        st[3] = step
                        break
                st[2] = t
            if len(hit) or st[3] is not None or t >= self._eos_at[st[0]]:
                done.append(sl)
        return done

    def _finish(self, sl: int, st: list, comp_tok, comp_lp, ends, ended, eos) -> None:
        """Row ``st[0]``'s tokens and log-probs out of slot ``sl``: its length ends at its EOS (included) or stop
        string, else at the tokens generated."""
        row, t, _, stop_at = st
        toks, lps = self.gen_tok[sl, :t].cpu(), self.gen_lp[sl, :t].cpu()
        hit = (toks == eos).nonzero()
        end = int(hit[0]) + 1 if len(hit) else t
        if stop_at is not None and stop_at + 1 < end:
            end = stop_at + 1
        # eos_at (benchmarks): stopped at its drawn length below the max = ended as with an EOS (at the max: truncated)
        scripted = self._eos_at[row] < comp_tok.shape[1] and self._eos_at[row] <= end
        end = min(end, self._eos_at[row])
        ended[row] = bool(len(hit)) or stop_at is not None or scripted
        ends[row] = end
        comp_tok[row, :t] = toks
        comp_lp[row, :t] = lps

    def _clock(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()


def _kernels_context(module: str, name: str, *args):
    """``qerl_kernels.<module>.<name>(*args)`` (a context manager) when the kernels are importable, else nothing: the
    reference path has no launch modes and no launch chain."""
    import importlib

    try:
        make = getattr(importlib.import_module(f"qerl_kernels.{module}"), name)
    except Exception:  # no Triton / no kernels
        return contextlib.nullcontext()
    return make(*args)


def _launch_mode(mode: str):
    """``qerl_kernels.ops.launch_mode(mode)`` (graph-tuned configs) where the kernels import."""
    return _kernels_context("ops", "launch_mode", mode)


def _chain(on: bool):
    """``qerl_kernels.launch.chain(on)`` where the kernels import."""
    return _kernels_context("launch", "chain", on)
