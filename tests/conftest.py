"""Shared fixtures: tiny models built offline once per session, and their NVFP4 checkpoints."""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_collection_modifyitems(items):
    """The longest unit of work first: the tests sharing the default workflow's run (one xdist_group, ~8 min on one
    worker under `make test`) start at once instead of last, so the other worker's tests fill the same minutes."""
    def first(item):
        return 0 if any(m.args == ("default_run",) for m in item.iter_markers("xdist_group")) else 1

    items.sort(key=first)  # (stable: every other test keeps its order)


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    """``{"qwen2": dir, "llama": dir}`` of seeded tiny bf16 models."""
    from qerl.models.tiny import TinySpec, save_tiny_model

    root = tmp_path_factory.mktemp("tiny")
    return {arch: save_tiny_model(root / arch, TinySpec(arch=arch, seed=1)) for arch in ("qwen2", "llama")}


@pytest.fixture(scope="session")
def quantized_dirs(tiny_dirs, tmp_path_factory):
    """``{"qwen2": dir, "llama": dir}`` of NVFP4 checkpoints written by ``quantize_checkpoint``."""
    from qerl.stages.quantize import quantize_checkpoint

    root = tmp_path_factory.mktemp("nvfp4")
    out = {}
    for arch, src in tiny_dirs.items():
        quantize_checkpoint(src, root / arch, progress=False)
        out[arch] = root / arch
    return out


@pytest.fixture(scope="session")
def warm_model(tmp_path_factory):
    """A tiny Qwen2 model warm-started (SFT) on the synthetic arithmetic task: reward ~0.25."""
    from qerl.data.tasks import synthetic_arithmetic
    from qerl.models.tiny import TinySpec, save_tiny_model
    from qerl.train.sft import sft

    root = tmp_path_factory.mktemp("warm")
    base = save_tiny_model(root / "base", TinySpec(seed=0))
    sft(base, root / "sft", synthetic_arithmetic(2000, seed=0), steps=80, progress=False)
    return root / "sft"


def a_weight(name: str) -> bool:
    return name.endswith("proj.weight")


def write_gguf(model_dir, path, qtype: str = "F32", merge: bool = False, block_count: int | None = None,
               eos: bool = True, scale: float = 1.0):
    """Write the HF Qwen2 / Llama model in ``model_dir`` as a llama.cpp GGUF file at ``path`` with the ``gguf``
    package's writer (tensors as ``qtype``: F32, F16 or Q8_0 for the 2-D weights; norms and biases stay F32), with
    its tokenizer (byte-level BPE) and chat template in the metadata, as llama.cpp's converter lays them out.
    ``merge``: add two BPE merges ("a b", "c d" -> new tokens "ab", "cd" in unused ids), as real files carry
    merges (transformers 5.17's GGUF reader takes a file without merges, or with one, for something else).
    Bad files for the input checks: ``block_count`` (a header that disagrees with the layers written), ``eos``
    False (no end-of-sequence id), ``scale`` (the weights multiplied: 1e6 puts them beyond float16's range)."""
    import gguf
    import numpy as np
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoTokenizer

    from qerl.checkpoint import shard_files

    cfg = AutoConfig.from_pretrained(model_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    arch = {"qwen2": gguf.MODEL_ARCH.QWEN2, "llama": gguf.MODEL_ARCH.LLAMA}[cfg.model_type]
    name = gguf.MODEL_ARCH_NAMES[arch]
    w = gguf.GGUFWriter(str(path), name)
    w.add_name(f"tiny {cfg.model_type}")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_block_count(cfg.num_hidden_layers if block_count is None else block_count)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(float(getattr(cfg, "rope_theta", None) or cfg.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_file_type({"F32": 0, "F16": 1, "Q8_0": 7}[qtype])
    vocab = tok.get_vocab()
    tokens = [""] * cfg.vocab_size
    types = [gguf.TokenType.UNUSED] * cfg.vocab_size
    special = set(tok.all_special_tokens)
    for t, i in vocab.items():
        if i < cfg.vocab_size:
            tokens[i] = t
            types[i] = gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL
    for i, t in enumerate(tokens):
        if not t:
            tokens[i] = f"[PAD{i}]"
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2" if cfg.model_type == "qwen2" else "default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_scores([0.0] * cfg.vocab_size)
    merges = []
    if merge:
        free = [i for i, t in enumerate(tokens) if t.startswith("[PAD")][:2]
        for i, new in zip(free, ("ab", "cd")):
            tokens[i], types[i] = new, gguf.TokenType.NORMAL
        merges = ["a b", "c d"]
    w.add_token_merges(merges)
    if eos:
        w.add_eos_token_id(tok.eos_token_id)
    w.add_pad_token_id(tok.pad_token_id)
    w.add_chat_template(tok.chat_template)
    names = gguf.get_tensor_name_map(arch, cfg.num_hidden_layers)
    state = {}
    for shard in shard_files(model_dir):
        state.update(load_file(shard))
    for hf_name, t in state.items():
        base, suffix = hf_name.rsplit(".", 1)
        g = names.get_name(base)
        assert g is not None, hf_name
        a = t.float().numpy() * (scale if a_weight(hf_name) else 1.0)
        if arch == gguf.MODEL_ARCH.LLAMA and g.endswith(("attn_q", "attn_k")):  # llama.cpp's rotary layout
            heads = cfg.num_attention_heads if g.endswith("attn_q") else cfg.num_key_value_heads
            a = a.reshape(heads, 2, a.shape[0] // heads // 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)
        if a.ndim == 2 and qtype == "Q8_0":
            w.add_tensor(f"{g}.{suffix}", gguf.quants.quantize(a, gguf.GGMLQuantizationType.Q8_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        elif a.ndim == 2 and qtype == "F16":
            w.add_tensor(f"{g}.{suffix}", a.astype(np.float16))
        else:
            w.add_tensor(f"{g}.{suffix}", a.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="session")
def tiny_gguf(tiny_dirs, tmp_path_factory):
    """``{"F32": file, "Q8_0": file}``: the tiny Qwen2 model written as GGUF files (tensors as named)."""
    root = tmp_path_factory.mktemp("gguf")
    return {q: write_gguf(tiny_dirs["qwen2"], root / f"tiny-{q}.gguf", q) for q in ("F32", "Q8_0")}


@pytest.fixture(scope="session")
def gguf_writer():
    """:func:`write_gguf`, for tests that write GGUF files of their own models."""
    return write_gguf


@pytest.fixture
def lora_policy():
    """``make(model_dir, seed)``: an fp32 policy from ``model_dir`` with rank-4 LoRA adapters whose B matrices are
    drawn (std 0.05) instead of PEFT's zeros, so the adapters change what the model computes."""
    import torch

    def make(model_dir, seed: int):
        from qerl.lora import LoraSettings, apply_lora
        from qerl.models import load_policy

        model = load_policy(model_dir, dtype=torch.float32)
        torch.manual_seed(seed)
        model = apply_lora(model, LoraSettings(r=4, alpha=8.0))
        for n, p in model.named_parameters():
            if "lora_B" in n:
                torch.nn.init.normal_(p, std=0.05)
        return model

    return make


def bf16_ulp(x):
    """One bf16 ulp at the magnitude of ``x`` (a tensor): bf16 keeps 8 significant bits, so a value in
    [2^e, 2^(e+1)) is stored to a step of 2^(e-7)."""
    import torch

    return torch.exp2(torch.floor(torch.log2(x.abs().clamp(min=2.0 ** -100))) - 7)


# Two bf16 computations of the same logits that block their sums differently (another batch shape, another
# instruction set: oneDNN's AMX, AVX512-BF16 and AVX2 kernels each round their own way) differ by a few ulps of
# the largest logit: each layer's activations are rounded to bf16 (relative 2^-9) on both sides. A greedy token is
# judged an argmax "within bf16 rounding" when its teacher-forced logit is within NEAR_TIE_ULPS ulps of the row's
# largest: twice the largest gap measured (4 ulps: tiny Qwen2 / Llama, bf16 and NVFP4 bases, with and without LoRA,
# engine and reference sampler, 5 prompts x 24 tokens, oneDNN's AVX512-BF16, AVX512 and AVX2 kernels).
NEAR_TIE_ULPS = 8


def greedy_within_rounding(model, r, ref_ids=None, ulps: int = NEAR_TIE_ULPS) -> dict:
    """The judge of bf16 greedy decoding on a CPU, where no two computations of the same policy may be compared
    bit for bit across batch shapes: every token of the rollout ``r`` (a :class:`qerl.rollout.RolloutResult`, T = 0)
    is an argmax of the teacher-forced logits of its own prefix within ``ulps`` bf16 ulps of the row's largest
    logit; and where a reference's tokens ``ref_ids [N, >= T]`` differ from ``r``'s, they first differ at a
    near-tie (the reference's token is within the same margin there). Asserts both; returns ``{"rows_equal",
    "max_gap_ulps"}``."""
    import torch

    with torch.no_grad():
        ids = torch.cat([r.prompt_ids, r.completion_ids], 1)
        attn = torch.cat([r.prompt_mask, r.completion_mask.to(r.prompt_mask.dtype)], 1)
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        logits = model(input_ids=ids, attention_mask=attn, position_ids=pos).logits.float()
    p, worst, equal = r.prompt_ids.shape[1], 0.0, 0
    for i in range(r.completion_ids.shape[0]):
        n = int(r.completion_mask[i].sum())
        z = logits[i, p - 1: p - 1 + n]  # [n, V]: the logits that chose tokens 0..n-1
        top = z.max(-1).values
        unit = bf16_ulp(top)
        gap = (top - z.gather(1, r.completion_ids[i, :n, None])[:, 0]) / unit
        worst = max(worst, float(gap.max()) if n else 0.0)
        assert bool((gap <= ulps).all()), f"row {i}: token {int(gap.argmax())} is {float(gap.max()):.1f} bf16 ulps " \
                                          f"below the argmax of the teacher-forced logits (margin {ulps})"
        if ref_ids is None:
            continue
        ours, ref = r.completion_ids[i, :n], ref_ids[i, :n]
        diff = (ours != ref).nonzero()
        if not len(diff):
            equal += 1
            continue
        j = int(diff[0])
        assert int(ref[j]) >= 0, f"row {i}: the reference has no token at {j} (it ended), the rollout has one"
        ref_gap = float((top[j] - z[j, ref[j]]) / unit[j])
        assert ref_gap <= ulps, f"row {i} parts from the reference at token {j}, where the reference's token is " \
                                f"{ref_gap:.1f} bf16 ulps below the argmax (not a near-tie; margin {ulps})"
    return {"rows_equal": equal, "max_gap_ulps": worst}


@pytest.fixture
def greedy_judge():
    """:func:`greedy_within_rounding` as a fixture."""
    return greedy_within_rounding
