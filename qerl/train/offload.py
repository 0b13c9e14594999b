"""Optimizer states parked in host memory while the rollout runs (``optim.offload: rollout``).

The rollout never reads the AdamW states, yet they are the largest static part of the full method: fp32 AdamW
holds 8 bytes per trained weight (4× the bf16 weights), so for 32B on 8 GPUs with FSDP2 they are 38 GB of each
rank's 80 while the rollout also needs the gathered whole weights (56 GB; ``qerl plan``). :class:`StateOffload`
copies every state tensor's storage into a pinned host buffer after an optimizer step and frees the device
storage (``UntypedStorage.resize_(0)``, the way FSDP frees parameters), and copies it back before the next update:
the tensors stay the same Python objects — the optimizer, ZeRO-1's partition and FSDP2's DTensor wrappers keep
their references — only their memory leaves the GPU in between. The values come back bit for bit (a byte copy), so
a run with the states parked computes exactly what one without does (tests/train/test_offload.py).

Cost: two copies of the states per step over PCIe (``qerl bench step --methods full --offload`` on an H100: 15.5 GB
of 7B 8-bit AdamW states out and back in 0.61 s, reports/step); the host arena is built once (page-locked when the
host allows) and reused.
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
    """``park()``: the optimizer states' device memory to the host; ``restore()``: back. Both idempotent.

    The host side is one arena of exactly the parked bytes, page-locked with ``cudaHostRegister`` where the host
    allows (``torch.empty(pin_memory=True)`` would round each buffer up to a power of two: up to 2x the states in
    host memory); pageable memory otherwise (slower copies). Built at the first park, reused after."""

    def __init__(self, optimizer, pin: bool = True):
        self.optimizer = optimizer
        self.pin = pin
        self.arena: torch.Tensor | None = None
        self.registered = False
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

    def _host(self, sizes: list[int]) -> list[torch.Tensor]:
        """Views of the arena, one per storage (64-byte aligned)."""
        offs, total = [], 0
        for n in sizes:
            offs.append(total)
            total += -(-n // 64) * 64
        if self.arena is None or self.arena.numel() != total:
            self._release_arena()
            try:
                self.arena = torch.empty(total, dtype=torch.uint8)
            except (RuntimeError, MemoryError):
                from qerl.errors import TrainingError

                raise TrainingError(
                    f"optim.offload: parking the optimizer states needs {total / 1e9:.1f} GB of host memory per "
                    "process, which this machine could not allocate; give the job more memory or set "
                    "optim.offload: none") from None
            if self.pin and torch.cuda.is_available() and total:
                err = torch.cuda.cudart().cudaHostRegister(self.arena.data_ptr(), total, 0)
                self.registered = int(err) == 0  # else: pageable (the host refuses to lock this much)
                self.pin = self.registered
        return [self.arena[o:o + n] for o, n in zip(offs, sizes)]

    def _release_arena(self) -> None:
        if self.registered and self.arena is not None:
            torch.cuda.cudart().cudaHostUnregister(self.arena.data_ptr())
        self.arena, self.registered = None, False

    def __del__(self):
        try:
            self._release_arena()
        except Exception:  # interpreter shutdown
            pass

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
        sizes = [s.nbytes() for s in storages]
        for s, host, n in zip(storages, self._host(sizes), sizes):
            host.copy_(self._bytes(s, n), non_blocking=self.registered)
            self.parked.append((s, host, n))
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the host copies are complete before the device memory is reused
        for s, _, _ in self.parked:
            s.resize_(0)
        self.seconds = time.perf_counter() - t0
        return sum(sizes)

    @torch.no_grad()
    def restore(self) -> None:
        """Reallocate the states' device memory and copy them back (stream-ordered before the optimizer step)."""
        if not self.parked:
            return
        t0 = time.perf_counter()
        for s, host, n in self.parked:
            s.resize_(n)
            self._bytes(s, n).copy_(host, non_blocking=self.registered)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.parked = []
        self.seconds += time.perf_counter() - t0
