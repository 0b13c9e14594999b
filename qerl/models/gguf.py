"""A local GGUF file (llama.cpp's format) as a model source: turned once into the Hugging Face directory every
stage reads.

The conversion goes through transformers' own GGUF loader (``from_pretrained(..., gguf_file=...)``), which
*dequantizes* every tensor (Q4_K, Q5_0, Q8_0, ... -> float) and rebuilds the tokenizer and chat template from the
file's metadata. The result is an ordinary bf16 safetensors model whose weights carry the GGUF quantization's
rounding: ``qerl_source.json`` in the directory records the file, its sha256 and the tensor types it held, and the
training / evaluation runs tag themselves with it (:func:`source_tags`), so nobody mistakes such a model for the
original bf16 release.

Writes are atomic (a temporary directory renamed into place); a rerun on the same file (same sha256) is a no-op,
like a cached download. Errors are one line naming the file and what is wrong: not a GGUF file, truncated, an
architecture or tensor type the loader does not take.
"""
from __future__ import annotations

import json
from pathlib import Path

from qerl.checkpoint import CheckpointError, sha256_file

MARKER = "qerl_source.json"
MAGIC = b"GGUF"


class GGUFError(CheckpointError):
    """A GGUF file that cannot be turned into a model directory; the message names the file and the problem."""


def _supported() -> tuple[set[str], set[str]]:
    """(architectures transformers' GGUF loader maps, tensor types the ``gguf`` package dequantizes)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import _type_traits  # the dequantizers gguf-py implements
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    types = {t.name for t in _type_traits} | {"F32", "F16", "BF16"}
    types &= {t.name for t in GGMLQuantizationType}
    return set(GGUF_CONFIG_MAPPING) - {"general", "tokenizer"}, types


def inspect(path: Path) -> dict:
    """What a GGUF file holds: ``architecture``, ``name``, ``tensor_types`` ({type: count}), ``tensors``.

    Raises :class:`GGUFError` (one line, naming ``path``) for a missing, non-GGUF or truncated file, and for an
    architecture or tensor type that the loader cannot turn into a transformers model."""
    path = Path(path)
    if not path.is_file():
        raise GGUFError(f"{path}: no such GGUF file")
    with open(path, "rb") as f:
        head = f.read(4)
    if head != MAGIC:
        raise GGUFError(f"{path}: not a GGUF file (starts with {head!r}, expected {MAGIC!r})")
    try:
        from gguf import GGUFReader
    except ImportError:
        raise GGUFError(f"{path}: reading GGUF files needs the 'gguf' package (pip install gguf)") from None
    try:
        reader = GGUFReader(str(path))
    except Exception as e:  # a cut-off file surfaces as ValueError / IndexError / struct errors from numpy memmaps
        raise GGUFError(f"{path}: unreadable GGUF file ({type(e).__name__}: {e}); truncated or corrupt?") from None

    def field(key: str, default=None):
        f = reader.fields.get(key)
        return default if f is None else f.contents()

    arch = field("general.architecture")
    types: dict[str, int] = {}
    for t in reader.tensors:
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
    archs, kinds = _supported()
    if arch not in archs:
        raise GGUFError(f"{path}: architecture {arch!r} is not one transformers' GGUF loader converts "
                        f"(it takes: {', '.join(sorted(archs))})")
    bad = sorted(set(types) - kinds)
    if bad:
        raise GGUFError(f"{path}: tensor type(s) {', '.join(bad)} cannot be dequantized by the gguf package "
                        f"({sum(types[b] for b in bad)} tensors); re-export the model as Q8_0, F16 or a K-quant")
    if not reader.tensors:
        raise GGUFError(f"{path}: holds no tensors (a vocabulary-only GGUF file?)")
    _check_against_tensors(path, reader, arch, field)
    return {"architecture": arch, "name": field("general.name", ""), "tensor_types": dict(sorted(types.items())),
            "tensors": len(reader.tensors), "chat_template": field("tokenizer.chat_template") is not None}


def _check_against_tensors(path: Path, reader, arch: str, field) -> None:
    """The metadata a conversion trusts, checked against the tensors before anything is built: the layer count
    (a header that claims more layers than the file holds would leave them randomly initialised), the vocabulary
    (no more tokens than embedding rows) and the end-of-sequence id (without one, generation never stops)."""
    import re

    blocks = field(f"{arch}.block_count")
    layers = sorted({int(m.group(1)) for t in reader.tensors if (m := re.match(r"blk\.(\d+)\.", t.name))})
    if blocks is None:
        raise GGUFError(f"{path}: no {arch}.block_count in its metadata (how many layers it holds)")
    if layers != list(range(int(blocks))):
        have = f"layers {layers[0]}..{layers[-1]}" if layers else "no layer tensors"
        raise GGUFError(f"{path}: {arch}.block_count is {blocks} but its tensors hold {len(layers)} layer(s) ({have}): "
                        "the missing layers would be left with random weights; the file is damaged or mislabelled")
    tokens = field("tokenizer.ggml.tokens")
    emb = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if tokens is not None and emb is not None and len(tokens) > int(max(emb.shape)):
        raise GGUFError(f"{path}: {len(tokens)} tokens in its vocabulary but {int(max(emb.shape))} embedding rows")
    eos = field("tokenizer.ggml.eos_token_id")
    if eos is None:
        raise GGUFError(f"{path}: no end-of-sequence token id (tokenizer.ggml.eos_token_id): generation could not "
                        "stop; add it to the file's metadata (gguf-py's gguf_set_metadata)")
    if tokens is not None and not 0 <= int(eos) < len(tokens):
        raise GGUFError(f"{path}: end-of-sequence id {eos} is outside its {len(tokens)}-token vocabulary")


def recorded(output: Path) -> dict | None:
    """The ``qerl_source.json`` of a directory written by :func:`convert`, or None."""
    marker = Path(output) / MARKER
    if not marker.is_file():
        return None
    try:
        return json.loads(marker.read_text())
    except (OSError, ValueError):
        return None


def convert(gguf_path: Path, output: Path, dtype: str = "bfloat16", force: bool = False) -> dict:
    """Turn ``gguf_path`` into a Hugging Face model directory at ``output`` (safetensors, tokenizer, chat template,
    ``qerl_source.json``); returns the record written there, with ``"cached": True`` when ``output`` already held
    the conversion of the same file (same sha256) and nothing was done.

    ``output`` holding anything else is refused, unless ``force`` and it is a model directory (a ``config.json``):
    ``force`` replaces a model, never a directory of other files."""
    import torch

    gguf_path, output = Path(gguf_path), Path(output)
    info = inspect(gguf_path)
    digest = sha256_file(gguf_path)
    old = recorded(output)
    if old is not None and old.get("sha256") == digest and old.get("dtype") == dtype \
            and (output / "config.json").is_file():
        from qerl.owned import MANIFEST, changed

        if not (bad := changed(output)):  # (no manifest: nothing to check the files against, so not done)
            return {**old, "cached": True}
        if not force:
            why = (f"has no {MANIFEST} (deleted, or written by an older qerl), so its files cannot be checked"
                   if bad == [MANIFEST] else f"{', '.join(bad[:3])} no longer match what was written ({MANIFEST})")
            raise GGUFError(f"--output {output}: the conversion of this file, but it {why}: pass --force to "
                            "convert it again")
    if output.exists() and any(output.iterdir()):
        if not force:
            what = "the conversion of another GGUF file" if old else "files that are not a converted model"
            raise GGUFError(f"--output {output}: holds {what}; pass --force to replace a model directory")
        from qerl.owned import check_replaceable

        check_replaceable(output)
    if dtype not in ("bfloat16", "float16", "float32"):
        raise GGUFError(f"--dtype {dtype!r}: expected bfloat16, float16 or float32")

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from qerl.checkpoint import atomic_directory, write_json

    folder, name = str(gguf_path.resolve().parent), gguf_path.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=getattr(torch, dtype))
    except Exception as e:  # the loader's own errors (an unsupported key, a tokenizer it cannot rebuild)
        raise GGUFError(f"{gguf_path}: transformers' GGUF loader failed ({type(e).__name__}: "
                        f"{str(e).splitlines()[0] if str(e) else ''})") from None
    record = {"source": "gguf", "file": name, "sha256": digest, "bytes": gguf_path.stat().st_size,
              "dtype": dtype, "dequantized": sorted(set(info["tensor_types"]) - {"F32", "F16", "BF16"}) != [],
              **info}
    # the weights are plain tensors now; transformers still marks the model "quantized with gguf" (and refuses to
    # save it): drop the marker so the directory is an ordinary checkpoint
    for name, p in model.state_dict().items():  # float16 holds at most 65504: a larger weight became inf
        if not torch.isfinite(p).all():
            raise GGUFError(f"{gguf_path}: {name} has values beyond {dtype}'s range (or NaN) once dequantized "
                            f"(largest finite magnitude {torch.finfo(getattr(torch, dtype)).max:g}): convert with "
                            "--dtype bfloat16 or float32")
    model.hf_quantizer = None
    for holder in (model, model.config):
        if hasattr(holder, "quantization_config"):
            delattr(holder, "quantization_config")
    with atomic_directory(output, force=True) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        write_json(tmp / MARKER, record)
    return {**record, "cached": False}


def source_tags(model_dir: str | Path) -> dict[str, str]:
    """MLflow tags saying where a model directory's weights came from (empty unless it was converted from GGUF):
    ``model_source``, ``model_gguf_sha256``, ``model_dequantized_from`` (the quantized tensor types)."""
    rec = recorded(Path(model_dir))
    if not rec or rec.get("source") != "gguf":
        return {}
    quant = [t for t in rec.get("tensor_types", {}) if t not in ("F32", "F16", "BF16")]
    return {"model_source": "gguf", "model_gguf_file": str(rec.get("file", "")),
            "model_gguf_sha256": str(rec.get("sha256", "")),
            "model_dequantized_from": ",".join(quant) if quant else "none (float tensors)"}
