"""Packed sequences (:mod:`qerl.ops.packed`): the plan's indices, the per-sequence attention reference, and
teacher-forced log-probs / entropies / gradients of a packed micro-batch equal to the padded one's (fp32)."""
import pytest
import torch
from transformers import AutoTokenizer

from qerl.models import load_policy
from qerl.ops import packed
from qerl.rollout.sampler import generate, sequence_logprobs
from qerl.rollout.sampling import SamplingSettings

PROMPTS = ["12+7=", "hello, world", "a"]


def test_plan_indices_by_hand():
    pm = torch.tensor([[0, 1, 1], [1, 1, 1]])
    cm = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0]])
    p = packed.plan(pm, cm)
    # row 0: prompt cols 1, 2 and completion cols 0, 1 (flat 1, 2, 3, 4); row 1: prompt 0-2, completion 0 (7, 8, 9, 10)
    assert p.source.tolist() == [1, 2, 3, 4, 7, 8, 9, 10]
    assert p.positions.tolist() == [0, 1, 2, 3, 0, 1, 2, 3]
    assert p.cu.tolist() == [0, 4, 8] and p.cu.dtype == torch.int32 and p.max_len == 4
    assert p.pred.tolist() == [1, 2, 6]  # the packed token before each completion token
    assert p.target.tolist() == [3, 4, 10] and p.rows.tolist() == [0, 0, 1] and p.cols.tolist() == [0, 1, 0]


def test_plan_refuses_a_row_without_a_prompt_token_and_device_masks():
    with pytest.raises(ValueError, match="row 1 has no prompt token"):
        packed.plan(torch.tensor([[1], [0]]), torch.tensor([[1, 1], [1, 0]]))
    p = packed.plan(torch.tensor([[1], [0]]), torch.tensor([[1, 1], [0, 0]]))  # (an empty row is fine)
    assert p.cu.tolist() == [0, 3, 3] and p.rows.tolist() == [0, 0]
    with pytest.raises(ValueError, match="CPU tensors"):
        packed.plan(torch.ones(1, 2, device="meta"), torch.ones(1, 2))


def test_attention_reference_is_causal_within_each_sequence_only():
    g = torch.Generator().manual_seed(0)
    lens = [3, 5, 1]
    H, Hkv, D = 4, 2, 8
    q, k, v = (torch.randn(1, h, sum(lens), D, generator=g) for h in (H, Hkv, Hkv))
    cu = torch.tensor([0, 3, 8, 9], dtype=torch.int32)
    out = packed.attention_reference(q, k, v, cu, 0.3)
    assert out.shape == (1, 9, H, D)
    kr, vr = (t.repeat_interleave(H // Hkv, 1) for t in (k, v))
    for s, e in ((0, 3), (3, 8), (8, 9)):
        for t in range(s, e):  # by hand: softmax over the sequence's tokens up to t
            w = torch.softmax((q[0, :, t] * kr[0, :, s:t + 1].transpose(0, 1)).sum(-1).T * 0.3, -1)  # [H, t-s+1]
            want = (w[:, :, None] * vr[0, :, s:t + 1]).sum(1)
            assert torch.allclose(out[0, t], want, atol=1e-5)


@pytest.fixture(scope="module")
def tok(tiny_dirs):
    return AutoTokenizer.from_pretrained(tiny_dirs["qwen2"])


@pytest.mark.parametrize("base", ["bf16", "nvfp4"])
def test_packed_logprobs_and_gradients_equal_the_padded_ones(tiny_dirs, quantized_dirs, tok, base, lora_policy):
    """fp32: the packed row computes what the padded batch does on every real token (log-probs, entropies, the
    gradient of every trainable parameter); padded positions are 0; the attention implementation comes back."""
    model = lora_policy((tiny_dirs if base == "bf16" else quantized_dirs)["qwen2"], 1)
    r = generate(model, tok, PROMPTS, SamplingSettings(temperature=0.8, max_new_tokens=10), seed=5, num_samples=2)
    args = (r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask, 0.8)
    impl = model.get_decoder().config._attn_implementation
    grads = []
    for packing in (None, True):
        model.zero_grad(set_to_none=True)
        lp, ent = sequence_logprobs(model, *args, with_entropy=True, packing=packing)
        (lp * torch.linspace(0.5, 1.5, lp.numel()).view_as(lp)).sum().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad})
        if packing is None:
            want, went = lp.detach(), ent
        else:
            got, gent = lp.detach(), ent
    assert model.get_decoder().config._attn_implementation == impl
    with packed.packed_scope(model), torch.no_grad():  # a padded micro-batch inside the scope (auto mixes them):
        inside = sequence_logprobs(model, *args)  # transformers' SDPA attention and mask, as outside
        assert model.get_decoder().config._attn_implementation == packed.NAME
    assert torch.equal(inside, want)
    assert got.shape == want.shape and torch.all(got[r.completion_mask == 0] == 0)
    assert torch.allclose(got, want, atol=2e-5) and torch.allclose(gent, went, atol=2e-5)
    assert len(grads[0]) > 0 and grads[0].keys() == grads[1].keys()
    for n in grads[0]:
        assert torch.allclose(grads[1][n], grads[0][n], atol=1e-5, rtol=1e-4), n


@pytest.mark.parametrize("algorithm, checkpointing", [("grpo", False), ("dapo", True)])
def test_update_policy_packed_equals_padded(quantized_dirs, tok, algorithm, checkpointing, lora_policy):
    """The trainer's update phase (``qerl.train.update.update_policy``: the old-log-prob pass, micro-batches,
    backward, clipping, AdamW) with ``packed_sequences: true`` moves every adapter as the padded update does (fp32,
    NVFP4 base; with gradient checkpointing the recompute runs inside the packed scope), and returns the same loss."""
    import copy
    import dataclasses

    from qerl.train.config import AlgorithmConfig, TrainConfig
    from qerl.train.update import LogprobModule, packing_mode, update_policy

    base = lora_policy(quantized_dirs["qwen2"], 2)
    r = generate(base, tok, PROMPTS[:2], SamplingSettings(temperature=1.0, max_new_tokens=9), seed=7, num_samples=4)
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.0, 0.0, 1.0, 1.0, 0.25])
    a = AlgorithmConfig(name=algorithm, group_size=4, updates_per_batch=2).resolved()  # (two passes: old log-probs)
    a = dataclasses.replace(a, overlong_mask=False)  # (DAPO: every completion here is cut at 9 tokens)
    out = {}
    for packed_on in (False, True):
        policy = copy.deepcopy(base)
        if checkpointing:
            policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        cfg = TrainConfig(micro_batch_size=4, algorithm=a, packed_sequences=packed_on,
                          rollout=SamplingSettings(temperature=1.0, max_new_tokens=9))
        assert packing_mode(cfg, policy) == ("on" if packed_on else "off")
        opt = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=1e-3)
        info = update_policy(policy, LogprobModule(policy), r, rewards, cfg, None, 0.0, 0, opt)
        out[packed_on] = info, {n: p.detach().clone() for n, p in policy.named_parameters() if p.requires_grad}
        assert policy.get_decoder().config._attn_implementation == base.get_decoder().config._attn_implementation
    (want, wp), (got, gp) = out[False], out[True]
    assert abs(got["loss"] - want["loss"]) < 1e-5 and abs(got["grad_norm"] - want["grad_norm"]) < 1e-4 * want["grad_norm"]
    moved = [n for n in wp if not torch.equal(wp[n], dict(base.named_parameters())[n].detach())]
    assert moved and len(moved) == len(wp)
    for n in wp:
        assert torch.allclose(gp[n], wp[n], atol=1e-6, rtol=1e-4), n


def test_rows_without_completion_tokens_run_padded(quantized_dirs, tok):
    """A micro-batch whose rows have no completion token (nothing to pack): the padded path, zeros connected to the
    graph (the update's loss then still depends on the adapters)."""
    from qerl.lora import LoraSettings, apply_lora

    model = apply_lora(load_policy(quantized_dirs["qwen2"], dtype=torch.float32), LoraSettings(r=4, alpha=8.0))
    pid, pm = torch.tensor([[5, 6, 7], [0, 8, 9]]), torch.tensor([[1, 1, 1], [0, 1, 1]])
    cid, cm = torch.zeros(2, 4, dtype=torch.long), torch.zeros(2, 4, dtype=torch.long)
    lp = sequence_logprobs(model, pid, pm, cid, cm, 1.0, packing=True)
    assert lp.shape == (2, 4) and torch.all(lp == 0) and lp.requires_grad


def test_packed_sequences_config_and_auto():
    """The config field; auto off the GPU; auto's rule per micro-batch (padding ratio by hand)."""
    from types import SimpleNamespace

    from qerl.train.config import ConfigError, TrainConfig, validate
    from qerl.train.update import micro_packings, packing_mode

    with pytest.raises(ConfigError, match="packed_sequences: true, false or auto, got 'yes'"):
        validate(TrainConfig(packed_sequences="yes"))
    model = torch.nn.Linear(2, 2)
    assert packing_mode(TrainConfig(), model) == "off"  # auto off the GPU (no varlen kernel)
    assert packing_mode(TrainConfig(packed_sequences=True), model) == "on"
    assert not packed.varlen_ok("cpu", torch.bfloat16)
    assert not packed.varlen_ok("cuda", torch.float32)  # FlashAttention takes bf16 / fp16 only: fp32 -> the reference
    assert packed.varlen_ok("cuda", torch.bfloat16) == (packed._varlen() is not None)
    pm = torch.tensor([[0, 1, 1], [1, 1, 1], [1, 1, 1], [1, 1, 1]])
    cm = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0], [1, 0, 0, 0], [1, 0, 0, 0]])
    # rows 0-1: 2 x 7 live columns for 12 real tokens; rows 2-3: 2 x 4 columns for 8; all four: 4 x 7 for 20
    assert packed.padding_ratio(pm[:2], cm[:2]) == pytest.approx(14 / 12)
    assert packed.padding_ratio(pm[2:], cm[2:]) == pytest.approx(8 / 8)
    assert packed.padding_ratio(pm, cm) == pytest.approx(28 / 20)
    assert packed.padding_ratio(torch.zeros(1, 2), torch.zeros(1, 3)) == float("inf")
    batch = SimpleNamespace(prompt_mask=pm, completion_mask=cm, completion_ids=torch.zeros(4, 4, dtype=torch.long))
    halves, whole = [(slice(0, 2), True), (slice(2, 4), True)], [(slice(0, 4), True)]
    assert micro_packings("auto", batch, halves) == [None, None]  # under PACK_RATIO: padded
    got = micro_packings("auto", batch, whole)  # 1.4x: packed
    assert got[0] is not None and got[0].cu.tolist() == [0, 6, 12, 16, 20]
    assert all(p is not None for p in micro_packings("on", batch, halves))
    assert micro_packings("off", batch, whole) == [None]
