"""GPU timing for the benchmarks: median seconds of CUDA-graph replays (interleaved between contenders) or eager
launches, and the card's device-to-device copy bandwidth (the memory roofline the reports compare against)."""
from __future__ import annotations

import statistics

import torch


def graph_time(calls, reps: int = 15) -> float:
    """Median seconds per call of ``calls`` (a list of closures) captured in one CUDA graph."""
    return graph_times({"t": calls}, reps)["t"]


def graph_times(named: dict, reps: int = 15) -> dict:
    """Median seconds per call for each entry of ``named`` (name -> list of closures), each captured in
    its own CUDA graph and replayed *interleaved* (A, B, C, A, B, C, ...), so that clock and power
    drift during a run affect the kernels and cuBLAS alike and their ratio is a same-moment ratio."""
    s = torch.cuda.Stream()
    graphs = {}
    for name, calls in named.items():
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for c in calls:  # warm up / compile outside the capture
                c()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for c in calls:
                c()
        graphs[name] = (g, len(calls))
    times = {name: [] for name in named}
    for _ in range(reps):
        for name, (g, n) in graphs.items():
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            g.replay()
            b.record()
            torch.cuda.synchronize()
            times[name].append(a.elapsed_time(b) / 1e3 / n)
    return {name: statistics.median(v) for name, v in times.items()}


def eager_time(calls, reps: int = 5) -> float:
    """Median seconds per call of ``calls`` launched eagerly (for code a CUDA graph cannot capture,
    e.g. the reference, whose global-scale check reads the value on the host)."""
    for c in calls:
        c()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for c in calls:
            c()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 1e3 / len(calls))
    return statistics.median(times)


def copy_bandwidth() -> float:
    """Device-to-device copy GB/s (bytes read + written): the best of a 2 GiB ``copy_`` (memcpy)
    and an elementwise copy kernel (``torch.mul(a, 1, out=b)`` on bf16), so that targets stated
    as a fraction of it are not flattered by a slow copy path."""
    a = torch.randn(2 ** 30, dtype=torch.bfloat16, device="cuda")
    b = torch.empty_like(a)
    nbytes = 2 * a.numel() * a.element_size()
    t_copy = graph_time([lambda: b.copy_(a)], reps=10)
    t_kernel = graph_time([lambda: torch.mul(a, 1, out=b)], reps=10)
    del a, b
    torch.cuda.empty_cache()
    return nbytes / min(t_copy, t_kernel) / 1e9
