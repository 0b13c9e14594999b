"""A decode step's kernel timeline: what one CUDA-graph replay runs, kernel by kernel, and where its time goes.

:func:`trace_kernels` records the kernels of a callable (e.g. one replay of the engine's captured decode step) with
``torch.profiler`` (CUPTI reports each kernel of a graph replay separately) and returns them as
``{name, start_us, dur_us}`` dicts in start order. :func:`split` sums them into the parts of a step —

- ``projections``: the NVFP4 projection kernels and their LoRA / activation-permute launches;
- ``attention``: the decode attention (and its rotary + cache-write kernel);
- ``head``: the lm_head GEMM (cuBLAS / CUTLASS; the only dense GEMM of an NVFP4 step — on a bf16 base every
  projection's cuBLAS GEMM lands here too);
- ``sampling``: the sampling kernels;
- ``other``: norms, residual adds, activations, copies;
- ``gaps``: the idle time between one kernel's end and the next one's start (launch latency inside the graph;
  overlapped launches — PDL, the launch chain — count as none)

— with ``step`` = last end − first start, so the parts add up to the step. Unlike
:func:`qerl.bench.rollout.step_split` (each part replayed as its own graph), every number here is from the same
replay. Used by ``qerl bench rollout --trace-batches``.
"""
from __future__ import annotations

import json
import os
import re
import tempfile

#: (part, pattern on the kernel name), first match wins
PARTS = [
    ("projections", re.compile(r"nvfp4|wgmma|_ws_kernel|lora_xa|_permute_kernel|mmv|gemv|dequant", re.I)),
    ("attention", re.compile(r"attention|attn|flash|rope_cache|_rope_write", re.I)),  # (_attn_partial / _combine)
    ("sampling", re.compile(r"sample|gumbel|argmax|token_logprob", re.I)),  # (_sample_partial / _combine)
    ("head", re.compile(r"gemm|xmma|cutlass|nvjet|sm90_|ampere_|cublas", re.I)),
]


def part_of(name: str) -> str:
    """The step part a kernel named ``name`` belongs to (see :data:`PARTS`; ``other`` if none matches)."""
    for part, pat in PARTS:
        if pat.search(name):
            return part
    return "other"


def split(kernels: list[dict]) -> dict:
    """``{part: ms}`` for kernels ``[{name, start_us, dur_us}]`` (any order): the timeline from the first start to
    the last end cut at every start and end; each piece goes to the part of the earliest-started kernel still running
    then (so overlapped launches are not counted twice), or to ``gaps`` when none runs. Also ``step`` (first start to
    last end; the parts and gaps add up to it) and ``kernels`` (the count).

    Why the earliest: a programmatic dependent launch (the LoRA primary's projection, every kernel of the decode step's
    launch chain, :func:`qerl_kernels.launch.chain`) starts while the kernel before it runs and mostly waits for it,
    so the kernel that started first is the one doing the work the others wait on."""
    ks = sorted(kernels, key=lambda k: k["start_us"])
    out = {p: 0.0 for p, _ in PARTS}
    out.update(other=0.0, gaps=0.0)
    if not ks:
        return {**out, "step": 0.0, "kernels": 0}
    spans = [(k["start_us"], k["start_us"] + k["dur_us"], part_of(k["name"])) for k in ks]
    cuts = sorted({t for s, e, _ in spans for t in (s, e)})
    first = 0
    for a, b in zip(cuts, cuts[1:]):
        while first < len(spans) and spans[first][1] <= a:
            first += 1  # (spans end in start order only roughly: the scan below checks each)
        owner = "gaps"
        for s, e, part in spans[first:]:
            if s > a:
                break
            if e > a:
                owner = part  # the earliest start that still runs over [a, b)
                break
        out[owner] += b - a
    res = {p: round(v / 1e3, 4) for p, v in out.items()}
    res["step"] = round((cuts[-1] - cuts[0]) / 1e3, 4)
    res["kernels"] = len(ks)
    return res


def by_name(kernels: list[dict], top: int = 20) -> list[dict]:
    """``[{name, part, calls, total_us, mean_us}]``: the kernels grouped by name, longest total first."""
    agg: dict = {}
    for k in kernels:
        a = agg.setdefault(k["name"], {"name": k["name"], "part": part_of(k["name"]), "calls": 0, "total_us": 0.0})
        a["calls"] += 1
        a["total_us"] += k["dur_us"]
    rows = sorted(agg.values(), key=lambda a: -a["total_us"])[:top]
    for a in rows:
        a["total_us"] = round(a["total_us"], 2)
        a["mean_us"] = round(a["total_us"] / a["calls"], 2)
    return rows


def kernels_of_chrome_trace(trace: dict) -> list[dict]:
    """The GPU kernels of a Chrome trace (``torch.profiler``'s export: events of category ``kernel``)."""
    out = [{"name": e["name"], "start_us": float(e["ts"]), "dur_us": float(e.get("dur", 0.0))}
           for e in trace.get("traceEvents", []) if e.get("cat") == "kernel" and e.get("ph") == "X"]
    return sorted(out, key=lambda k: k["start_us"])


def trace_kernels(fn, warmup: int = 2, setup=None) -> list[dict]:
    """The kernels one call of ``fn`` runs on the GPU, in start order (``fn`` is called ``warmup`` times first;
    ``setup``, if given, before each call of ``fn`` and outside the trace)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    for i in range(warmup + 1):  # (the last setup is the traced call's)
        if setup is not None:
            setup()
        if i < warmup:
            fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            return kernels_of_chrome_trace(json.load(f))
    finally:
        os.unlink(path)
