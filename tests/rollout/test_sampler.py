"""The reference sampler: greedy == transformers greedy, log-probs == teacher forcing, seeding,
stop handling, filters."""
import pytest
import torch
from transformers import AutoTokenizer

from qerl.models import load_policy
from qerl.rollout.sampler import generate, sequence_logprobs
from qerl.rollout.sampling import SamplingSettings, filter_logits as _filter

PROMPTS = ["12+7=", "hello, world", "a"]


@pytest.fixture(scope="module")
def tok(tiny_dirs):
    return AutoTokenizer.from_pretrained(tiny_dirs["qwen2"])


@pytest.mark.numerics
@pytest.mark.parametrize("base, dtype", [("bf16", torch.bfloat16), ("nvfp4", torch.bfloat16), ("bf16", torch.float32)])
def test_greedy_equals_transformers_generate(tiny_dirs, tok, base, dtype, greedy_judge):
    """fp32: the same tokens as ``transformers.generate``. bf16: each token an argmax within bf16 rounding, parting
    from ``generate`` only at a near-tie (CPU bf16 rounding depends on batch shape and instruction set)."""
    model = load_policy(tiny_dirs["qwen2"], base=base, dtype=dtype)
    r = generate(model, tok, PROMPTS, SamplingSettings(temperature=0, max_new_tokens=12))
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    ref = model.generate(**enc, max_new_tokens=12, do_sample=False, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id)[:, enc.input_ids.shape[1]:]
    if dtype == torch.bfloat16:
        greedy_judge(model, r, torch.nn.functional.pad(ref, (0, max(0, 12 - ref.shape[1])), value=-1))
        return
    for i in range(len(PROMPTS)):
        ours = r.completion_ids[i][r.completion_mask[i].bool()]
        assert ours.tolist() == ref[i][: len(ours)].tolist()


def test_rollout_logprobs_match_teacher_forcing(quantized_dirs, tok):
    model = load_policy(quantized_dirs["qwen2"], dtype=torch.float32)
    r = generate(model, tok, PROMPTS, SamplingSettings(temperature=0.8, top_p=0.9, max_new_tokens=10), seed=3, num_samples=2)
    assert r.completion_ids.shape[0] == 6 and r.logprobs.shape == r.completion_ids.shape
    with torch.no_grad():
        tf = sequence_logprobs(model, r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask, 0.8)
    assert torch.allclose(tf, r.logprobs, atol=1e-4)
    assert torch.all(r.logprobs[r.completion_mask == 0] == 0)


def test_live_columns_cover_every_real_token():
    from qerl.rollout.sampler import live_columns

    pm = torch.tensor([[0, 0, 1, 1], [0, 0, 0, 1]])
    cm = torch.tensor([[1, 1, 0, 0, 0], [1, 0, 0, 0, 0]])
    assert live_columns(pm, cm) == (2, 2)
    assert live_columns(torch.zeros(2, 3), torch.zeros(2, 4)) == (2, 1)  # (one column of each is kept)
    assert live_columns(torch.ones(1, 3), torch.ones(1, 4)) == (0, 4)


def test_row_spans_give_live_columns_of_any_rows_without_a_sync():
    """``columns_of(row_spans(batch), rows)`` == ``live_columns`` of those rows, for slices, index tensors, rows
    without prompt or completion tokens."""
    from qerl.rollout.sampler import columns_of, live_columns, row_spans

    g = torch.Generator().manual_seed(0)
    N, P, T = 12, 7, 9
    plen, clen = torch.randint(0, P + 1, (N,), generator=g), torch.randint(0, T + 1, (N,), generator=g)
    pm = (torch.arange(P)[None, :] >= P - plen[:, None]).long()  # left-padded prompts
    cm = (torch.arange(T)[None, :] < clen[:, None]).long()  # right-padded completions
    spans = row_spans(pm, cm)
    picks = [slice(0, 4), slice(4, 12), torch.tensor([3, 1, 7]), torch.tensor([5]), torch.arange(N)]
    picks += [torch.randperm(N, generator=g)[:k] for k in (1, 2, 5, 11)]
    for rows in picks:
        assert columns_of(spans, rows, P) == live_columns(pm[rows], cm[rows]), rows
    empty = row_spans(torch.zeros(2, 3), torch.zeros(2, 4))
    assert columns_of(empty, slice(0, 2), 3) == live_columns(torch.zeros(2, 3), torch.zeros(2, 4)) == (2, 1)


def test_logprobs_skip_columns_that_are_padding_in_every_row(quantized_dirs, tok):
    """A micro-batch of a batch padded further than its own rows: the model runs on its live columns only, and the
    log-probs / entropies / gradients equal those of the same rows without the extra padding (fp32)."""
    model = load_policy(quantized_dirs["qwen2"], dtype=torch.float32)
    r = generate(model, tok, PROMPTS, SamplingSettings(temperature=0.8, max_new_tokens=10), seed=5)
    extra_p, extra_c = 3, 7  # columns of padding on both sides, as a longer batch would leave them
    pid = torch.cat([torch.full((3, extra_p), tok.pad_token_id), r.prompt_ids], 1)
    pm = torch.cat([torch.zeros(3, extra_p, dtype=r.prompt_mask.dtype), r.prompt_mask], 1)
    cid = torch.cat([r.completion_ids, torch.full((3, extra_c), tok.pad_token_id)], 1)
    cm = torch.cat([r.completion_mask, torch.zeros(3, extra_c, dtype=r.completion_mask.dtype)], 1)
    calls = []
    hook = model.get_decoder().register_forward_pre_hook(lambda m, a, kw: calls.append(kw["input_ids"].shape[1]),
                                                        with_kwargs=True)
    try:
        want, went = sequence_logprobs(model, r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask, 0.8,
                                       with_entropy=True)
        got, gent = sequence_logprobs(model, pid, pm, cid, cm, 0.8, with_entropy=True)
    finally:
        hook.remove()
    live = int(r.prompt_mask.bool().any(0).sum()) + int(r.completion_mask.bool().any(0).sum())
    assert calls == [live, live]  # the padded call ran on the same columns
    assert got.shape == cid.shape and torch.all(got[:, -extra_c:] == 0) and torch.all(gent[:, -extra_c:] == 0)
    assert torch.allclose(got[:, :-extra_c], want, atol=1e-6) and torch.allclose(gent[:, :-extra_c], went, atol=1e-6)
    assert torch.allclose(want, r.logprobs, atol=1e-4)


def test_seeded_and_groups(quantized_dirs, tok):
    model = load_policy(quantized_dirs["qwen2"])
    s = SamplingSettings(max_new_tokens=8)
    a = generate(model, tok, PROMPTS[:2], s, seed=1, num_samples=4)
    b = generate(model, tok, PROMPTS[:2], s, seed=1, num_samples=4)
    c = generate(model, tok, PROMPTS[:2], s, seed=2, num_samples=4)
    assert torch.equal(a.completion_ids, b.completion_ids)
    assert not torch.equal(a.completion_ids, c.completion_ids)
    assert torch.equal(a.prompt_ids[0], a.prompt_ids[3]) and not torch.equal(a.prompt_ids[3], a.prompt_ids[4])


def test_eos_and_truncation(quantized_dirs, tok):
    model = load_policy(quantized_dirs["qwen2"])
    head = model.lm_head  # a bias on the EOS logit forces (then forbids) EOS
    head.bias = torch.nn.Parameter(torch.zeros(head.out_features, dtype=head.weight.dtype), requires_grad=False)
    head.bias.data[tok.eos_token_id] = 100.0
    r = generate(model, tok, PROMPTS, SamplingSettings(temperature=0, max_new_tokens=6))
    assert r.completion_ids[:, 0].tolist() == [tok.eos_token_id] * 3
    assert r.completion_mask.sum(1).tolist() == [1, 1, 1] and not r.truncated.any()
    head.bias.data[tok.eos_token_id] = -100.0
    r = generate(model, tok, PROMPTS, SamplingSettings(temperature=1.0, max_new_tokens=5))
    assert r.truncated.all() and r.completion_mask.sum(1).tolist() == [5, 5, 5]


def test_stop_strings(quantized_dirs, tok):
    model = load_policy(quantized_dirs["qwen2"])
    full = generate(model, tok, ["x"], SamplingSettings(temperature=0, max_new_tokens=16))
    text = full.texts[0]
    stop = text[3:5]
    r = generate(model, tok, ["x"], SamplingSettings(temperature=0, max_new_tokens=16, stop=(stop,)))
    assert r.texts[0].endswith(stop) and len(r.texts[0]) <= 5 and not r.truncated[0]


def test_filters():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert torch.isinf(_filter(logits, 2, 1.0)).tolist() == [[False, False, True, True]]
    assert torch.isinf(_filter(logits, 0, 0.7)).tolist() == [[False, False, True, True]]
    assert torch.isinf(_filter(logits, 0, 0.4)).tolist() == [[False, True, True, True]]
    with pytest.raises(ValueError, match="top_p"):
        SamplingSettings(top_p=0)
