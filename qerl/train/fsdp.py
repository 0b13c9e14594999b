"""FSDP2 for the full method (``sharding: fsdp``): weights, gradients and AdamW states sharded over the ranks.

``torch.distributed.fsdp.fully_shard`` on every decoder layer and on the decoder (embeddings, final norm):
each rank keeps 1/W of them as ``DTensor`` shards, a forward all-gathers a layer's weights just before it runs and
frees them after, the backward reduce-scatters the gradients (averaged over ranks, as DDP does). Three places read
weights outside those hooked forwards, and are handled here:

* the rollout: the engine (CUDA) reads the weights directly and the reference sampler runs hundreds of forwards,
  so :func:`gathered` all-gathers every shard once for the whole rollout (the full bf16 weights on every GPU for
  that phase — the memory saved is that of the gradients and optimizer states, and of the weights during the
  update) and reshards after it;
* the lm_head: the log-probs multiply its weight in ~1,024-token blocks (``qerl.ops.logits``), not through its
  forward, so it stays whole on every rank and its gradient is averaged by one all-reduce
  (:func:`average_replicated_grads`); with tied embeddings the embedding matrix is left whole the same way;
* checkpoints: :func:`save_sharded` has every rank write its own shards (``torch.distributed.checkpoint``: no
  process ever holds the full optimizer states, 8 B per weight), :func:`load_sharded` reads them back; the final
  weights are gathered on rank 0 for ``save_pretrained`` (:func:`full_weights`).

One process: nothing here is used (``sharding`` resolves to ``none``).
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as tdist


def _fsdp_modules(model) -> list:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def replicated_params(model) -> list[torch.nn.Parameter]:
    """Trainable parameters left whole on every rank (the lm_head, and the embeddings when tied to it)."""
    from torch.distributed.tensor import DTensor

    return [p for p in model.parameters() if p.requires_grad and not isinstance(p, DTensor)]


def optimizer_groups(model) -> list[dict]:
    """The trainable parameters as AdamW groups: the DTensor shards, then the whole ones (a multi-tensor AdamW
    call cannot mix the two kinds)."""
    whole = replicated_params(model)
    sharded = [p for p in model.parameters() if p.requires_grad and all(p is not w for w in whole)]
    return [{"params": g} for g in (sharded, whole) if g]


def shard(model, device: torch.device, world: int):
    """``fully_shard`` each decoder layer, then the decoder (``model.get_decoder()``) over ``world`` ranks; the
    lm_head (and tied embeddings) stay whole. Returns ``model`` (modified in place)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (world,))
    decoder = model.get_decoder()
    head = model.get_output_embeddings()
    ignored = {head.weight} if head is not None else set()
    for layer in decoder.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(decoder, mesh=mesh, ignored_params=ignored & set(decoder.parameters()) or None)
    return model


@contextlib.contextmanager
def gathered(model):
    """Every shard all-gathered for the duration (plain, whole ``nn.Parameter``s on the modules, as the engine
    and ``generate`` expect; forwards inside issue no collective, so ranks may run different numbers of them),
    resharded on exit."""
    mods = _fsdp_modules(model)
    root = model.get_decoder()
    for m in mods:
        m.unshard()
        m.set_reshard_after_forward(False, recurse=False)
    try:
        yield model
    finally:
        for m in mods:  # back to fully_shard's defaults: layers reshard after forward, the root (decoder) does not
            m.reshard()
            m.set_reshard_after_forward(m is not root, recurse=False)


@contextlib.contextmanager
def accumulating(model):
    """Backwards inside keep their gradients unsharded and local (no reduce-scatter): the micro-batches before the
    last of an optimizer step, like DDP's ``no_sync``."""
    mods = _fsdp_modules(model)
    for m in mods:
        m.set_requires_gradient_sync(False, recurse=False)
    try:
        yield
    finally:
        for m in mods:
            m.set_requires_gradient_sync(True, recurse=False)


def average_replicated_grads(model, world: int) -> None:
    """All-reduce (average) the gradients of the whole, replicated parameters (:func:`replicated_params`): what
    FSDP's reduce-scatter does for the sharded ones."""
    for p in replicated_params(model):
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        tdist.all_reduce(p.grad, op=tdist.ReduceOp.SUM)
        p.grad.div_(world)


def clip_grad_norm_(params: list, max_norm: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` over a mix of sharded (``DTensor``) and whole gradients: the global L2
    norm from both parts, then every gradient scaled by ``min(1, max_norm / (norm + 1e-6))``. Returns the norm."""
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in params if p.grad is not None]
    sharded = [g for g in grads if isinstance(g, DTensor)]
    whole = [g for g in grads if not isinstance(g, DTensor)]
    sq = torch.zeros((), dtype=torch.float32, device=grads[0].device if grads else "cpu")
    if sharded:
        n = torch.nn.utils.get_total_norm(sharded, 2.0)
        sq = sq + (n.full_tensor() if isinstance(n, DTensor) else n).float() ** 2
    if whole:
        sq = sq + torch.nn.utils.get_total_norm(whole, 2.0).float() ** 2
    total = sq.sqrt()
    coef = float(torch.clamp(max_norm / (total + 1e-6), max=1.0))
    if coef < 1.0:
        for g in grads:
            g.mul_(coef)
    return total


def save_sharded(model, optimizer, staging) -> None:
    """Every rank writes its shards of the weights and optimizer states into ``staging`` (the same directory on
    every rank; ``torch.distributed.checkpoint``: one file per rank + metadata) — no rank holds the full states.
    Every rank must call it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    weights, optim = get_state_dict(model, optimizer)
    dcp.save({"model": weights, "optim": optim}, checkpoint_id=str(staging))


def load_sharded(model, optimizer, directory) -> None:
    """Each rank reads its shards back from a :func:`save_sharded` directory (same process count)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    weights, optim = get_state_dict(model, optimizer)
    state = {"model": weights, "optim": optim}
    dcp.load(state, checkpoint_id=str(directory))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


def full_weights(model) -> dict:
    """The whole model's state dict (every buffer and weight) on rank 0 for ``save_pretrained``; every rank calls."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
