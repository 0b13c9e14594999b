"""Random-weight Qwen2.5-shaped stand-ins for benchmarks and GPU checks: models built directly on the GPU, layer by
layer, and a tokenizer of token ids with random prompts.

Speed and memory do not depend on weight values (platform.md), so the benchmarks build the real shapes from
random weights: the module tree on the meta device, then every decoder linear materialised on the GPU one
at a time — an NVFP4 base quantizes each random bf16 weight as it is made and keeps only the packed tensors,
so a 32B model never needs a whole bf16 copy (peak extra memory: one projection in bf16).
"""
from __future__ import annotations

import types

import torch
from torch import nn

from qerl.models.shapes import named


def qwen_config(model: str, dtype: torch.dtype = torch.bfloat16):
    from transformers import Qwen2Config

    s = named(model)
    return Qwen2Config(vocab_size=s.vocab, hidden_size=s.hidden, intermediate_size=s.intermediate,
                       num_hidden_layers=s.layers, num_attention_heads=s.heads, num_key_value_heads=s.kv_heads,
                       head_dim=s.head_dim, max_position_embeddings=32768,
                       rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=s.tied, torch_dtype=dtype)


def nf4_available() -> bool:
    """Whether the NF4 base (bitsandbytes) can be built: the package imports."""
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        return False
    return True


@torch.no_grad()
def build(model: str, base: str, device="cuda", dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> nn.Module:
    """A random ``Qwen2ForCausalLM`` of ``model``'s shapes with a ``base`` of ``bf16`` | ``nvfp4`` | ``nf4``."""
    from transformers import Qwen2ForCausalLM
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

    from qerl.models.nvfp4_linear import NVFP4Linear
    from qerl.quant import nvfp4

    cfg = qwen_config(model, dtype)
    with torch.device("meta"):
        lm = Qwen2ForCausalLM(cfg).to(dtype)  # (the constructor makes fp32 parameters; on meta .to is free)
    g = torch.Generator(device=device).manual_seed(seed)
    lm.to_empty(device=device) if base == "bf16" else None
    linears = [(n, m) for n, m in lm.named_modules() if isinstance(m, nn.Linear) and ".layers." in n]
    shared: dict = {}  # (layer, group) -> global scale: q/k/v and gate/up share one, as NVFP4 checkpoints do
    for name, mod in linears:
        parent, _, leaf = name.rpartition(".")
        w = torch.randn(mod.out_features, mod.in_features, device=device, dtype=dtype, generator=g) * 0.02
        b = torch.zeros(mod.out_features, device=device, dtype=dtype) if mod.bias is not None else None
        if base == "bf16":
            mod.weight.copy_(w)
            if b is not None:
                mod.bias.copy_(b)
            continue
        if base == "nvfp4":
            group = (parent.rpartition(".")[0], "qkv" if leaf in ("q_proj", "k_proj", "v_proj") else
                     "gate_up" if leaf in ("gate_proj", "up_proj") else leaf)
            if group not in shared:  # random weights: the first member's scale with a margin serves the group
                shared[group] = nvfp4.compute_global_scale(w) * 0.8
            new = NVFP4Linear(mod.in_features, mod.out_features, b is not None, device=device, dtype=dtype)
            new.load_packed(*nvfp4.quantize(w, global_scale=shared[group]), b)
        elif base == "nf4":
            import bitsandbytes as bnb

            new = bnb.nn.Linear4bit(mod.in_features, mod.out_features, bias=b is not None, compute_dtype=dtype,
                                    quant_type="nf4", device="cpu")
            new.weight = bnb.nn.Params4bit(w.cpu(), requires_grad=False, quant_type="nf4")
            new = new.to(device)
            if b is not None:
                new.bias = nn.Parameter(b, requires_grad=False)
        else:
            raise ValueError(f"base must be bf16, nvfp4 or nf4, got {base!r}")
        setattr(lm.get_submodule(parent), leaf, new)
        del w
    if base != "bf16":  # what is still on meta: embeddings, lm_head, norms
        for mod in lm.modules():
            for pname, p in list(mod.named_parameters(recurse=False)):
                if p.is_meta:
                    setattr(mod, pname, nn.Parameter(torch.empty(p.shape, device=device, dtype=dtype), requires_grad=False))
        if cfg.tie_word_embeddings:  # (the 3B shape) one matrix again
            lm.lm_head.weight = lm.model.embed_tokens.weight
    for name, p in lm.named_parameters():
        if "norm" in name:
            p.fill_(1.0)
        elif p.dim() == 2 and ".layers." not in name:
            p.copy_(torch.randn(p.shape, device=device, dtype=dtype, generator=g) * 0.02)
    with torch.device(device):  # (the `device=` argument is gone from newer transformers)
        lm.model.rotary_emb = Qwen2RotaryEmbedding(cfg)
    lm.requires_grad_(False)
    return lm.eval()


def weight_bytes(lm: nn.Module) -> int:
    """Bytes a decode step reads for weights: every parameter / packed buffer of the decoder linears and
    LoRA adapters, plus ``lm_head`` (the embedding reads one row per token: not counted)."""
    total = 0
    for name, t in list(lm.named_parameters()) + list(lm.named_buffers()):
        if "embed_tokens" in name or "rotary" in name or "inv_freq" in name:
            continue
        total += t.numel() * (2 if "lora_" in name else t.element_size())  # the engine reads bf16 adapter copies
    return total


class CountTokenizer:
    """A tokenizer for random-weight models: a prompt is space-separated token ids; EOS is -1 (never
    sampled, so every row generates ``max_new_tokens``)."""

    eos_token_id, pad_token_id, padding_side = -1, 0, "right"

    def __call__(self, texts, return_tensors="pt", padding=True, add_special_tokens=False):
        rows = [[int(x) for x in t.split()] for t in texts]
        n = max(map(len, rows))
        ids = torch.zeros(len(rows), n, dtype=torch.long)
        mask = torch.zeros(len(rows), n, dtype=torch.long)
        for i, r in enumerate(rows):
            sl = slice(n - len(r), n) if self.padding_side == "left" else slice(0, len(r))
            ids[i, sl], mask[i, sl] = torch.tensor(r), 1
        return types.SimpleNamespace(input_ids=ids, attention_mask=mask)

    def encode(self, text, add_special_tokens=False):
        return [int(x) for x in text.split()]

    def decode(self, ids, skip_special_tokens=False):
        return " ".join(str(i) for i in ids)


def prompts(batch: int, length: int, vocab: int, seed: int = 0) -> list[str]:
    """``batch`` random prompts of ``length`` token ids in ``[100, vocab - 100)`` (for :class:`CountTokenizer`)."""
    g = torch.Generator().manual_seed(seed)
    return [" ".join(map(str, torch.randint(100, vocab - 100, (length,), generator=g).tolist())) for _ in range(batch)]
