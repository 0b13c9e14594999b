"""Tiny Qwen2- and Llama-architecture models and a tokenizer, built entirely offline and seeded.

Used by the tests and by the embedded default workflow (no model hub is reachable there). The
tokenizer is byte-level (every UTF-8 string round-trips) with Qwen's chat markers, so chat
templates, EOS handling and generation work exactly as with a real Qwen2.5 tokenizer.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Qwen2.5's template, without the default system prompt.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@dataclass(frozen=True)
class TinySpec:
    """Shape of a tiny model. All linear dims are multiples of 16 (NVFP4 blocks along K)."""

    arch: str = "qwen2"  # "qwen2" | "llama"
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 512
    tie_word_embeddings: bool = False
    seed: int = 0

    def __post_init__(self):
        if self.arch not in ("qwen2", "llama"):
            raise ValueError(f"tiny model arch {self.arch!r} is not one of 'qwen2', 'llama'")
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "max_position_embeddings"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"tiny model {name}: must be a positive integer, got {getattr(self, name)!r}")
        for name in ("hidden_size", "intermediate_size"):  # the K of some Linear: whole NVFP4 blocks
            if getattr(self, name) % 16:
                raise ValueError(f"tiny model {name}: must be a multiple of 16 (NVFP4 blocks of 16 along the "
                                 f"input dimension), got {getattr(self, name)}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"tiny model: hidden_size {self.hidden_size} is not divisible by the "
                             f"{self.num_attention_heads} attention heads")
        if (self.hidden_size // self.num_attention_heads) % 2:
            raise ValueError(f"tiny model: head dimension {self.hidden_size // self.num_attention_heads} "
                             "(hidden_size / heads) must be even (rotary embeddings rotate pairs)")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"tiny model: {self.num_attention_heads} attention heads are not divisible by the "
                             f"{self.num_key_value_heads} key/value heads (grouped-query attention)")
        if self.seed < 0:
            raise ValueError(f"tiny model seed: must be >= 0, got {self.seed}")


def build_tokenizer():
    """A byte-level BPE tokenizer (no merges) as a ``PreTrainedTokenizerFast``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast

    alphabet = ByteLevel.alphabet()
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in sorted(alphabet):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=list(SPECIAL_TOKENS[1:]),
        padding_side="left",
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_config(spec: TinySpec, vocab_size: int):
    """A transformers config for ``spec`` (Qwen2Config or LlamaConfig)."""
    from transformers import LlamaConfig, Qwen2Config

    common = dict(
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings,
        rms_norm_eps=1e-6,
        bos_token_id=None,
        eos_token_id=2,
        pad_token_id=0,
    )
    if spec.arch == "qwen2":
        return Qwen2Config(**common, rope_theta=10000.0)
    if spec.arch == "llama":
        return LlamaConfig(**common, rope_theta=10000.0, attention_bias=False, mlp_bias=False)
    raise ValueError(f"tiny model arch {spec.arch!r} is not one of 'qwen2', 'llama'")


def build_tiny_model(spec: TinySpec = TinySpec(), dtype: torch.dtype = torch.bfloat16):
    """Return ``(model, tokenizer)``: a seeded random model of ``spec`` and the byte tokenizer."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    tokenizer = build_tokenizer()
    # Round the vocabulary up to a multiple of 16, as real checkpoints pad theirs.
    vocab = (len(tokenizer) + 15) // 16 * 16
    config = build_config(spec, vocab)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        if spec.arch == "qwen2":  # Qwen2 q/k/v carry biases; make them non-trivial
            for name, p in model.named_parameters():
                if name.endswith("_proj.bias"):
                    torch.nn.init.normal_(p, std=0.02)
    model = model.to(dtype)
    model.generation_config = GenerationConfig(
        eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id, do_sample=False
    )
    return model, tokenizer


def save_tiny_model(output: Path, spec: TinySpec = TinySpec(), max_shard_size: str = "2GB",
                    force: bool = False) -> Path:
    """Build and save a tiny model + tokenizer as a Hugging Face model directory. An ``output`` holding anything
    but a tiny model is replaced only with ``force``."""
    from qerl.checkpoint import CheckpointError, atomic_directory, is_nonempty_dir, write_json
    from qerl.checkpoint import parse_size

    output = Path(output)
    parse_size(max_shard_size)
    if is_nonempty_dir(output) and not (output / "qerl_tiny.json").exists() and not force:
        raise CheckpointError(f"{output}: holds something other than a tiny model; refusing to replace it "
                              "(pass --force)")
    model, tokenizer = build_tiny_model(spec)
    with atomic_directory(output, force=True) as tmp:
        model.save_pretrained(tmp, max_shard_size=max_shard_size)
        tokenizer.save_pretrained(tmp)
        write_json(tmp / "qerl_tiny.json", asdict(spec))
    return output
