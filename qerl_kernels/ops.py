"""Public entry points of the NVFP4 kernels: validation, tile configs and torch custom ops (``qerl.ops.linear``,
the seam every model uses, builds its backend from :func:`nvfp4_matmul`, :func:`nvfp4_matmul_t` and
:func:`supports`; nothing here imports ``qerl``).

``nvfp4_matmul(x, packed, scale, gs, bias=None, xa=None, lora_b=None, lora_scale=1.0, lora_a=None)``
    ``x [..., K]`` bf16/fp16 -> ``[..., N]`` (``x · Ŵᵀ + bias + lora_scale · xa · lora_bᵀ``); with
    ``lora_a [R, K]`` instead of ``xa``, ``xa = x · lora_aᵀ`` (bf16) is computed too — inside the same
    launch on the decode path (M <= 16) and for small eager calls (``LORA_INKERNEL_FLOPS``), else by one matmul
    first. With both (the training op, which keeps ``xa`` for its backward): the call takes the route it takes
    with ``lora_a`` alone — the same result bit for bit, as the old-log-prob pass under ``no_grad`` gets — and uses
    the given ``xa`` where that route would compute it by the matmul.
``nvfp4_matmul_t(dy, packed, scale, gs, dyb=None, lora_a=None, lora_scale=1.0)``
    ``dy [..., N]`` -> ``dX [..., K] = dy · Ŵ + lora_scale · dyb · lora_a``.

Tile configs: a tuned table per GPU (``qerl_kernels/tuned/<device>.json``, written by
``qerl bench kernels --tune``) keyed on (M bucket, N, K); for a shape without entries the nearest tuned shape's
config at the same M bucket (:func:`transferred_entry`, M > 16), else a heuristic that splits K (or N) across
programs at decode sizes so that every SM has work. ``launch_mode("graph")`` selects the configs
tuned for CUDA-graph replay where a decode-size entry has a
separate eager one (``EAGER``: fewer launches for host-bound eager calls); the default is ``"eager"``.
"""

import contextlib
import functools
import itertools
from dataclasses import dataclass
import json
import math
import os
import types
from pathlib import Path

import torch

from qerl_kernels import launch

M_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
TUNED_DIR = Path(__file__).parent / "tuned"  # the tuned tables (written by python -m qerl.bench.kernels_tune)


class KernelInputError(ValueError):
    """Bad arguments to an NVFP4 kernel (dtype, layout, shapes)."""


def m_bucket(m: int) -> int:
    for b in M_BUCKETS:
        if m <= b:
            return b
    return M_BUCKETS[-1]


USER_TABLES = "QERL_TUNED_DIR"  # environment variable: a directory of the user's own tuned tables (table_dirs)


def table_dirs() -> tuple[Path, ...]:
    """Where the tuned tables are read from, in order, later entries winning: the package's (``qerl_kernels/tuned``, the
    committed searches), then ``$QERL_TUNED_DIR`` where set — a user's own searches of their models
    (``python -m qerl.bench.kernels_tune`` writes there when it is set), kept out of the installed package. Set it
    before the first kernel call: the merged table is read once per process."""
    extra = os.environ.get(USER_TABLES)
    return (TUNED_DIR,) + ((Path(extra).expanduser(),) if extra else ())


def table_path(device_name: str, directory: Path | None = None) -> Path:
    """The table file of ``device_name`` in ``directory`` (default: the last of :func:`table_dirs`, where a search
    writes)."""
    return (directory or table_dirs()[-1]) / (device_name.replace(" ", "_") + ".json")


def _tuned(device_name: str) -> dict:
    return _tables(device_name, table_dirs())


@functools.lru_cache(maxsize=None)
def _tables(device_name: str, dirs: tuple[Path, ...]) -> dict:
    table: dict = {}
    for d in dirs:
        path = table_path(device_name, d)
        if path.exists():
            try:
                data = json.loads(path.read_text())
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise KernelInputError(f"tuned table {path}: not valid JSON ({e}); fix or delete it") from None
            table.update(_checked_table(path, data))
    return table


def _checked_table(path: Path, data) -> dict:
    """A tuned table's shape: ``{"fwd|bwd:M:N:K": {NAME: int | {NAME: int}}}``; anything else is refused here,
    naming the file and the entry, instead of failing inside a kernel launch."""
    if not isinstance(data, dict):
        raise KernelInputError(f"tuned table {path}: a {type(data).__name__}, not a mapping of shape -> config; "
                               "fix or delete it")
    for key, cfg in data.items():
        parts = key.split(":")
        if len(parts) != 4 or not all(p.isdigit() for p in parts[1:]) or not isinstance(cfg, dict) or not all(
                (isinstance(v, int) and not isinstance(v, bool)) or (isinstance(v, dict) and all(
                    isinstance(x, int) and not isinstance(x, bool) for x in v.values())) for v in cfg.values()):
            raise KernelInputError(f"tuned table {path}: entry {key!r}: expected 'KIND:M:N:K' -> {{NAME: integer}}, "
                                   f"got {json.dumps(cfg)[:80]}; fix or delete it")
    return data


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


DQ_ROWS = 64  # above this many rows the untuned choice is dequantize-windows + cuBLAS (``DQ``)
DQ_CHUNK = 1 << 25  # weights per dequantized window (64 MiB of bf16 scratch)


WGMMA_ROWS = (0, 128)  # untuned forward M in (0, 128]: the warpgroup-MMA kernel (nvfp4_wgmma) when K % 128 == 0
WGMMA_TUNED_ROWS = (16, 128)  # the M range whose tuned WGMMA entries also serve neighbouring M buckets (tuned_entry)
EAGER_XS_ROWS = 64  # eager warpgroup-MMA calls with a pre-pass up to this M: the one-launch XS config where it suits
EAGER_ONE_LAUNCH_FLOPS = 4.5e9  # eager calls of at most this many FLOPs (2·M·N·K) whose config takes more than one
# launch (DQ, the pre-pass of WS and of the plain kernel): one launch instead (eager_one_launch); 0: off
LORA_INKERNEL_FLOPS = 4.3e9  # eager forward calls with lora_a, M > 16, of at most this many FLOPs: one Triton tile
# launch that computes x · lora_aᵀ itself (lora_inkernel); 0: off. H100 A/B (reports/host): 4.2 GFLOP calls (0.5B qkv
# M = 2048, 7B qkv M = 128) run 103 -> 53 / 118 -> 72 µs back to back, 0.5B down M = 512 (4.46 GFLOP) 89 -> 137 µs
LORA_INKERNEL_DECODE_WEIGHTS = 2.4e7  # eager forward calls with lora_a at M <= 16 whose weight has at most this many
# elements (N·K): the same one launch on a BM = 16 tile (lora_inkernel) instead of the decode kernel's LoRA route; 0:
# off. A/Bs (reports/host): host 53 -> 31 µs (H100, all sizes), 48 -> 37 µs at <= 2.4e7 (H200); the 7B down weight
# (6.8e7) runs slower on the tile, so it stays on the decode kernel
INKERNEL_MAX_RANK = 64  # (padded) ranks the in-kernel route takes: its [R, BK] adapter tile joins every ring stage
HEURISTIC = "v2"  # "v1": the untuned configs before 2026-11-26 (MMV at M <= 16; comparisons and experiments)


def wgmma_heuristic(M: int, N: int, K: int, sms: int) -> dict:
    """Untuned config of :mod:`qerl_kernels.nvfp4_wgmma`, read off the H100 search of 12 small-model shapes
    (Qwen2.5 0.5B / 1.5B / 3B, N·K 0.8–45 M weights, every candidate with the engine's LoRA on the call, 2026-11-26,
    reports/kernels "Small models"): one warpgroup; BT = 8 activation rows up to M = 8, 16 up to 32, 32 up to 64 (64
    where the weight has >= 128 row tiles of 64, and above M = 64); activations staged by the kernel itself (``XS``: no
    pre-pass launch) up to M = 8, and up to 64 while fewer than 128 row tiles share the work; K split so that ~2.5
    programs per SM run (at most K/256 steps). ``HEURISTIC = "v1"``: the older rule (BT 32 / 64, 3 programs per SM,
    the pre-pass)."""
    if HEURISTIC == "v1":
        bt = 32 if M <= 32 else 64
        tiles = -(-N // 64) * -(-M // bt)
        split = max(1, min(K // 256, round(3 * sms / tiles)))
        return dict(WGMMA=1, WG=1, BT=bt, NS=3, SPLIT=split, XG=0)
    rows = -(-N // 64)
    bt = 8 if M <= 8 else 16 if M <= 32 else (32 if M <= 64 and rows < 128 else 64)
    tiles = rows * -(-M // bt)
    split = max(1, min(K // 256, round(2.5 * sms / tiles)))
    cfg = dict(WGMMA=1, WG=1, BT=bt, NS=2 if M <= 64 else 3, SPLIT=split, XG=0)
    if M <= 8 or (M <= 64 and rows < 128):
        cfg["XS"] = 1
    return cfg


def heuristic(kind: str, M: int, N: int, K: int, sms: int, dq: bool = True, wgmma: bool = True,
              mmv: bool = True) -> dict:
    """Config when no tuned entry exists. Forward M <= 128 with K % 128 == 0: the warpgroup-MMA kernel
    (:func:`wgmma_heuristic`; ``wgmma=False``: never), carrying at M <= 16 the single-launch decode kernel's config
    as ``EAGER`` for calls launched one by one (:func:`launch_mode`; ``HEURISTIC = "v1"``: the kernel only for M
    17–128). Above ``DQ_ROWS`` rows: ``DQ`` (dequantize windows of at most ``CHUNK`` weights, cuBLAS on each:
    :mod:`qerl_kernels.nvfp4_dequant`). Below: ``MMV`` decode kernel for forward M <= 16, else a tensor-core tile —
    BM/BN/BK, SPLIT (reduction split over programs so that decode sizes fill the SMs), SWAP (weight tile as the MMA's
    A operand: needed for wgmma tiles, BM > 32), warps, stages. ``kind`` is 'fwd' or 'bwd' (bwd tiles dX over (M, K)
    and loops over N). ``dq=False``: never ``DQ`` (the Triton-only choice); ``mmv=False``: a tile at M <= 16 too."""
    low = WGMMA_TUNED_ROWS[0] if HEURISTIC == "v1" else WGMMA_ROWS[0]
    if kind == "fwd" and wgmma and low < M <= WGMMA_ROWS[1] and K % 128 == 0:
        cfg = wgmma_heuristic(M, N, K, sms)
        if M <= 16:
            cfg["EAGER"] = heuristic(kind, M, N, K, sms, dq, wgmma=False)
        return cfg
    if dq and M > DQ_ROWS:  # compute-bound: dequantize windows of W at ~copy bandwidth, multiply with cuBLAS
        return dict(DQ=1, CHUNK=DQ_CHUNK)
    if kind == "fwd" and mmv and M <= 16 and K % 32 == 0:  # register-fragment tensor-core decode kernel
        cfg = dict(MMV=1, BM=8 if M <= 8 else 16, BN=64, BK=128, num_warps=4, num_stages=1)
        out_tiles, loop = -(-M // cfg["BM"]) * -(-N // 64), -(-K // 128)
        cfg["SPLIT"] = max(1, min(loop // 2, (8 * sms) // out_tiles))
        return cfg
    elif kind == "fwd":
        if M <= 64:
            cfg = dict(BM=16 if M <= 16 else (32 if M <= 32 else 64), BN=128, BK=128, SWAP=1, num_warps=4,
                       num_stages=4)
        elif M <= 256:
            cfg = dict(BM=64, BN=128, BK=128, SWAP=1, num_warps=4, num_stages=4)
        else:
            cfg = dict(BM=128, BN=128, BK=64, SWAP=1, num_warps=8, num_stages=4)
        out_tiles, loop = -(-M // cfg["BM"]) * -(-N // cfg["BN"]), -(-K // cfg["BK"])
    else:
        if M <= 32:
            cfg = dict(BM=16 if M <= 16 else 32, BN=64, BK=128, SWAP=1, num_warps=4, num_stages=4)
        else:
            cfg = dict(BM=128 if M > 256 else 64, BN=64, BK=128, SWAP=1, num_warps=8 if M > 256 else 4,
                       num_stages=3)
        out_tiles, loop = -(-M // cfg["BM"]) * -(-K // cfg["BK"]), -(-N // cfg["BN"])
    cfg["SPLIT"] = max(1, min(loop // 2, (2 * sms) // max(1, out_tiles))) if M <= 256 else 1
    return cfg


def eager_one_launch(kind: str, cfg: dict, M: int, N: int, K: int, sms: int) -> dict | None:
    """The config an *eager* call of at most :data:`EAGER_ONE_LAUNCH_FLOPS` (``2·M·N·K``, M > 16) runs instead of
    ``cfg`` where ``cfg`` takes more than one launch — ``DQ`` (a dequantize launch, a scratch buffer and a cuBLAS
    call), ``WS`` or the plain warpgroup-MMA kernel with its activation pre-pass — else None. Forward with
    K % 128 == 0: the plain warpgroup-MMA loop with the activations staged by the kernel (``XS``, 32 rows per tile,
    K split to ~2.5 programs per SM); otherwise the Triton tile (:func:`heuristic` without ``DQ``).

    Such a call is host-bound eagerly. Measured on one H100 (2026-11-27, reports/host/evidence/session22_*): at most
    4.5 GFLOP, the routed multi-launch calls took 35-100 µs per call in a loop for 8-23 µs of GPU time; the staged
    forward took at most 35 µs of GPU time (median 119 TFLOP/s), the backward tile at most 48 (unsplit). In ``qerl
    bench host`` (112 rows, old and new code alternated on one machine) the 14 rows that changed route went, median
    host / loop µs: forward 48 / 52 -> 27 / 28, with LoRA 110 / 108 -> 59 / 59, backward 48 / 44 -> 22 / 33 (cuBLAS's
    loop: 14). Larger calls keep the tables' config: there the GPU time decides. Not applied under a forced
    ``QERL_KERNEL_CONFIG`` (experiments keep what they force)."""
    if M <= 16 or 2 * M * N * K > EAGER_ONE_LAUNCH_FLOPS:
        return None
    if not (cfg.get("DQ") or cfg.get("WS") or (cfg.get("WGMMA") and not (cfg.get("XS") or cfg.get("XG")))):
        return None
    if kind == "fwd" and K % 128 == 0:
        tiles = -(-N // 64) * -(-M // 32)
        return dict(WGMMA=1, WG=1, BT=32, NS=2 if M <= 64 else 3, SPLIT=max(1, min(K // 256, round(2.5 * sms / tiles))),
                    XG=0, XS=1)
    cfg = heuristic(kind, M, N, K, sms, dq=False, wgmma=False)
    if kind == "bwd" and M > 256:  # the heuristic splits the N loop only up to M = 256; here few tiles need it too
        tiles = -(-M // cfg["BM"]) * -(-K // cfg["BK"])  # (1.5B q/k/v at M = 512: 96 tiles, 48 µs unsplit)
        cfg["SPLIT"] = max(1, min(-(-N // cfg["BN"]) // 2, (2 * sms) // tiles))
    return cfg


def lora_inkernel(cfg: dict, M: int, N: int, K: int, mode: str, eager: bool, sms: int) -> dict | None:
    """The config of a forward call with ``lora_a`` that computes ``x · lora_aᵀ`` inside its own launch (the Triton
    tile with ``LXA``, :mod:`qerl_kernels.nvfp4_matmul`: one launch where the other routes take two — the PDL primary
    or ``x @ lora_a.T``, then the kernel), else None. ``mode`` "inkernel" (:data:`LORA_LAUNCH`) forces it wherever
    ``cfg`` is a tile; "auto": an eager call (``eager``) at M > 16 of at most :data:`LORA_INKERNEL_FLOPS` takes the
    untuned tile (:func:`heuristic` without ``DQ`` and the warpgroup-MMA kernel). M <= 16 keeps the decode kernels'
    own fused route (:func:`lora_route`), except eager calls on weights of at most
    :data:`LORA_INKERNEL_DECODE_WEIGHTS` elements, which take the heuristic's BM = 16 tile."""
    small = M <= 16
    auto = mode == "auto" and eager and (N * K <= LORA_INKERNEL_DECODE_WEIGHTS if small else
                                         2 * M * N * K <= LORA_INKERNEL_FLOPS)
    if not (auto or (mode == "inkernel" and not small)):
        return None
    if path_of("fwd", cfg) == "tile_fwd":  # (a tile already: it takes the LoRA term as it is)
        return cfg
    if not auto:
        return None
    return heuristic("fwd", M, N, K, sms, dq=False, wgmma=False, mmv=False)


def tuned_entry(device_name: str, kind: str, M: int, N: int, K: int) -> dict | None:
    """The tuned config of this (kind, N, K) at M's bucket, else at the nearest tuned bucket whose path
    suits M: a decode-kernel entry (MMV / GEMV) only up to M = 32, a dequantize + cuBLAS entry (DQ)
    only from M = 64 (a table tuned at decode sizes only once sent M = 2048 to the decode kernel: 0.15x
    cuBLAS on an H100), a warpgroup-MMA entry (WGMMA) from M = 17 (above M = 256 only a large tile,
    BT >= 128); else None (the heuristic)."""
    table = _tuned(device_name)
    hit = table.get(f"{kind}:{m_bucket(M)}:{N}:{K}")
    if hit is None:
        def suits(cfg: dict) -> bool:
            return not ((cfg.get("MMV") or cfg.get("GEMV")) and M > 32) and not (cfg.get("DQ") and M < 64) \
                and not (cfg.get("WGMMA") and not (WGMMA_TUNED_ROWS[0] < M <= 2 * WGMMA_TUNED_ROWS[1] or
                                                   (M > WGMMA_TUNED_ROWS[1] and cfg.get("BT", 0) >= 128)))

        have = {b: c for b in M_BUCKETS if (c := table.get(f"{kind}:{b}:{N}:{K}")) is not None and suits(c)}
        if have:
            hit = have[min(have, key=lambda b: abs(math.log2(b) - math.log2(max(M, 1))))]
    return dict(hit) if hit else None


TRANSFER = True  # untuned shapes, forward M > 16: the nearest tuned shape's config at the same M bucket
TRANSFER_LARGE_FROM = 256  # from this M bucket on (where the heuristic takes dequantize + cuBLAS), only weights of at
TRANSFER_LARGE_WEIGHTS = 12e6  # least this many elements (N·K) borrow
TRANSFER_NEAR_FROM = 512  # from this M bucket on, only from a tuned shape within TRANSFER_NEAR (log2 N + log2 K)
TRANSFER_NEAR = 1.0


def transferred_entry(device_name: str, kind: str, M: int, N: int, K: int, sms: int = 132) -> dict | None:
    """The forward config of an untuned ``(N, K)`` borrowed from the tuned shape nearest to it (``d = |log2 N'/N| +
    |log2 K'/K|``) with an entry at M's bucket, its K split rescaled (:func:`rescaled_split`); else None (the
    heuristic). Only where the shape has no entry of its own (:func:`table_entry`: :func:`tuned_entry` first), for
    forward M > 16 and whole tiles (N % 64 == 0, K % 128 == 0: every projection of the common LLM families). Where
    the heuristic's dequantize + cuBLAS path competes, which wins depends on the shape: from M bucket
    :data:`TRANSFER_LARGE_FROM` on only weights of at least :data:`TRANSFER_LARGE_WEIGHTS` elements borrow (the
    dequantization of a smaller one is cheap: Gemma-2-2B o, 2304 x 2048, ran 0.67x cuBLAS on it at M = 256 and
    0.39x on a borrowed config), and from :data:`TRANSFER_NEAR_FROM` on only from a shape within ``d <=``
    :data:`TRANSFER_NEAR` (2x: Llama-1B gate/up at M = 512 0.62 -> 0.33x from 7B gate/up). ``TRANSFER = False``:
    never.

    Why (H100, reports/kernels "Shapes without tuned entries"): the heuristic's configs are read off small-model
    searches, and on the Llama 3.x 1B / 3B / 8B projections (no tuned entries) the forward ran at a median 0.99 /
    0.83 / 0.73x cuBLAS at M = 32 / 64 / 128; borrowed, 1.26 / 1.11 / 0.85x — on Llama-8B within 4% of a search on
    its own shapes at 6 of 8 keys (M = 64 / 128). Over five families (with Gemma-2-2B and Qwen3-4B) at M = 256:
    0.58 -> 0.68x. The backward's borrowed configs were neutral to slower (8B down at M = 64: 0.74 -> 0.54x), so it
    keeps the heuristic. ``_transfer`` is memoised: clear it (``_transfer.cache_clear()``) after the table or the
    bounds change, as the tuner does."""
    if not TRANSFER or kind != "fwd" or M <= 16 or N % 64 or K % 128:
        return None
    if m_bucket(M) >= TRANSFER_LARGE_FROM and N * K < TRANSFER_LARGE_WEIGHTS:
        return None
    hit = _transfer(device_name, m_bucket(M), N, K, sms)
    return None if hit is None else dict(hit[0])


def table_entry(device_name: str, kind: str, M: int, N: int, K: int, sms: int = 132) -> dict | None:
    """The config the tables give a call: the shape's own tuned entry (:func:`tuned_entry`), else one borrowed from the
    nearest tuned shape (:func:`transferred_entry`), else None (the heuristic)."""
    return tuned_entry(device_name, kind, M, N, K) or transferred_entry(device_name, kind, M, N, K, sms)


def config_source(device_name: str, kind: str, M: int, N: int, K: int, sms: int = 132) -> str:
    """Where a call's config comes from: ``tuned``, ``transfer:N'xK'`` (the shape it is borrowed from) or
    ``heuristic`` (benchmark CSVs)."""
    if tuned_entry(device_name, kind, M, N, K) is not None:
        return "tuned"
    src = transfer_source(device_name, kind, M, N, K, sms)
    return "heuristic" if src is None else f"transfer:{src[0]}x{src[1]}"


def transfer_source(device_name: str, kind: str, M: int, N: int, K: int, sms: int = 132) -> tuple[int, int] | None:
    """``(N', K')`` of the tuned shape :func:`transferred_entry` borrows from (reports, debugging), else None."""
    if transferred_entry(device_name, kind, M, N, K, sms) is None:
        return None
    return _transfer(device_name, m_bucket(M), N, K, sms)[1]


@functools.lru_cache(maxsize=4096)
def _transfer(device_name: str, bucket: int, N: int, K: int, sms: int) -> tuple | None:
    best = None
    for key, cfg in _tuned(device_name).items():
        k, b, n, kk = key.split(":")
        n, kk = int(n), int(kk)
        if k != "fwd" or int(b) != bucket or n % 64 or kk % 128:
            continue
        d = abs(math.log2(n / N)) + abs(math.log2(kk / K))
        if (best is None or d < best[0]) and (bucket < TRANSFER_NEAR_FROM or d <= TRANSFER_NEAR):
            best = (d, n, kk, cfg)
    if best is None:
        return None
    _, n, kk, cfg = best
    return types.MappingProxyType(rescaled_split(dict(cfg), n, N, K, bucket, sms)), (n, kk)


def rescaled_split(cfg: dict, n: int, N: int, K: int, M: int = 0, sms: int = 132) -> dict:
    """``cfg``, a forward config tuned for ``n`` output rows, with its ``SPLIT`` rescaled for ``(N, K)`` at the same
    M: the output tiles' count changes with N, the split by the inverse ratio, within [1, the K steps / 2] (at least
    two steps per program) — and above the tuned split only while the target's tiles (with M's, warpgroup MMA) fill
    less than two waves of ``sms``. Stream-K (``SK``: programs per SM) and DQ configs stay as they are; the ``EAGER``
    config of a decode entry is dropped (``config_for`` derives its own)."""
    cfg.pop("EAGER", None)
    split = int(cfg.get("SPLIT", 1))
    if cfg.get("DQ") or cfg.get("SK") or "SPLIT" not in cfg:
        return cfg
    m_tiles = 1
    if cfg.get("WGMMA"):  # weight rows per output tile (_wgmma_static), reduction over K in 128-wide steps
        rows = 64 * int(cfg.get("MT", 1)) * (1 if cfg.get("KS") else int(cfg.get("C", 2) if cfg.get("WS")
                                                                          else cfg.get("WG", 1)))
        tiles_old, tiles_new, steps = -(-n // rows), -(-N // rows), K // 128
        m_tiles = -(-M // int(cfg.get("BT", 64))) if M else 1
    else:  # Triton tiles and decode kernels: output tiles over N, reduction over K
        tiles_old, tiles_new, steps = -(-n // cfg["BN"]), -(-N // cfg["BN"]), -(-K // cfg["BK"])
    new = round(split * tiles_old / tiles_new)
    if new > split and tiles_new * m_tiles >= 2 * sms:  # enough tiles already: no more split than tuned
        new = split
    cfg["SPLIT"] = max(1, min(max(1, steps // 2), new))
    return cfg


@functools.lru_cache(maxsize=None)
def _device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def config_for(kind: str, M: int, N: int, K: int, device: torch.device) -> dict:
    if device.type != "cuda":  # interpreter: small tiles
        cfg = dict(BM=16, BN=32, BK=32, num_warps=4, num_stages=1, SPLIT=1, SWAP=0)
        return {**cfg, **json.loads(os.environ.get("QERL_KERNEL_CONFIG", "{}"))}
    forced = json.loads(os.environ.get("QERL_KERNEL_CONFIG", "{}"))  # experiments / debugging / tuning
    if "BM" in forced or "DQ" in forced or "WGMMA" in forced:  # a complete config replaces the tuned one
        return forced
    hit = table_entry(_device_name(device.index or 0), kind, M, N, K, _sm_count(device.index or 0))
    cfg = dict(hit) if hit else heuristic(kind, M, N, K, _sm_count(device.index or 0))
    if cfg.get("WGMMA") and M <= 16 and "EAGER" not in cfg:  # eager calls at decode sizes: one launch (launch_mode)
        cfg["EAGER"] = heuristic(kind, M, N, K, _sm_count(device.index or 0), wgmma=False)
    elif cfg.get("WGMMA") and M <= EAGER_XS_ROWS and "EAGER" not in cfg and not (cfg.get("XS") or cfg.get("XG")):
        # eager calls: where the untuned rule stages the activations in the kernel (one launch, no TMA descriptors;
        # fewer than 128 row tiles), that config instead of the pre-pass launch the tuned one (timed in CUDA graphs)
        # carries. Eagerly, 7B q/k/v, o and down at M = 24-64 took 38-60 µs per call in a loop instead of 52-99;
        # 7B gate/up (592 row tiles) ran 30% slower staged, so it keeps its tuned config (H200, 2026-11-26,
        # reports/host/README.md)
        eager = wgmma_heuristic(M, N, K, _sm_count(device.index or 0))
        if eager.get("XS"):
            cfg["EAGER"] = eager
    if not forced and "EAGER" not in cfg and (one := eager_one_launch(kind, cfg, M, N, K,
                                                                          _sm_count(device.index or 0))):
        cfg["EAGER"] = one  # small eager calls: one launch (host-bound)
    return {**cfg, **forced}


def tiled_config(kind: str, cfg: dict, M: int, N: int, K: int, sms: int, interpret: bool = False) -> dict:
    """The config of a call on weights in the tile-contiguous layout (:mod:`qerl_kernels.layout`): the kernels that
    read it are the warpgroup-MMA kernel's plain loop (split-K or stream-K), the warp-specialised kernel (``WS``, either producer,
    any schedule), the dequantize + cuBLAS path (``DQ``) and the Triton tiles. Any other config (the plain kernel's
    pipelined or gathering variants, the decode kernels MMV / GEMV) becomes the untuned rule's
    warpgroup-MMA config (forward, M <= 128, on a GPU), ``DQ`` above ``DQ_ROWS`` rows, or a tile."""
    wg = cfg.get("WGMMA") and (cfg.get("WS") or not (cfg.get("PIPE") or cfg.get("XG")))
    if cfg.get("DQ") or wg or not (cfg.get("WGMMA") or cfg.get("MMV") or cfg.get("GEMV")):
        return cfg
    if kind == "fwd" and not interpret and M <= WGMMA_ROWS[1]:
        return wgmma_heuristic(M, N, K, sms)
    if M > DQ_ROWS:
        return dict(DQ=1, CHUNK=DQ_CHUNK)
    return _tile_fallback(interpret, cfg.get("SPLIT", 1))


def tiled_keeps(M: int, N: int, K: int, device: torch.device) -> bool:
    """Whether a forward of ``M`` rows on ``[N, K]`` weights (CUDA-graph launch mode) keeps its routed config when
    the weights are tiled (:func:`tiled_config` leaves it as is) — where it does, tiling changes only where the bytes
    lie, and every such key measured on the H100 ran 1.01–1.36x faster (reports/layout). False without whole
    64-row tiles and 128-wide K steps."""
    if N % 64 or K % 128:
        return False
    cfg = dict(config_for("fwd", M, N, K, device))
    cfg.pop("EAGER", None)
    sms = _sm_count(device.index or 0) if device.type == "cuda" else 1
    return tiled_config("fwd", cfg, M, N, K, sms, _interpreting()) == cfg


def _tile_fallback(interpret: bool, split: int = 1) -> dict:
    """The tensor-core tile every path steps down to."""
    return dict(BM=16, BN=64, BK=64, SWAP=0, SPLIT=split, num_warps=4, num_stages=1 if interpret else 3)


_ACT_DTYPES = (torch.bfloat16, torch.float16)
_SCALE_DTYPES = (torch.float8_e4m3fn, torch.uint8)


def _check(x, packed, scale, gs, k_dim: int, name: str) -> tuple[int, int]:
    """Validate a call's tensors (every eager call: written for few tensor attribute reads, ~0.1-0.8 µs each)."""
    if x.dtype not in _ACT_DTYPES:
        raise KernelInputError(f"{name}: activations must be bf16 or fp16, got {x.dtype}")
    shape = packed.shape
    if packed.dtype != torch.uint8 or len(shape) != 2:
        raise KernelInputError(f"{name}: packed weight must be 2-D uint8 [N, K/2], got {packed.dtype} {tuple(packed.shape)}")
    n, half_k = shape
    k = half_k * 2
    if k % 16:
        raise KernelInputError(f"{name}: K = {k} is not a multiple of 16")
    if scale.dtype not in _SCALE_DTYPES or scale.shape != (n, k // 16):
        raise KernelInputError(f"{name}: scale must be float8_e4m3fn [{n}, {k // 16}], got {scale.dtype} {tuple(scale.shape)}")
    if gs.numel() != 1 or gs.dtype != torch.float32:
        raise KernelInputError(f"{name}: global scale must be float32 [1], got {gs.dtype} {tuple(gs.shape)}")
    dev = x.device
    if not (packed.device == dev and scale.device == dev and gs.device == dev and x.is_contiguous()
            and packed.is_contiguous() and scale.is_contiguous() and gs.is_contiguous()):
        for t, tn in ((x, "activations"), (packed, "packed weight"), (scale, "scale"), (gs, "global scale")):
            if t.device != dev:
                raise KernelInputError(f"{name}: {tn} is on {t.device}, activations on {dev}")
            if not t.is_contiguous():
                raise KernelInputError(f"{name}: {tn} must be contiguous")
    if x.shape[-1] != (k if k_dim == 0 else n):
        want = k if k_dim == 0 else n
        raise KernelInputError(f"{name}: last dim of the input is {x.shape[-1]}, expected {want}")
    return n, k


def _pad_rank(a: torch.Tensor, dim: int) -> torch.Tensor:
    """tl.dot needs R >= 16: zero-pad the rank dimension (exact); the result is contiguous and 16-byte aligned."""
    r = a.shape[dim]
    if r >= 16 and r & (r - 1) == 0:  # (16-byte aligned: the decode kernel reads bf16 pairs as 32-bit words)
        return a.contiguous() if a.is_contiguous() and a.data_ptr() % 16 == 0 else a.clone(memory_format=torch.contiguous_format)
    target = max(16, 1 << (r - 1).bit_length())
    pad = [0, 0] * (a.ndim - 1 - dim) + [0, target - r]
    return torch.nn.functional.pad(a, pad).contiguous()


_LOCK_SLOTS = 1 << 16
_TAIL = 64  # the last slots of _locks: the fused LoRA's ticket, flag, counter; the PDL primary's tickets


@functools.lru_cache(maxsize=None)
def _locks(device: torch.device) -> torch.Tensor:
    """Per-device split-reduction tickets (int32, zero; every kernel leaves them at zero). Like
    Marlin's workspace: kernels using them must not run concurrently on two streams."""
    return torch.zeros(_LOCK_SLOTS, dtype=torch.int32, device=device)


@functools.lru_cache(maxsize=None)
def _lock_tail(device: torch.device) -> torch.Tensor:
    """The last ``_TAIL`` slots of :func:`_locks` (the fused LoRA's ticket, flag and counter; the PDL primary's
    tickets, one per row block and rank chunk), one view per device (a slice is ~1 µs of host time per call)."""
    return _locks(device)[_LOCK_SLOTS - _TAIL:]


def why_not(path: str, kind: str, K: int, x2, packed, scale, interpret: bool) -> str | None:
    """Why kernel ``path`` (:func:`path_of`) cannot run on these tensors, or None when it can: the warpgroup-MMA
    and register-fragment kernels are PTX (no interpreter) on bf16 activations (their raw bits feed the MMA) with
    16-byte aligned rows; the CUDA-core decode reads the packed rows as 32-bit words. The tiles and the
    dequantize + cuBLAS path run everywhere."""
    if path == "wgmma":
        if kind != "fwd":
            return "the warpgroup-MMA kernel is forward only"
        if interpret:
            return "Gluon kernels have no interpreter"
        if K % 128:
            return f"K = {K} is not a multiple of 128"
        if x2.dtype != torch.bfloat16:
            return f"activations are {x2.dtype}, not bf16"
        if x2.stride(0) % 8 or x2.data_ptr() % 16 or packed.data_ptr() % 16 or scale.data_ptr() % 4:
            return "activation rows or weights not 16-byte aligned (scales: 4)"
        if not _gluon_ok():
            return "this Triton has no Gluon warpgroup MMA"
    elif path == "mmv":
        if interpret:
            return "the register-fragment kernel is PTX (no interpreter twin)"
        if K % 32:
            return f"K = {K} is not a multiple of 32"
        if packed.data_ptr() % 16 or x2.data_ptr() % 16 or x2.stride(0) % 8:
            return "activation rows or weights not 16-byte aligned"
        if x2.dtype != torch.bfloat16:
            return f"activations are {x2.dtype}, not bf16"
    elif path == "gemv":
        if packed.data_ptr() % 4 or packed.stride(0) % 4:
            return "packed weight rows not 4-byte aligned"
    return None


def _runnable(kind: str, cfg: dict, M: int, K: int, x2, packed, scale, interpret: bool,
              notes: list | None = None, tiled: bool = False) -> dict:
    """The config itself when its path can run on these tensors (:func:`why_not`), else the next path down:
    warpgroup MMA -> the heuristic without it; register-fragment decode (MMV) -> the CUDA-core GEMV (its
    interpreter twin, same product; converts fp16); GEMV -> a tensor-core tile. ``notes`` collects why each step
    down was taken. ``tiled``: weights in the tile-contiguous layout (:func:`tiled_config`; steps down to a tile)."""
    sms = _sm_count(x2.device.index or 0) if x2.is_cuda else 132
    if tiled:
        cfg = tiled_config(kind, cfg, M, packed.shape[0], K, sms, interpret)

    def down(path: str) -> bool:
        reason = why_not(path, kind, K, x2, packed, scale, interpret)
        if reason and notes is not None:
            notes.append(f"{path}: {reason}")
        return reason is not None

    if cfg.get("WGMMA") and down("wgmma"):
        cfg = heuristic(kind, M, packed.shape[0], K, sms, wgmma=False)
        if tiled and not cfg.get("DQ"):
            return _tile_fallback(interpret, cfg.get("SPLIT", 1))
    if kind == "fwd" and cfg.get("MMV") and down("mmv"):
        cfg = dict(GEMV=1, BM=1 if M == 1 else (2 if M == 2 else 4), BN=32, BK=64, SPLIT=cfg.get("SPLIT", 1),
                   num_warps=4, num_stages=1)
    if kind == "fwd" and cfg.get("GEMV") and down("gemv"):
        cfg = _tile_fallback(interpret, cfg.get("SPLIT", 1))
    return dict(cfg)


def route_of(kind: str, x2: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
             tiled: bool = False) -> tuple[str, dict, list[str]]:
    """``(path, config, notes)`` of a call on these tensors (``kind`` "fwd" with ``x2 [M, K]``, or "bwd" with
    ``dy [M, N]``): the path the dispatcher launches, its resolved config and why any faster path was passed
    over — for debugging and the checks, not the hot path."""
    M, N, K = x2.shape[0], packed.shape[0], packed.shape[1] * 2
    interpret = _interpreting()
    notes: list[str] = []
    cfg = _runnable(kind, _for_launch_mode(config_for(kind, M, N, K, x2.device)), M, K, x2, packed, scale,
                    interpret, notes, tiled)
    return path_of(kind, cfg), cfg, notes


@functools.lru_cache(maxsize=None)
def _gluon_ok() -> bool:
    """Whether this Triton has Gluon's Hopper warpgroup MMA (the nvfp4_wgmma kernel)."""
    try:
        import qerl_kernels.nvfp4_wgmma  # noqa: F401
        return True
    except (ImportError, AttributeError):  # a Triton without Gluon / with another Gluon API
        return False


_RESOLVED: dict = {}


_RESOLVED_MAX = 4096
_SCOPE_IDS = itertools.count(1)  # a resolved key's scope: a small int, so that the launch memos hash it cheaply (a
# tuple's hash is not cached: the ~30-item key hashed per memo lookup cost µs per call), never reused for another key


def _resolved(kind: str, x2, packed, scale, gs, n_out: int, extra: tuple, r: int, interpret: bool, lora_a,
              tiled: bool = False) -> tuple:
    """``(scope, config, LoRA route, path)`` of a call, memoised on its key — everything that decides its launches:
    shape, dtype, device, the alignments ``_runnable`` checks (and the global scale's), ``QERL_KERNEL_CONFIG``, the launch mode, the optional
    tensors (:func:`_sig`), the rank and the experiment knobs. ``scope``, a number the key gets once, is the call's
    :func:`qerl_kernels.launch.scope`. The host-side cost of a decode call is what a token costs in an eager rollout,
    and a training micro-batch repeats each (M, N, K) for every layer, forward and backward. Training Ms vary per
    batch: the memo is cleared past ``_RESOLVED_MAX`` keys. The config is shared and read-only."""
    M, N, K = x2.shape[0], packed.shape[0], packed.shape[1] * 2
    key = (kind, M, N, K, x2.dtype, x2.device, interpret, packed.data_ptr() % 16, packed.stride(0) % 16,
           x2.data_ptr() % 16, x2.stride(0), scale.data_ptr() % 4, scale.stride(0) % 4, gs.data_ptr() % 16,
           _env(b"QERL_KERNEL_CONFIG"), _MODE[0], n_out, r, tuple(map(_sig, extra)), _sig(lora_a),
           LORA_LAUNCH, XA_PROGRAMS, XA_CHUNKS, XA_CHUNKS_SMALL, XA_SMALL_WEIGHTS, XA_QB, XA_STAGES, XA_PDL_AT, XA_PDL_AT_MMV, XA_PDL_ROWS, EAGER_XS_ROWS, HEURISTIC, TRANSFER,
           XA_RANK_CHUNKS, tiled, launch.chained(), LORA_INKERNEL_FLOPS, LORA_INKERNEL_DECODE_WEIGHTS)
    hit = _RESOLVED.get(key)
    if hit is None:
        if len(_RESOLVED) >= _RESOLVED_MAX:
            _RESOLVED.clear()
        cfg = _runnable(kind, _for_launch_mode(config_for(kind, M, N, K, x2.device)), M, K, x2, packed, scale,
                        interpret, tiled=tiled)
        route = lora_route(kind, cfg, M, K, LORA_LAUNCH, r) if lora_a is not None else "matmul"
        if lora_a is not None and kind == "fwd" and not tiled and r <= INKERNEL_MAX_RANK and (one := lora_inkernel(
                cfg, M, N, K, LORA_LAUNCH, _MODE[0] == "eager" and not launch.chained(),
                _sm_count(x2.device.index or 0) if x2.is_cuda else 1)):
            one = _runnable(kind, one, M, K, x2, packed, scale, interpret)
            if path_of(kind, one) == "tile_fwd":
                cfg, route = one, "inkernel"
        hit = _RESOLVED[key] = (next(_SCOPE_IDS), types.MappingProxyType(cfg), route, path_of(kind, cfg))
    return hit


def _sig(t) -> tuple | None:
    """What a launch specialises on for an optional tensor argument: None, or (dtype, 16-byte aligned, row stride)."""
    return None if t is None else (t.dtype, t.data_ptr() % 16, t.stride(0) if t.ndim > 1 else 0, t.shape[-1])


LAUNCH_MODES = ("eager", "graph")
_MODE = ["eager"]  # how the calls are launched (see launch_mode)


@contextlib.contextmanager
def launch_mode(mode: str):
    """Pick the configs for calls launched one by one from Python (``"eager"``, the default) or captured in / replayed from CUDA graphs (``"graph"``) inside the block. Use
    ``"graph"`` around the warm-up *and* the capture of a CUDA graph, so that the warm-up compiles the
    kernels the capture launches (``qerl bench kernels`` and the tuner time in this mode). The tuned entry of
    a decode size whose fastest kernel (timed in graphs) is the warpgroup-MMA one carries the single-launch
    decode kernel's config as ``EAGER``: an eager decode step is host-bound (~55-75 µs of host time per call,
    launch_overhead_v11_NVIDIA_H100_80GB_HBM3.json [ea84b65]) and the WGMMA route adds one launch (the activation pre-pass), or two
    with ``lora_a`` (the PDL primary)."""
    if mode not in LAUNCH_MODES:
        raise ValueError(f"launch_mode: mode must be one of {LAUNCH_MODES}, got {mode!r}")
    prev, _MODE[0] = _MODE[0], mode
    try:
        yield
    finally:
        _MODE[0] = prev


def _for_launch_mode(cfg: dict) -> dict:
    """The config for the current :func:`launch_mode`: in eager mode a tuned entry's ``EAGER`` config, and a
    dequantize + cuBLAS config in one window (``CHUNK`` 0: up to ``MAX_WINDOW`` weights, 256 MiB of scratch).
    The tuned ``CHUNK`` was timed in CUDA graphs, where windows cost nothing on the host; called eagerly from
    a training step (M = 2-5 k rows) each window is a dequantize launch, a GEMM and views (~50 µs of host
    time), and the step was host-bound on them (reports/step/README.md)."""
    eager = cfg.pop("EAGER", None)
    if _MODE[0] != "eager":
        return cfg
    if eager is not None:
        return dict(eager)
    forced = json.loads(os.environ.get("QERL_KERNEL_CONFIG", "{}"))  # a forced CHUNK stays (tests, experiments)
    return {**cfg, "CHUNK": 0} if cfg.get("DQ") and "CHUNK" not in forced else cfg


XA_PRODUCERS = (16, 64)  # programs computing x · lora_aᵀ in a fused decode launch: ~256 K each, within these
# Experiment knobs (module attributes, set in code by the checks and the tuner; nothing is read from the
# environment at import): the LoRA route (see lora_route; "fused" | "pdl" | "inkernel" force one) and the PDL primary's shape
LORA_LAUNCH = "auto"
XA_PDL_ROWS = 64  # the PDL primary's row blocks: 16 rows each, one ticket per block (and rank chunk) in the tail
# the PDL primary's shape (experiments; the defaults are the measured configuration): its K shares (programs per
# rank chunk), partials summed per load round by the last one, chunk-loop pipeline depth, release point. Before the
# warpgroup-MMA kernel (measured 2026-11-26, xa_shares): few pipelined shares released at their start; before the
# register-fragment decode kernel (eager M 9-16 with K > 8192; not measured again): one share per 128-wide chunk,
# pipelined above K = 8192, released after its loads
XA_PROGRAMS = 64  # at most this many K shares
XA_CHUNKS = 14  # 128-wide K chunks per K share (xa_shares)
XA_CHUNKS_SMALL = 4  # the same before a short kernel: weights of at most XA_SMALL_WEIGHTS (xa_shares)
XA_SMALL_WEIGHTS = 48 << 20
XA_QB = 16
XA_STAGES = 0  # 0: auto, see _xa_stages
XA_PDL_AT = 1  # lora_xa releases the decode launch at its start (1) / after its loads (2)
XA_PDL_AT_MMV = 2  # the same before the register-fragment decode kernel
XA_RANK_CHUNKS = True  # lora_xa above rank 32: one program per 32 ranks and K share (xa_rank_chunk)


def _xa_stages(K: int, mmv: bool = False) -> int:
    """The PDL primary's chunk-loop pipeline depth: 3 (each K share loops over ~``XA_CHUNKS`` chunks,
    :func:`xa_shares`); before the register-fragment kernel (``mmv``: one chunk per share) 3 above K = 8192, else 1;
    ``XA_STAGES`` forces one."""
    return XA_STAGES or (3 if not mmv or K > 8192 else 1)


def xa_shares(K: int, mmv: bool = False, N: int = 0) -> int:
    """The PDL primary's K shares (programs per rank chunk): ``ceil(K / (128 · XA_CHUNKS))``, at most
    ``XA_PROGRAMS`` — 2 at K = 3584, 11 at 18944 — and ``XA_CHUNKS_SMALL`` chunks per share before a kernel of at most
    ``XA_SMALL_WEIGHTS`` weights (``N · K``: 7 at the 7B q/k/v and o; the launcher passes ``N`` at M <= 16 only).

    Measured on the H100 (7B projections, M = 8, CUDA graphs): against one share per chunk (28 / 64), released
    after its loads, with the final sum of every share's partial, few pipelined shares released at their start
    cut the LoRA call's cost over the bare kernel from 5.0 / 2.5 / 11.1 / 3.8 µs to 2.2 / 2.1 / 2.2 / 3.3 (q/k/v,
    o, gate/up, down; reports/kernels/evidence/lora_xa_shape_7B_*, row-major weights). On tiled weights the short
    kernels (q/k/v ~10.5 µs, o ~9.5) no longer cover that primary: 4 chunks per share cut q/k/v's cost at rank 128
    from 5.4 to 3.0 µs and o's at rank 32 from 4.4 to 2.4, while gate/up at rank 128 went from 4.1 to 7.5 and down
    at rank 32 from 2.0 to 3.4 — the long kernels keep 14 (reports/kernels/evidence/lora_xa_shares_tiled_7B_*). The
    7B rollout at batch 8 went from 2,182 to 2,244 tok/s with this rule and the M = 8 search (one machine); at batch 64
    the rule alone made 9,774 against 9,868 without it, so it stops at M = 16.
    ``mmv`` (before the register-fragment kernel): one share per chunk, as before."""
    chunks = 1 if mmv else (XA_CHUNKS_SMALL if 0 < N * K <= XA_SMALL_WEIGHTS else XA_CHUNKS)
    return max(1, min(XA_PROGRAMS, -(-K // (128 * chunks))))


XA_PDL_MAX_RANK = 256  # the PDL primary's rank in one program at most: its [16, R] partials sit in shared memory
# (R = 1,024 in one program asked 532 KB of the H100's 227 KB: tools/wgmma_check.py, 2026-11-27)


def primary_takes(r: int) -> bool:
    """Whether the PDL primary (:mod:`qerl_kernels.lora_xa`) takes a rank-``r`` adapter: in rank chunks
    (:func:`xa_rank_chunk`) or in one program up to :data:`XA_PDL_MAX_RANK`."""
    return r <= XA_PDL_MAX_RANK or xa_rank_chunk(r) > 0


def lora_route(kind: str, cfg: dict, M: int, K: int, mode: str = "auto", r: int = 0) -> str:
    """How a call with ``lora_a`` (rank ``r``, padded) gets ``xa = x · lora_aᵀ``: ``"fused"`` (producer programs
    inside the decode kernel's launch), ``"pdl"`` (a preceding :mod:`qerl_kernels.lora_xa` launch that the decode
    kernel overlaps through programmatic dependent launch and waits for in its epilogue) or
    ``"matmul"`` (``x @ lora_a.T`` first). Measured on the H200 (reports/kernels/README.md, LoRA section):
    fused at M <= 8 and at M <= 16 with K <= 8192 (one launch: also the cheapest host path for eager
    rollouts); PDL at M = 9..16 with K > 8192, where it added 11-15% against 15-21% for ``x @ lora_a.T``
    + the kernel; tiles (M > 16) and the backward use the matmul. PDL needs the register-prefetch decode
    kernel (MMV). The warpgroup-MMA kernel takes PDL up to
    ``XA_PDL_ROWS`` rows ("fused": the matmul). A rank the primary does not take (:func:`primary_takes`) gets the
    matmul instead of PDL."""
    pdl = "pdl" if primary_takes(r) else "matmul"
    if kind == "fwd" and cfg.get("WGMMA") and M <= XA_PDL_ROWS:  # its LoRA epilogue waits on a PDL primary
        return "matmul" if mode == "fused" else pdl
    if kind != "fwd" or M > 16:
        return "matmul"
    if not cfg.get("MMV"):
        return "matmul"
    fits = M <= 8 or K <= 8192
    if mode == "fused":
        return "fused" if fits else "matmul"
    if mode == "pdl":
        return pdl
    return "fused" if fits else pdl


def _pdl_primary(x2, lora_a, M: int, K: int, r: int, locks, mmv: bool = False, N: int = 0) -> torch.Tensor:
    """Launch :mod:`qerl_kernels.lora_xa` (the PDL primary) and return its ``xa [16 B, R]`` (bf16, B = ceil(M / 16)
    row blocks, rows >= M zero): the launch right before a kernel launched with ``launch_pdl`` that waits
    for it (``griddepcontrol.wait``) before its LoRA epilogue. One ticket per row block (M <= ``XA_PDL_ROWS``) and
    rank chunk (:func:`xa_rank_chunk`) in the tail of ``locks``. ``mmv``: before the register-fragment decode
    kernel (its own shares, depth and release point: ``XA_PDL_AT_MMV``). ``N``: the kernel's weight rows
    (:func:`xa_shares`)."""
    from qerl_kernels.lora_xa import _lora_xa_kernel

    blocks = -(-M // 16)
    xa = torch.empty(16 * blocks, r, device=x2.device, dtype=x2.dtype)
    nxp = xa_shares(K, mmv, N)
    rb = xa_rank_chunk(r)
    xap = _partials(x2.device, blocks * nxp * 16 * r, "xap")
    launch.run(_lora_xa_kernel, (nxp * (r // rb if rb else 1), blocks),
               (x2, lora_a, xa, xap, _lock_tail(locks.device), locks, M, K, x2.stride(0), nxp),
               dict(R=r, KB=128, QB=max(1, min(XA_QB, 512 // (rb or r))), PDL=XA_PDL_AT_MMV if mmv else XA_PDL_AT,
                    STAGES=_xa_stages(K, mmv), RB=rb, num_warps=4, num_stages=1))
    return xa


def xa_rank_chunk(r: int) -> int:
    """The PDL primary's rank chunk for a rank-``r`` adapter: 32 ranks per program (and per ticket and final sum)
    above rank 32 where ``r`` is a multiple of 32 (at most 16 chunks: ``_TAIL`` / 4 row blocks), else 0 (all ranks
    in one program). Measured on the H100 (7B, M = 8, CUDA graphs; reports/kernels/evidence/lora_xa_rank_chunks_7B_*):
    the whole-rank primary, one program summing every K share's ``[16, R]`` partial, took 8.7 / 16.4 / 41.1 µs at
    R = 32 / 64 / 128, and the engine's fused q/k/v call (R = 128) 45.6 µs against 11.0 without LoRA (chunks:
    9.1 and 14.9 µs)."""
    return 32 if XA_RANK_CHUNKS and r > 32 and r % 32 == 0 and r // 32 <= _TAIL // 4 else 0


@dataclass(slots=True)  # (~0.3 us to build on this CPU box; a call costs ~55-75 us of host time eagerly)
class _Call:
    """One kernel call as the launchers see it: the 2-D operand ``x2`` (activations, or ``dy`` backward), the packed
    weight, its scales, ``extra`` (forward: ``(bias, xa, lora_b)``; backward: ``(dyb, lora_a)``), the resolved
    ``cfg`` (shared by every call of the scope: read-only) and, forward with ``lora_a``, whether ``xa`` comes from a PDL
    primary (``pdl``) or from producer programs of the decode launch (``lora_a`` kept)."""

    kind: str
    x2: torch.Tensor
    packed: torch.Tensor
    scale: torch.Tensor
    gs: torch.Tensor
    n_out: int
    extra: tuple
    lora_scale: float
    r: int
    interpret: bool
    cfg: types.MappingProxyType
    lora_a: torch.Tensor | None = None
    pdl: bool = False
    tiled: bool = False

    @property
    def M(self) -> int:
        return self.x2.shape[0]

    @property
    def s8(self) -> torch.Tensor:
        """The scales as uint8 (the kernels decode the E4M3 bits themselves; no new view where they are uint8)."""
        return self.scale if self.scale.dtype == torch.uint8 else self.scale.view(torch.uint8)

    @property
    def N(self) -> int:
        return self.packed.shape[0]

    @property
    def K(self) -> int:
        return self.packed.shape[1] * 2


def path_of(kind: str, cfg: dict) -> str:
    """The kernel path a resolved config runs: ``wgmma`` (warpgroup MMA, :mod:`.nvfp4_wgmma`), ``dq`` (dequantize
    windows + cuBLAS, :mod:`.nvfp4_dequant`), ``mmv`` (register-fragment decode, :mod:`.nvfp4_mmv`), ``gemv``
    (CUDA-core decode, :mod:`.nvfp4_gemv`), ``tile_fwd`` / ``tile_bwd`` (tensor-core tiles, :mod:`.nvfp4_matmul`)."""
    if cfg.get("WGMMA"):
        return "wgmma"
    if cfg.get("DQ"):
        return "dq"
    if kind == "fwd" and cfg.get("MMV"):
        return "mmv"
    if kind == "fwd" and cfg.get("GEMV"):
        return "gemv"
    return "tile_fwd" if kind == "fwd" else "tile_bwd"


def _launch(kind, x2, packed, scale, gs, n_out, extra, lora_scale, r, interpret, lora_a=None, tiled=False):
    """One call of the path ``config_for`` picks (:func:`path_of`, one launcher each), its launches in the call's
    scope (:mod:`qerl_kernels.launch`). ``lora_a`` (forward; ``extra`` = (bias, None, lora_b)): ``xa = x · lora_aᵀ``
    as :func:`lora_route` says (inside the decode kernel's launch, from a PDL launch before it, or from one
    ``x @ lora_a.T`` first)."""
    scope, cfg, route, path = _resolved(kind, x2, packed, scale, gs, n_out, extra, r, interpret, lora_a, tiled)
    if lora_a is not None and route == "matmul":  # (a given xa is this product: the training op's)
        extra, lora_a = (extra[0], x2 @ lora_a.T if extra[1] is None else extra[1], extra[2]), None
    elif lora_a is not None and extra[1] is not None:  # the launch computes xa itself, as without one given
        extra = (extra[0], None, extra[2])
    if tiled and path not in _TILED_PATHS:  # (tiled_config keeps every other path out)
        raise AssertionError(f"qerl_kernels.ops: path {path} cannot read tiled weights")
    call = _Call(kind, x2, packed, scale, gs, n_out, extra, lora_scale, r, interpret, cfg, lora_a, route == "pdl",
                 tiled)
    prev = launch.scope(scope)
    try:
        return _LAUNCHERS[path](call)
    finally:
        launch.restore(prev)


def _wgmma_static(c: _Call) -> tuple:
    """:func:`_launch_wgmma`'s static part (per scope): ``(split, stream-K, WS, outside, kernel keywords)``."""
    cfg = c.cfg
    split = int(cfg.get("SPLIT", 1))
    wg, bt = int(cfg.get("C", 2) if cfg.get("WS") else cfg.get("WG", 1)), int(cfg.get("BT", 64))
    rows = 64 * int(cfg.get("MT", 1)) * (1 if cfg.get("KS") else wg)  # weight rows per program (KS: C share 64·MT)
    tiles = launch.cdiv(c.N, rows) * launch.cdiv(c.M, bt)
    if cfg.get("WS"):  # one ticket per consumer sub-tile (KS: consumer 0's)
        tiles *= wg
    if tiles > _LOCK_SLOTS - _TAIL:
        split = 1
    sk = bool(cfg.get("SK")) and tiles <= _LOCK_SLOTS - _TAIL  # (more tiles than tickets: one program per tile)
    lb = c.extra[2]
    if cfg.get("WS"):
        ns, outside = ws_stages(cfg, lb.shape[1] if lb is not None else 0)
        kw = dict(C=int(cfg.get("C", 2)), MT=int(cfg.get("MT", 1)), BT=bt, NS=ns, SPLIT=split,
                  OCC=int(cfg.get("OCC", 1)), SK=int(sk), TMA=int(cfg.get("TMA", 0)), DB=int(cfg.get("DB", 0)),
                  KS=int(cfg.get("KS", 0)), TILED=int(c.tiled))
        return split, sk, True, outside, kw
    kw = {**{k: v for k, v in cfg.items() if k != "SK"}, "SPLIT": split, **({"SK": cfg["SK"]} if sk else {}),
          **({"TILED": 1} if c.tiled else {})}
    return split, sk, False, False, kw


def _launch_wgmma(c: _Call) -> torch.Tensor:
    """Warpgroup MMA, decoded weights as the register operand (M 17..128; where tuned: 1..16, 256; ``SK``: the
    stream-K schedule; ``WS``: the warp-specialised kernel, :mod:`qerl_kernels.nvfp4_wgmma_ws`, M 32..512 where
    tuned)."""
    from qerl_kernels.nvfp4_wgmma import nvfp4_wgmma_matmul, permute_activations

    split, sk, ws, outside, kw = launch.memo(_wgmma_static, c)
    bias, xa, lb = c.extra
    locks, xperm = _locks(c.x2.device), None
    # stream-K: the wrapper sizes its partial-tile workspace (2 tiles per program); without split-K: none
    part = _partials(c.x2.device, split * c.M * c.N) if split > 1 and not sk else None
    # The launch chain (launch.chain): the pre-pass and the kernel join it — the plain kernel issues its first weight
    # steps before its wait (EW), the warp-specialised one does not — and the kernel releases its successor at its
    # start. With the LoRA primary the chain ends at the primary: an ordinary launch, the kernel its dependent as
    # outside the chain (main loop under the primary, the wait before the epilogue). Measured on the H100 and not
    # kept (7B, ms per decode step, A/B on one machine, reports/rollout/evidence/7B_session20_launch_chain_*):
    # the primary chained and waited for before the main loop, 4.02 against 3.42 at batch 8 (its 3-5 µs no longer
    # under the main loop); chained with a flag the kernel spins on instead, 3.34 / 3.37 against 3.38 / 3.35 at
    # batch 8 and 5.95 / 5.97 against 5.87 / 5.88 at 64; the LoRA term from one more split-K program per tile instead
    # of the last share's epilogue, 3.38 / 3.37 against 3.33 / 3.39 at batch 8.
    chained = launch.chained() and not c.interpret
    chain = chained and not ws
    if c.pdl:  # permute first: the PDL primary (xa [16, R]) must be the launch right before the kernel
        xperm = None if c.cfg.get("XG") or c.cfg.get("XS") else permute_activations(c.x2, wait=chained)
        xa = _pdl_primary(c.x2, c.lora_a, c.M, c.K, c.r, locks, N=c.N if c.M <= 16 else 0)  # (xa_shares)
    if ws:  # the warp-specialised kernel (pre-permuted activations; split-K or stream-K)
        from qerl_kernels.nvfp4_wgmma_ws import nvfp4_ws_matmul

        if outside:  # the LoRA epilogue does not fit beside the ring: the base here, s · xa · lora_bᵀ after
            xa = xa[:c.M]  # (from the PDL primary, which then releases an ordinary launch, or x · lora_aᵀ)
        # without the LoRA primary the permutation is this kernel's PDL primary (its producer waits for it)
        y = nvfp4_ws_matmul(c.x2, c.packed, c.s8, c.gs, bias, None if outside else xa,
                            None if outside else lb, c.lora_scale,
                            xp=permute_activations(c.x2, pdl=not c.interpret, wait=chained) if xperm is None else xperm,
                            xwait=xperm is None and not c.interpret, part=part, lock=locks,
                            pdl=c.pdl and not outside, trig=chained, **kw)
        return y.addmm_(xa, lb.T, alpha=c.lora_scale) if outside else y
    return nvfp4_wgmma_matmul(c.x2, c.packed, c.s8, c.gs, bias, xa, lb, c.lora_scale, **kw, xp=xperm, part=part,
                              lock=locks, pdl=c.pdl, ew=chain and not c.pdl, trig=chain)


def ws_stages(cfg: dict, r: int) -> tuple[int, bool]:
    """``(NS, outside)`` for a ``WS`` config called with a rank-``r`` LoRA epilogue (``r`` = 0: none): the tuned
    ring depth, or a shallower one where the epilogue's ``xa`` tiles would push the program past the shared memory
    (:func:`qerl_kernels.nvfp4_wgmma_ws.fit_stages`); ``outside`` where no ring fits beside them — the kernel then
    runs without the epilogue and the LoRA term is one ``addmm`` after it."""
    from qerl_kernels.nvfp4_wgmma_ws import fit_stages

    C, MT, BT, NS = int(cfg.get("C", 2)), int(cfg.get("MT", 1)), int(cfg.get("BT", 64)), int(cfg.get("NS", 4))
    ns = fit_stages(C, MT, BT, NS, r, bool(cfg.get("KS")), bool(cfg.get("DB")))
    return (ns, False) if ns else (NS, True)  # (outside: the tuned ring, which fits without the xa tiles)


def _launch_dq(c: _Call) -> torch.Tensor:
    """Dequantize windows of W + cuBLAS (large M)."""
    from qerl_kernels.nvfp4_dequant import dq_backward, dq_forward

    chunk, s8 = int(c.cfg.get("CHUNK", DQ_CHUNK)), c.s8
    run = dq_forward if c.kind == "fwd" else dq_backward
    return run(c.x2, c.packed, s8, c.gs, *c.extra, c.lora_scale, chunk, c.interpret, tiled=c.tiled)


def _tile_static(c: _Call, producers: int = 0) -> tuple:
    """What every Triton tile launch shares and the scope fixes (:func:`qerl_kernels.launch.memo`): ``(cfg, split,
    (BM, BN, BK), common)`` — the config less SPLIT, BM, BN, BK and XPAD, the split (1 where its tickets would not
    fit), the tile sizes and the common constexprs."""
    cfg, M, N, K = dict(c.cfg), c.M, c.N, c.K
    split = cfg.pop("SPLIT")
    BM, BN, BK = cfg.pop("BM"), cfg.pop("BN"), cfg.pop("BK")
    cfg.pop("XPAD", 0)
    tiles = launch.cdiv(M, BM) * (launch.cdiv(N, BN) + producers if c.kind == "fwd" else launch.cdiv(K, BK))
    if split > 1 and tiles > _LOCK_SLOTS - _TAIL:  # the tail: the fused LoRA's ticket, flag, counter
        split = 1
    red = int(cfg.pop("RED", 0))  # split-K partials the reduction loads per round (nvfp4_matmul.split_red)
    if split > 1 and not red:
        from qerl_kernels.nvfp4_matmul import split_red

        red = split_red(BM, BN if c.kind == "fwd" else BK, int(cfg.get("num_warps", 4)))
    common = dict(USE_SPLIT=split > 1, EVEN_K=K % BK == 0, BM=BM, BN=BN, BK=BK, FAST=not c.interpret,
                  DOT_FP32=c.interpret, RED=red if split > 1 else 1, **({"TILED": True} if c.tiled else {}))
    return cfg, split, (BM, BN, BK), common


@functools.lru_cache(maxsize=None)
def _no_split(device: torch.device) -> torch.Tensor:
    """The fp32 stand-in for the split-K partials of a launch without split-K (never read or written)."""
    return torch.zeros(1, dtype=torch.float32, device=device)


def _sizes(c: _Call, x_stride: int | None = None) -> tuple:
    """``(M, N, K, x row stride, out row stride, packed row stride, scale row stride)`` of a call, as the Triton tile
    launchers pass them: fixed by the scope (the key holds the activations' row stride; the weights are contiguous
    [N, K/2] / [N, K/16] and the output a fresh [M, n_out]), so read once (:func:`qerl_kernels.launch.memo`).
    ``x_stride``: the stride of a padded copy of the activations instead."""
    return (c.M, c.N, c.K, c.x2.stride(0) if x_stride is None else x_stride, c.n_out, c.packed.stride(0),
            c.s8.stride(0))


PART_MAX = 8 << 20  # floats (32 MiB): the largest fp32 scratch an eager call takes from a shared workspace
_PARTS: dict = {}  # (role, device) -> [the workspace, the ones it outgrew] (see _partials)


def _partials(dev: torch.device, n: int, role: str = "part") -> torch.Tensor:
    """fp32 ``[>= n]`` scratch for one launch: its split-K partials (``role`` "part") or the LoRA ``xa`` partials of
    its producer programs or of its PDL primary ("xap"; a role per buffer that a launch or an overlapping pair of
    launches uses at once). Eager calls (:func:`launch_mode` ``"eager"``) share a per-device workspace per role, grown
    to the largest ``n`` asked (up to :data:`PART_MAX`), instead of an allocation per call (~5 µs of host time on the
    H100 machines' CPUs): a launch writes its partials and reduces them before it ends, and a launch on the stream
    writes only once the one before it has ended (in the launch chain too: each kernel waits before its first write;
    a PDL primary's dependent reads only its own primary's partials) — like the tickets (:func:`_locks`), the
    kernels must not run concurrently on two streams. An outgrown workspace is kept, not freed: a CUDA graph captured
    in eager mode may hold its address. In graph mode (the engine's captures) and above :data:`PART_MAX`, a fresh
    tensor per call."""
    if _MODE[0] != "eager" or n > PART_MAX:
        return torch.empty(n, device=dev, dtype=torch.float32)
    key = (role, dev)
    held = _PARTS.get(key)
    if held is None or held[0].numel() < n:
        size = min(PART_MAX, max(n, 2 * held[0].numel() if held else 1 << 16))
        held = _PARTS[key] = [torch.empty(size, device=dev, dtype=torch.float32)] + (held or [])
    return held[0]


def _buffers(c: _Call, split: int) -> tuple:
    """Per call: the output ``[M, n_out]`` and the split-K partials (fp32, ``>= split · M · n_out``: :func:`_partials`;
    a shared stand-in without split-K) and the device's tickets."""
    dev = c.x2.device
    out = torch.empty(c.M, c.n_out, device=dev, dtype=c.x2.dtype)
    part = _partials(dev, split * c.M * c.n_out) if split > 1 else _no_split(dev)
    return out, part, _locks(dev)


def _mmv_static(c: _Call) -> tuple:
    """The MMV launch's static part (per scope): ``(grid, split, xp, xpad, pdl, kw)``."""
    M, N, K = c.M, c.N, c.K
    xp = min(XA_PRODUCERS[1], max(XA_PRODUCERS[0], -(-K // 256))) if c.lora_a is not None and not c.pdl else 0
    xpad = c.cfg.get("XPAD", 0)  # activations copied to a padded row stride first
    cfg, split, (BM, BN, BK), _ = _tile_static(c, xp)
    mmv = cfg.pop("MMV")
    rb = int(cfg.pop("RB", 1))  # blocks of 16 weight rows per warp
    if mmv != 1 or BM not in (8, 16, 32, 64) or BN not in (32, 64, 128, 256) or BK != 128 or rb not in (1, 2):
        raise ValueError(f"MMV config needs MMV 1, BM 8|16|32|64, BN = 16 x RB x warps, BK 128, RB 1|2; "
                         f"got MMV={mmv} BM={BM} BN={BN} BK={BK} RB={rb}")
    warps = BN // (16 * rb)  # 16 x RB weight rows per warp, BM = 8 x NB activation rows, BK = 128
    grid = (launch.cdiv(N, BN) + xp, launch.cdiv(M, BM), split)
    # rows at a 128-byte multiple stride put every activation row's fragment loads on the same L1 banks; a copy
    # with 16 more bytes per row spreads them (up to 19% on gate/up projections, a loss on small ones, H200:
    # mmv_xpad_sweep_NVIDIA_H200.json [ea84b65]; tuned keys carry XPAD where it won)
    xpad = bool(xpad and M > 1 and c.x2.stride(0) * c.x2.element_size() % 128 == 0)
    pdl = c.lora_a is not None and c.pdl
    bias = c.extra[0]
    kw = dict(HAS_BIAS=bias is not None, R=c.r, USE_SPLIT=split > 1, EVEN_K=K % 128 == 0, WARPS=warps, NB=BM // 8,
              PREFETCH=cfg.get("num_stages", 1), XPRE=cfg.get("XPRE", 1), L2=cfg.get("L2", 0), PFD=cfg.get("PFD", 0),
              FUSED=xp > 0, UNROLL=bool(cfg.get("UNROLL", 0)), XP=xp, RB=rb, PDL=pdl, num_warps=warps, num_stages=1,
              launch_pdl=pdl)
    return grid, split, xp, xpad, pdl, kw, _sizes(c, K + 8 if xpad else None)


def _launch_mmv(c: _Call) -> torch.Tensor:
    """Tensor cores on register fragments (decode sizes; 8 x NB activation rows per program)."""
    from qerl_kernels.nvfp4_mmv import _nvfp4_mmv_kernel

    grid, split, xp, xpad, pdl, kw, sizes = launch.memo(_mmv_static, c)
    M, N, K = sizes[:3]
    out, part, locks = _buffers(c, split)
    bias, xa, lb = c.extra
    x2, s8, dummy = c.x2, c.s8, c.x2
    if xpad:
        padded = torch.empty(M, K + 8, device=x2.device, dtype=x2.dtype)
        padded[:, :K].copy_(x2)
        x2 = padded[:, :K]
    xap = dummy
    if pdl:  # xa [16, R] by the preceding launch, overlapped with this one
        xa = _pdl_primary(x2, c.lora_a, M, K, c.r, locks, mmv=True)
    if xp:  # xa [16, R] written by the launch's producer programs, their fp32 partials in xap
        xa = torch.empty(16, c.r, device=x2.device, dtype=x2.dtype)
        xap = _partials(x2.device, xp * 16 * c.r, "xap")
    launch.run(_nvfp4_mmv_kernel, grid, (
        x2, c.packed, s8, c.gs, out, bias if bias is not None else dummy, xa if xa is not None else dummy,
        lb if lb is not None else dummy, part, locks, c.lora_a if xp else dummy, xap, _lock_tail(locks.device), *sizes,
        float(c.lora_scale), split), kw)
    return out


def _gemv_static(c: _Call) -> tuple:
    cfg, split, (BM, BN, BK), common = _tile_static(c)
    cfg.pop("GEMV"), common.pop("DOT_FP32"), common.pop("RED"), cfg.pop("SWAP", None)
    grid = (launch.cdiv(c.N, BN), launch.cdiv(c.M, BM), split)
    return grid, split, dict(HAS_BIAS=c.extra[0] is not None, R=c.r, **common, **cfg), _sizes(c)


def _launch_gemv(c: _Call) -> torch.Tensor:
    """CUDA-core path for decode sizes (reads the packed rows as 32-bit words)."""
    from qerl_kernels.nvfp4_gemv import _nvfp4_gemv_kernel

    grid, split, kw, (M, N, K, sx, so, sp, ss) = launch.memo(_gemv_static, c)
    out, part, locks = _buffers(c, split)
    bias, xa, lb = c.extra
    s8, dummy = c.s8, c.x2
    launch.run(_nvfp4_gemv_kernel, grid, (
        c.x2, c.packed, s8, c.gs, out, bias if bias is not None else dummy, xa if xa is not None else dummy,
        lb if lb is not None else dummy, part, locks, M, N, K, sx, so, sp // 4, ss, float(c.lora_scale), split), kw)
    return out


def _tile_fwd_static(c: _Call) -> tuple:
    cfg, split, (BM, BN, BK), common = _tile_static(c)
    cfg.pop("GEMV", None), cfg.pop("MMV", None)
    grid = (launch.cdiv(c.N, BN), launch.cdiv(c.M, BM), split)
    lxa = {"LXA": True} if c.lora_a is not None else {}  # (the "inkernel" LoRA route: x · lora_aᵀ in the launch)
    return grid, split, dict(HAS_BIAS=c.extra[0] is not None, R=c.r, SWAP=bool(cfg.pop("SWAP", 0)), **common, **cfg,
                             **lxa), _sizes(c)


def _launch_tile_fwd(c: _Call) -> torch.Tensor:
    """Tensor-core tiles, forward (every M); with ``lora_a`` kept (route "inkernel") the kernel computes ``xa``."""
    from qerl_kernels.nvfp4_matmul import _nvfp4_fwd_kernel

    grid, split, kw, sizes = launch.memo(_tile_fwd_static, c)
    out, part, locks = _buffers(c, split)
    bias, xa, lb = c.extra
    xa = c.lora_a if c.lora_a is not None else xa
    s8, dummy = c.s8, c.x2
    launch.run(_nvfp4_fwd_kernel, grid, (
        c.x2, c.packed, s8, c.gs, out, bias if bias is not None else dummy, xa if xa is not None else dummy,
        lb if lb is not None else dummy, part, locks, *sizes, float(c.lora_scale), split), kw)
    return out


def _tile_bwd_static(c: _Call) -> tuple:
    cfg, split, (BM, BN, BK), common = _tile_static(c)
    cfg.pop("GEMV", None), cfg.pop("MMV", None)
    grid = (launch.cdiv(c.K, BK), launch.cdiv(c.M, BM), split)
    return grid, split, dict(R=c.r, SWAP=bool(cfg.pop("SWAP", 0)), **common, **cfg), _sizes(c)


def _launch_tile_bwd(c: _Call) -> torch.Tensor:
    """Tensor-core tiles, backward ``dX`` (tiles over (M, K), loops over N)."""
    from qerl_kernels.nvfp4_matmul import _nvfp4_bwd_kernel

    grid, split, kw, sizes = launch.memo(_tile_bwd_static, c)
    out, part, locks = _buffers(c, split)
    dyb, la = c.extra
    s8, dummy = c.s8, c.x2
    launch.run(_nvfp4_bwd_kernel, grid, (
        c.x2, c.packed, s8, c.gs, out, dyb if dyb is not None else dummy, la if la is not None else dummy, part, locks,
        *sizes, float(c.lora_scale), split), kw)
    return out


_TILED_PATHS = ("wgmma", "dq", "tile_fwd", "tile_bwd")  # the launchers that take the tile-contiguous layout
_LAUNCHERS = {"wgmma": _launch_wgmma, "dq": _launch_dq, "mmv": _launch_mmv, "gemv": _launch_gemv,
              "tile_fwd": _launch_tile_fwd, "tile_bwd": _launch_tile_bwd}


_ENV_BYTES = getattr(os.environ, "_data", None) if os.name == "posix" else None  # CPython's store behind os.environ


def _env(name: bytes) -> bytes | str | None:
    """``os.environ.get(name)`` for the per-call reads of the hot path, as the raw value (bytes on POSIX): CPython
    keeps the environment in ``os.environ._data`` keyed by encoded names (``os.environ[...] = `` and ``putenv`` through
    ``os.environ`` update it; tests' ``monkeypatch.setenv`` does), and ``os.environ.get`` encodes the name and decodes
    the value through two Python frames, ~1 µs a read on the H100 machines' CPUs."""
    if isinstance(_ENV_BYTES, dict):
        return _ENV_BYTES.get(name)
    return os.environ.get(name.decode())


def _interpreting() -> bool:
    v = _env(b"TRITON_INTERPRET")
    return v == b"1" or v == "1"


def _matmul_impl(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, gs: torch.Tensor,
                 bias: torch.Tensor | None, xa: torch.Tensor | None, lora_b: torch.Tensor | None,
                 lora_scale: float, lora_a: torch.Tensor | None = None, tiled: bool = False) -> torch.Tensor:
    """The forward behind the custom op ``qerl::nvfp4_matmul`` (eager calls come here directly)."""
    x2 = x if x.ndim == 2 else x.reshape(-1, x.shape[-1])
    r = 0
    if xa is not None:
        xa = _pad_rank(xa.reshape(-1, xa.shape[-1]).to(x.dtype), 1)
        r = xa.shape[1]
    if lora_a is not None:  # xa = x · lora_aᵀ computed here (fused into the decode kernel's launch)
        lora_a = _pad_rank(lora_a.to(x.dtype), 0)
        r = lora_a.shape[0]
    if lora_b is not None:
        lora_b = _pad_rank(lora_b.to(x.dtype), 1)
    out = _launch("fwd", x2.contiguous(), packed, scale, gs, packed.shape[0], (bias, xa, lora_b), lora_scale, r,
                  _interpreting(), lora_a, tiled)
    return out if x.ndim == 2 else out.reshape(*x.shape[:-1], packed.shape[0])


@torch.library.custom_op("qerl::nvfp4_matmul", mutates_args=())
def _matmul_op(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, gs: torch.Tensor,
               bias: torch.Tensor | None, xa: torch.Tensor | None, lora_b: torch.Tensor | None,
               lora_scale: float, lora_a: torch.Tensor | None = None, tiled: bool = False) -> torch.Tensor:
    return _matmul_impl(x, packed, scale, gs, bias, xa, lora_b, lora_scale, lora_a, tiled)


@_matmul_op.register_fake
def _(x, packed, scale, gs, bias, xa, lora_b, lora_scale, lora_a=None, tiled=False):
    return x.new_empty(*x.shape[:-1], packed.shape[0])


def _matmul_t_impl(dy: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, gs: torch.Tensor,
                   dyb: torch.Tensor | None, lora_a: torch.Tensor | None, lora_scale: float,
                   tiled: bool = False) -> torch.Tensor:
    """The backward-input behind the custom op ``qerl::nvfp4_matmul_t``."""
    d2 = dy if dy.ndim == 2 else dy.reshape(-1, dy.shape[-1])
    r = 0
    if dyb is not None:
        dyb, lora_a = _pad_rank(dyb.reshape(-1, dyb.shape[-1]).to(dy.dtype), 1), _pad_rank(lora_a.to(dy.dtype), 0)
        r = dyb.shape[1]
    out = _launch("bwd", d2.contiguous(), packed, scale, gs, packed.shape[1] * 2, (dyb, lora_a), lora_scale, r,
                  _interpreting(), tiled=tiled)
    return out if dy.ndim == 2 else out.reshape(*dy.shape[:-1], packed.shape[1] * 2)


@torch.library.custom_op("qerl::nvfp4_matmul_t", mutates_args=())
def _matmul_t_op(dy: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, gs: torch.Tensor,
                 dyb: torch.Tensor | None, lora_a: torch.Tensor | None, lora_scale: float,
                 tiled: bool = False) -> torch.Tensor:
    return _matmul_t_impl(dy, packed, scale, gs, dyb, lora_a, lora_scale, tiled)


@_matmul_t_op.register_fake
def _(dy, packed, scale, gs, dyb, lora_a, lora_scale, tiled=False):
    return dy.new_empty(*dy.shape[:-1], packed.shape[1] * 2)


def nvfp4_matmul(x, packed, scale, gs, bias=None, xa=None, lora_b=None, lora_scale: float = 1.0, lora_a=None,
                 tiled: bool = False):
    """Validated forward (see module docstring). ``tiled``: ``packed`` and ``scale`` are in the tile-contiguous
    layout (:mod:`qerl_kernels.layout`)."""
    _check(x, packed, scale, gs, 0, "nvfp4_matmul")
    if tiled:
        _check_tiled(packed, scale, "nvfp4_matmul")
    if xa is not None and lora_a is not None and (xa.shape[-1] != lora_a.shape[0] or xa.numel() // xa.shape[-1] !=
                                                  x.numel() // x.shape[-1]):
        raise KernelInputError(f"nvfp4_matmul: xa {tuple(xa.shape)} is not x · lora_aᵀ for x {tuple(x.shape)} and "
                               f"lora_a {tuple(lora_a.shape)}")
    if ((xa is None) and (lora_a is None)) != (lora_b is None):
        raise KernelInputError("nvfp4_matmul: lora_b goes with xa or lora_a")
    if lora_a is not None:
        k = packed.shape[1] * 2
        if lora_a.ndim != 2 or lora_a.shape[1] != k or lora_a.device != x.device or not lora_a.is_floating_point():
            raise KernelInputError(f"nvfp4_matmul: lora_a must be a float [R, K={k}] tensor on {x.device}, got "
                                   f"{lora_a.dtype} {tuple(lora_a.shape)} on {lora_a.device}")
    r = xa.shape[-1] if xa is not None else (lora_a.shape[0] if lora_a is not None else None)
    if lora_b is not None and (lora_b.ndim != 2 or lora_b.shape[0] != packed.shape[0] or lora_b.shape[1] != r):
        raise KernelInputError(f"nvfp4_matmul: lora_b {tuple(lora_b.shape)} does not match N={packed.shape[0]}, "
                               f"R={r}")
    if bias is not None and bias.shape != (packed.shape[0],):
        raise KernelInputError(f"nvfp4_matmul: bias shape {tuple(bias.shape)}, expected ({packed.shape[0]},)")
    # the custom op where a graph is being traced (torch.compile / export); eager calls skip its dispatch,
    # ~22 of the ~78 us of host time per call on the H200 box (tools/launch_overhead.py): the rollout
    # engine runs eagerly, ~200 of these per decoded token of a 7B model. CUDA-graph capture works either way.
    op = _matmul_op if torch.compiler.is_compiling() else _matmul_impl
    return op(x, packed, scale, gs, bias, xa, lora_b, float(lora_scale), lora_a, bool(tiled))


def nvfp4_matmul_t(dy, packed, scale, gs, dyb=None, lora_a=None, lora_scale: float = 1.0, tiled: bool = False):
    """Validated backward-input (see module docstring). ``tiled``: as in :func:`nvfp4_matmul`."""
    _check(dy, packed, scale, gs, 1, "nvfp4_matmul_t")
    if tiled:
        _check_tiled(packed, scale, "nvfp4_matmul_t")
    if (dyb is None) != (lora_a is None):
        raise KernelInputError("nvfp4_matmul_t: dyb and lora_a go together")
    op = _matmul_t_op if torch.compiler.is_compiling() else _matmul_t_impl
    return op(dy, packed, scale, gs, dyb, lora_a, float(lora_scale), bool(tiled))


def _check_tiled(packed, scale, name: str) -> None:
    N, kb = packed.shape
    if N % 64 or kb % 64 or not (packed.is_contiguous() and scale.is_contiguous()):
        raise KernelInputError(f"{name}: tiled weights (qerl_kernels.layout) need N % 64 == 0, K % 128 == 0 and "
                               f"contiguous packed / scale tensors, got N={N}, K={2 * kb}, contiguous "
                               f"{packed.is_contiguous()} / {scale.is_contiguous()}")


def supports(x: torch.Tensor, packed: torch.Tensor) -> bool:
    """The fast path's gate: CUDA (or the interpreter on CPU), bf16/fp16 activations."""
    return (x.is_cuda or _interpreting()) and x.dtype in (torch.bfloat16, torch.float16)
