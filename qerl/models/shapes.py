"""Model shapes by name, one place for the planner, the random-weight stand-ins and the benchmarks (no torch).

:class:`Shape` holds the sizes that set memory and time; :data:`QWEN25` the Qwen2.5 sizes the paper trains,
:data:`SHAPES` those and the small ones (0.5B, 1.5B) (Instruct checkpoints' ``config.json``: hidden H, intermediate I, layers L, heads, kv heads, head dim D, vocab V).
"""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Shape:
    """The sizes that set memory: hidden H, intermediate I, layers L, heads, kv heads, head dim D, vocab V."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool = False
    bf16_layers: int = 0  # decoder layers an NVFP4 checkpoint keeps in bf16 (its ignore list; the planner's bytes)

    @classmethod
    def from_config(cls, cfg) -> "Shape":
        """From a transformers config object or a ``config.json`` dict."""
        g = cfg.get if isinstance(cfg, dict) else (lambda k, d=None: getattr(cfg, k, d))
        heads = g("num_attention_heads")
        layers = g("num_hidden_layers")
        return cls(g("hidden_size"), g("intermediate_size"), layers, heads,
                   g("num_key_value_heads") or heads, g("head_dim") or g("hidden_size") // heads, g("vocab_size"),
                   bool(g("tie_word_embeddings", False)), _bf16_layers(g("quantization_config"), layers))

    def linear_weights(self) -> int:
        """Weights of the linear layers a token passes through: the seven projections of every layer and lm_head."""
        return self.layers * sum(k * n for k, n in self.projections().values()) + self.vocab * self.hidden

    def projections(self) -> dict[str, tuple[int, int]]:
        """(K, N) of the seven projections of one layer."""
        H, I, q, kv = self.hidden, self.intermediate, self.heads * self.head_dim, self.kv_heads * self.head_dim
        return {"q": (H, q), "k": (H, kv), "v": (H, kv), "o": (q, H), "gate": (H, I), "up": (H, I), "down": (I, H)}


def _bf16_layers(qcfg, layers: int) -> int:
    """Decoder layers whose q_proj a compressed-tensors ``ignore`` list leaves unquantized (names or ``re:``)."""
    import re

    ignore = qcfg.get("ignore") or [] if isinstance(qcfg, dict) else []
    names = [f"model.layers.{i}.self_attn.q_proj" for i in range(layers or 0)]
    return sum(any(re.match(p[3:], n) if p.startswith("re:") else p == n for p in ignore) for n in names)


QWEN25 = {"3B": Shape(2048, 11008, 36, 16, 2, 128, 151936, tied=True),  # the paper's GSM8K table (Table 1)
          "7B": Shape(3584, 18944, 28, 28, 4, 128, 152064), "14B": Shape(5120, 13824, 48, 40, 8, 128, 152064),
          "32B": Shape(5120, 27648, 64, 40, 8, 128, 152064)}


#: the small Qwen2.5 sizes people start with (not in the paper's tables): benchmarks, tuned kernel tables and random
#: stand-ins take them too (``config.json`` of Qwen2.5-0.5B-Instruct / Qwen2.5-1.5B-Instruct)
QWEN25_SMALL = {"0.5B": Shape(896, 4864, 24, 14, 2, 64, 151936, tied=True),
                "1.5B": Shape(1536, 8960, 28, 12, 2, 128, 151936, tied=True)}
#: shapes of other model families, for measuring the kernels where no tuned entry exists (Llama 3.2 1B / 3B and
#: Llama 3.1 8B ``config.json`` sizes; the random stand-ins build them as Qwen2 models of those sizes)
OTHER = {"llama-1B": Shape(2048, 8192, 16, 32, 8, 64, 128256, tied=True),
         "llama-3B": Shape(3072, 8192, 28, 24, 8, 128, 128256, tied=True),
         "llama-8B": Shape(4096, 14336, 32, 32, 8, 128, 128256)}
#: every named size (benchmarks and the kernel tuner; look one up with :func:`named`)
SHAPES = {**QWEN25_SMALL, **QWEN25, **OTHER}


def named(model: str) -> Shape:
    """The shape called ``model`` ("0.5B" … "32B", "llama-8B", …: :data:`SHAPES`, read at call time), or the shape of
    a transformers ``config.json`` — ``model`` a path to one or to a model directory holding one
    (:func:`from_path`): the benchmarks and the kernel tuner take any model's sizes that way."""
    if model in QWEN25:
        return QWEN25[model]
    if model in QWEN25_SMALL or model in OTHER:
        return QWEN25_SMALL.get(model) or OTHER[model]
    return from_path(model)


_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")


@functools.cache
def from_path(path: str) -> Shape:
    """The :class:`Shape` of the transformers ``config.json`` at ``path`` (or in the directory ``path``; a
    multimodal config's ``text_config``). Raises ValueError naming the file and what is missing or wrong."""
    p = Path(path)
    f = p / "config.json" if p.is_dir() else p
    if not f.is_file():
        raise ValueError(f"model {path!r}: not a named size ({', '.join(SHAPES)}) and no config.json at {f}")
    try:
        cfg = json.loads(f.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{f}: not a readable JSON config ({type(e).__name__}: {e})") from None
    cfg = cfg.get("text_config", cfg) if isinstance(cfg, dict) else cfg
    if not isinstance(cfg, dict):
        raise ValueError(f"{f}: expected a JSON object (a transformers config.json)")
    missing = [k for k in _FIELDS if not isinstance(cfg.get(k), int) or cfg[k] <= 0]
    if missing:
        raise ValueError(f"{f}: missing or non-positive {', '.join(missing)} (expected a decoder's transformers "
                         "config.json with these integer fields)")
    shape = Shape.from_config(cfg)
    if shape.heads % shape.kv_heads or shape.head_dim <= 0:
        raise ValueError(f"{f}: num_attention_heads {shape.heads} is not a multiple of num_key_value_heads "
                         f"{shape.kv_heads}, or head_dim {shape.head_dim} is not positive")
    return shape


def model_arg(text: str) -> str:
    """argparse ``type`` for ``--models``: a named size or a path to a ``config.json`` / a model directory (checked
    here, so that a typo fails before any GPU work)."""
    import argparse

    if text in SHAPES:
        return text
    try:
        from_path(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


#: ``--models`` help: what the benchmarks and the tuner accept
MODELS_HELP = f"named sizes ({', '.join(SHAPES)}) or paths to a model's config.json (or its directory)"


def projections(model: str) -> dict[str, tuple[int, int]]:
    """(N, K) of one layer's fused projections as the engine runs them (q/k/v and gate/up fused)."""
    s = named(model)
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    return {"qkv": (q + 2 * kv, s.hidden), "o": (s.hidden, q), "gate_up": (2 * s.intermediate, s.hidden),
            "down": (s.hidden, s.intermediate)}
