"""Anyone's model directory checked at entry, before a loader or a sampler meets it: the weights against
``config.json`` (every projection's shape, the layer count), their dtype (a dense checkpoint's are floating point),
and the tokenizer files (present, not empty). One :class:`~qerl.checkpoint.CheckpointError` line naming the file and
the tensor; read from the safetensors headers and the config alone (no weight is loaded).
"""
from __future__ import annotations

import re
from pathlib import Path

from qerl.checkpoint import CheckpointError, TensorIndex

FLOATS = {"BF16", "F16", "F32", "F64"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def check_tokenizer(model_dir: Path, what: str = "model directory") -> None:
    """``model_dir`` holds a tokenizer (``tokenizer.json``, a SentencePiece ``tokenizer.model`` or a BPE
    ``vocab.json`` + ``merges.txt``), none of its files empty."""
    model_dir = Path(model_dir)
    for name in TOKENIZER_FILES:
        f = model_dir / name
        if f.is_file():
            if f.stat().st_size == 0:
                raise CheckpointError(f"{f}: the tokenizer file is empty; copy the model's tokenizer files here")
            if name == "vocab.json" and not (model_dir / "merges.txt").is_file():
                raise CheckpointError(f"{model_dir}: vocab.json without merges.txt; copy the model's tokenizer files")
            return
    raise CheckpointError(f"{model_dir}: no tokenizer files ({', '.join(TOKENIZER_FILES)}) in this {what}; copy "
                          "them from the model it was made from (qerl's stages write them beside the weights)")


def _expected(cfg: dict) -> dict[str, tuple[int, int]]:
    """Suffix -> (out, in) of each dense projection of a Llama / Qwen2 / Mistral-style decoder layer."""
    h, inter = int(cfg["hidden_size"]), int(cfg.get("intermediate_size") or 0)
    heads = int(cfg["num_attention_heads"])
    kv = int(cfg.get("num_key_value_heads") or heads)
    hd = int(cfg.get("head_dim") or h // heads)
    out = {"self_attn.q_proj": (heads * hd, h), "self_attn.k_proj": (kv * hd, h), "self_attn.v_proj": (kv * hd, h),
           "self_attn.o_proj": (h, heads * hd)}
    if inter:
        out.update({"mlp.gate_proj": (inter, h), "mlp.up_proj": (inter, h), "mlp.down_proj": (h, inter)})
    return out


def check_weights(model_dir: Path, cfg: dict, index: TensorIndex | None = None, quantized: bool = False) -> None:
    """The checkpoint's tensors agree with ``cfg`` (``config.json``): the embedding ``[vocab_size, hidden_size]``,
    each layer's projections (a packed NVFP4 weight ``[out, in / 2]``), ``num_hidden_layers`` layers; a dense
    checkpoint's projection weights are floating point."""
    model_dir = Path(model_dir)
    index = index or TensorIndex(model_dir)
    where = f"{model_dir}/config.json"
    if not all(k in cfg for k in ("hidden_size", "num_attention_heads")):
        return  # (not a decoder config this check knows; the loader's own checks apply)
    expect = _expected(cfg)
    layers = set()
    for name in index.names():
        dtype, shape = index.meta[name]
        if name.endswith("embed_tokens.weight") and len(shape) == 2 and cfg.get("vocab_size"):
            if tuple(shape) != (int(cfg["vocab_size"]), int(cfg["hidden_size"])):
                raise CheckpointError(f"{model_dir}: tensor {name} has shape {list(shape)}, but {where} says vocab_size "
                                      f"{cfg['vocab_size']} x hidden_size {cfg['hidden_size']}: the weights are not "
                                      "this config's (another model's config.json?)")
        m = _LAYER.search(name)
        if not m:
            continue
        layers.add(int(m.group(1)))
        for suffix, (n, k) in expect.items():
            for kind, want in (("weight", (n, k)), ("weight_packed", (n, k // 2))):
                if not name.endswith(f"{suffix}.{kind}"):
                    continue
                if tuple(shape) != want:
                    raise CheckpointError(f"{model_dir}: tensor {name} has shape {list(shape)}, {where} implies {list(want)} "
                                          "(hidden_size, intermediate_size, heads): the weights are not this "
                                          "config's")
                if kind == "weight" and dtype not in FLOATS and not quantized:
                    raise CheckpointError(f"{model_dir}: tensor {name} is {dtype}; a dense checkpoint's weights are "
                                          "floating point (bf16 / fp16 / fp32): quantized by another tool? qerl reads "
                                          "dense or compressed-tensors NVFP4 checkpoints")
    n = cfg.get("num_hidden_layers")
    if layers and n is not None and layers != set(range(int(n))):
        have = sorted(layers)
        raise CheckpointError(f"{model_dir}: the weights hold decoder layers {have[0]}..{have[-1]} ({len(have)}), "
                              f"{where} says num_hidden_layers {n}: the weights are not this config's")
