"""One run plan, resolved once: every ``auto`` setting of a training config (micro-batch, dense update, gradient
checkpointing, sharding, the engine's cache, optimizer offload, AQN) turned into what the run will do, in one place.

``qerl plan`` prints :meth:`RunPlan.lines`; ``qerl train`` prints the same lines at start, trains on the resolved
config :func:`resolve` returns (the loop reads it instead of deriving the settings again), and logs it (its
``config.json`` and MLflow parameters hold the resolved values). The decisions themselves live in
:mod:`qerl.train.plan` (the memory planner); this module only calls them once, in order.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class RunPlan:
    device: str  # "cuda" | "cpu"
    world: int  # processes sharing each step
    micro_batch_size: int
    dense_update: bool
    gradient_checkpointing: bool
    sharding: str  # none | optimizer | fsdp
    keep_engine_cache: bool  # the rollout engine's KV cache and graphs kept between rollouts
    offload: bool  # optimizer states parked in host memory during the rollout
    aqn: bool
    notes: tuple[str, ...] = ()
    micro_batch_tokens: int | bool = False  # micro-batches cut by tokens (an int) or by micro_batch_size rows

    def lines(self) -> list[str]:
        """The plan as printed by ``qerl plan`` and at the start of ``qerl train``."""
        cache = "kept between rollouts" if self.keep_engine_cache else "released after each rollout"
        states = "parked in host memory during each rollout" if self.offload else "kept where they are"
        tokens = f"micro_batch_tokens {self.micro_batch_tokens}, " if self.micro_batch_tokens else ""
        return [f"run plan ({self.device}, {self.world} process(es)): micro_batch_size {self.micro_batch_size}, "
                f"{tokens}"
                f"dense_update {str(self.dense_update).lower()}, gradient_checkpointing "
                f"{str(self.gradient_checkpointing).lower()}, sharding {self.sharding}, engine cache {cache}, "
                f"optimizer states {states}, AQN {'on' if self.aqn else 'off'}", *self.notes]


def _offload(mode: str, device: str, memory: dict | None) -> bool:
    """``optim.offload``: ``rollout`` parks the states (on a GPU; on a CPU-only run only under the tests'
    ``QERL_OFFLOAD_ON_CPU=1``), ``auto`` where the memory plan parks them."""
    from qerl.train import offload

    if mode == "none" or (device != "cuda" and not offload.PARK_ON_CPU):
        return False
    return mode == "rollout" or (device == "cuda" and memory is not None and bool(memory["offload"]))


def _memory(cfg, world: int, config_path: Path) -> tuple[dict | None, list[str]]:
    """The memory planner's verdict for a local model (raises where the run cannot fit) and what it says."""
    from qerl.train.plan import check_fits

    if not config_path.exists():
        return None, []
    res = check_fits(cfg, config_path, world=world)
    e = res["estimate"]
    notes = []
    if e["waves"] > 1:
        notes.append(f"memory plan: the rollout decodes at most {e['wave_rows']} sequences at once, a finished one's "
                     f"KV slot going to the next (up to {e['waves']} rounds: the KV cache of every sequence does not "
                     "fit; fewer sequences per step or a shorter rollout.max_new_tokens would decode them together)")
    return res, notes


def resolve(cfg, device: str, world: int = 1, model_dir: str | Path | None = None):
    """``(resolved config, RunPlan, memory plan or None)`` for a run of ``cfg`` on ``device`` ("cuda" / "cpu") with
    ``world`` processes; ``model_dir``: the local model directory (its ``config.json`` sizes the plan; default
    ``cfg.model.path``). On a GPU a configuration that cannot fit raises here, before anything loads."""
    from qerl.methods import METHODS
    from qerl.rl.aqn import enabled as aqn_enabled
    from qerl.train import sharding
    from qerl.train.config import resolve_sharding

    config_path = Path(model_dir or cfg.model.path) / "config.json"
    notes: list[str] = []
    if cfg.dense_update == "auto" and device != "cuda":  # (CPU training runs fp32: nothing to gain)
        cfg = dataclasses.replace(cfg, dense_update=False)
    rows_auto, dense_auto = cfg.micro_batch_size == "auto", cfg.dense_update == "auto"
    if cfg.micro_batch_tokens == "auto" and (device != "cuda" or not config_path.exists()):  # (packing: GPU runs)
        cfg = dataclasses.replace(cfg, micro_batch_tokens=False)
    if (rows_auto or cfg.dense_update == "auto" or cfg.micro_batch_tokens == "auto") and config_path.exists():
        from qerl.models.shapes import Shape
        from qerl.train.plan import resolve_dense_update, resolve_micro_batch, resolve_micro_tokens

        shape = Shape.from_config(json.loads(config_path.read_text()))
        cfg, said = resolve_micro_batch(cfg, shape, world)
        cfg = resolve_dense_update(cfg, shape, world)
        cfg, said_tokens = resolve_micro_tokens(cfg, shape, world, rows_auto=rows_auto, dense_auto=dense_auto)
        notes += [line for line in (said, said_tokens) if line]
    shard = resolve_sharding(cfg, world)
    method = METHODS[cfg.method]
    # gradient checkpointing first, by the run's one rule (qerl.train.methods.checkpointing_on), so that the memory
    # check below plans the run that will happen, not an `auto` of its own
    ckpt = cfg.gradient_checkpointing
    if config_path.exists():
        from transformers import AutoConfig

        import torch

        from qerl.train.methods import checkpointing_on

        ckpt = checkpointing_on(cfg, AutoConfig.from_pretrained(config_path.parent), method, torch.device(device),
                                world)
    elif ckpt == "auto" and device != "cuda":
        ckpt = False
    cfg = dataclasses.replace(cfg, gradient_checkpointing=ckpt)
    memory = None
    if device == "cuda":
        memory, said = _memory(cfg, world, config_path)  # (the one call of the memory planner)
        notes += said
    keep = False
    if device == "cuda" and sharding.strategy(shard).keeps_engine_cache:
        from qerl.train.plan import keep_engine_cache

        keep = keep_engine_cache(cfg, world, memory)
    from qerl.train.steps import eight_bit

    offload = _offload(cfg.optim.offload, device, memory)
    aqn = aqn_enabled(cfg.aqn, method.aqn)
    if str(cfg.optim.eight_bit).lower() == "auto" and device == "cuda" and eight_bit("auto", device) == "false":
        notes.append("optim.eight_bit=auto: bitsandbytes is not installed; using torch AdamW (fp32 states)")
    # every decision written back: config.json, MLflow and the start line hold what the run does, never `auto`
    # (on a GPU, rollout.engine auto -- the engine where it runs the model -- and packed_sequences auto -- each
    # micro-batch by its padding -- are decided per rollout / micro-batch and stay so)
    cfg = dataclasses.replace(cfg, sharding=shard, device=device if cfg.device == "auto" else cfg.device,
                              aqn=dataclasses.replace(cfg.aqn, enabled=aqn),
                              packed_sequences=False if cfg.packed_sequences == "auto" and device != "cuda"
                              else cfg.packed_sequences,
                              rollout=dataclasses.replace(
                                  cfg.rollout, release_cache=not keep,
                                  engine="reference" if cfg.rollout.engine == "auto" and device != "cuda"
                                  else cfg.rollout.engine),
                              optim=dataclasses.replace(cfg.optim, offload="rollout" if offload else "none",
                                                        eight_bit=eight_bit(cfg.optim.eight_bit, device)))
    plan = RunPlan(device, world, cfg.micro_batch_size, bool(cfg.dense_update), ckpt, shard, keep, offload,
                   aqn, tuple(notes), cfg.micro_batch_tokens)
    return cfg, plan, memory
