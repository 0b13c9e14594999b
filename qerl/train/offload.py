"""Optimizer states parked in host memory while the rollout runs (``optim.offload: rollout``).

The rollout never reads the AdamW states, yet they are the largest static part of the full method: fp32 AdamW
holds 8 bytes per trained weight (4× the bf16 weights), so for 32B on 8 GPUs with FSDP2 they are 38 GB of each
rank's 80 while the rollout also needs the gathered whole weights (56 GB; ``qerl plan``). :class:`StateOffload`
copies every state tensor's storage into a pinned host buffer after an optimizer step and frees the device
storage (``UntypedStorage.resize_(0)``, the way FSDP frees parameters), and copies it back before the next update:
the tensors stay the same Python objects — the optimizer, ZeRO-1's partition and FSDP2's DTensor wrappers keep
their references — only their memory leaves the GPU in between. The values come back bit for bit (a byte copy), so
a run with the states parked computes exactly what one without does (tests/train/test_offload.py).

Cost: two copies of the states per step over PCIe (~25–50 GB/s per direction); the host buffers are allocated
once (pinned when the host allows) and reused.
"""
from __future__ import annotations

import os
import time

import torch

# test hook: park states that live in host memory too (on a CPU-only run), so the CPU tests exercise the path
PARK_ON_CPU = os.environ.get("QERL_OFFLOAD_ON_CPU", "") == "1"


def _state_tensors(optimizer):
    """Every tensor of the optimizer's per-parameter states (the local optimizer under ZeRO-1; the local shard
    of a DTensor state under FSDP2)."""
    inner = getattr(optimizer, "optim", optimizer)  # torch.distributed.optim.ZeroRedundancyOptimizer
    for st in inner.state.values():
        for v in st.values():
            if isinstance(v, torch.Tensor):
                yield v.to_local() if hasattr(v, "to_local") else v


class StateOffload:
    """``park()``: the optimizer states' device memory to the host; ``restore()``: back. Both idempotent."""

    def __init__(self, optimizer, pin: bool = True):
        self.optimizer = optimizer
        self.pin = pin
        self.host: dict[int, torch.Tensor] = {}  # id(storage) -> host bytes, kept between steps
        self.parked: list[tuple[torch.UntypedStorage, torch.Tensor, int]] = []
        self.seconds = 0.0  # copy time of the last park + restore

    def _storages(self) -> list[torch.UntypedStorage]:
        seen: dict[int, torch.UntypedStorage] = {}
        for t in _state_tensors(self.optimizer):
            if t.device.type == "cpu" and not PARK_ON_CPU:
                continue
            s = t.untyped_storage()
            if s.nbytes():
                seen.setdefault(s.data_ptr(), s)  # shared storages (views, shared quantile maps) once
        return list(seen.values())

    def _host_buffer(self, key: int, n: int) -> torch.Tensor:
        buf = self.host.get(key)
        if buf is None or buf.numel() != n:
            buf = None
            if self.pin and torch.cuda.is_available():
                try:
                    buf = torch.empty(n, dtype=torch.uint8, pin_memory=True)
                except RuntimeError:  # the host refuses to pin this much: pageable memory (slower copies)
                    self.pin = False
            if buf is None:
                buf = torch.empty(n, dtype=torch.uint8)
            self.host[key] = buf
        return buf

    @staticmethod
    def _bytes(s: torch.UntypedStorage, n: int) -> torch.Tensor:
        return torch.empty(0, dtype=torch.uint8, device=s.device).set_(s, 0, (n,), (1,))

    @torch.no_grad()
    def park(self) -> int:
        """Copy the states to the host and free their device memory; returns the bytes parked."""
        if self.parked:
            return 0
        t0 = time.perf_counter()
        storages = self._storages()
        for i, s in enumerate(storages):
            n = s.nbytes()
            host = self._host_buffer(i, n)
            host.copy_(self._bytes(s, n), non_blocking=True)
            self.parked.append((s, host, n))
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the host copies are complete before the device memory is reused
        for s, _, _ in self.parked:
            s.resize_(0)
        self.seconds = time.perf_counter() - t0
        return sum(n for _, _, n in self.parked)

    @torch.no_grad()
    def restore(self) -> None:
        """Reallocate the states' device memory and copy them back (stream-ordered before the optimizer step)."""
        if not self.parked:
            return
        t0 = time.perf_counter()
        for s, host, n in self.parked:
            s.resize_(n)
            self._bytes(s, n).copy_(host, non_blocking=True)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.parked = []
        self.seconds += time.perf_counter() - t0
