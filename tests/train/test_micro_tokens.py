"""Micro-batches cut by tokens (``micro_batch_tokens``): the cut by hand, ranks in step, the planner's budget and its
resolution, and the whole update phase equal to the one-micro-batch update (fp32, packed on the CPU reference)."""
import pytest
import torch

from qerl.train import dist
from qerl.train.config import ConfigError, TrainConfig, validate
from qerl.train.update import token_micro_batches

# six rows, groups of 3: real tokens (prompt + completion) 3+5=8, 2+1=3, 3+4=7 | 3+0=3, 1+6=7, 3+2=5
PM = torch.tensor([[1, 1, 1], [0, 1, 1], [1, 1, 1], [1, 1, 1], [0, 0, 1], [1, 1, 1]])
CM = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 0, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0],
                   [0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1], [1, 1, 0, 0, 0, 0]])


def _rows(micro):
    return [(m.tolist(), real) for m, real in micro]


def test_token_micro_batches_first_fit_longest_first_by_hand():
    # longest first: 8 (row 0), 7 (2), 7 (4), 5 (5), 3 (1), 3 (3); budget 15: [0, 2] = 15, [4, 5, 1] = 15, [3] = 3
    assert _rows(token_micro_batches(PM, CM, 3, 15, dist.Dist())) == [([0, 2], True), ([1, 4, 5], True),
                                                                      ([3], True)]
    # budget 10: 8 alone (8 + 3 = 11), 7 + 3, 7 + 3, 5
    assert _rows(token_micro_batches(PM, CM, 3, 10, dist.Dist())) == [([0], True), ([1, 2], True), ([3, 4], True),
                                                                      ([5], True)]
    # a row longer than the budget runs alone; everything in one when it fits
    assert _rows(token_micro_batches(PM, CM, 3, 6, dist.Dist()))[0] == ([0], True)
    assert _rows(token_micro_batches(PM, CM, 3, 33, dist.Dist())) == [([0, 1, 2, 3, 4, 5], True)]
    # padded cost: rows x (longest prompt + longest completion): [0, 2] = 2 x (3 + 5) = 16 > 15, [2, 5] = 2 x 7,
    # [4, 1] = 2 x (2 + 6) = 16 > 15, [1, 3] = 2 x (3 + 1)
    assert _rows(token_micro_batches(PM, CM, 3, 15, dist.Dist(), packed=False)) == [
        ([0], True), ([2, 5], True), ([4], True), ([1, 3], True)]

@pytest.mark.parametrize("budget", [6, 10, 15, 33])
def test_token_micro_batches_cover_each_rank_once_and_keep_ranks_in_step(budget):
    whole = token_micro_batches(PM, CM, 3, budget, dist.Dist())
    assert sorted(r for m, _ in whole for r in m.tolist()) == list(range(6))
    ranks = [token_micro_batches(PM, CM, 3, budget, dist.Dist(rank, 2)) for rank in range(2)]
    assert len(ranks[0]) == len(ranks[1])  # DDP: every rank runs as many (fillers weighted 0)
    for rank, micro in enumerate(ranks):
        real = [r for m, ok in micro if ok for r in m.tolist()]
        assert sorted(real) == list(range(3 * rank, 3 * rank + 3))  # its own whole group, each row once
        assert all(m.tolist() == micro[0][0].tolist() for m, ok in micro if not ok)
        for m, ok in micro:
            tokens = int(PM[m].sum() + CM[m].sum())
            assert tokens <= budget or len(m) == 1


def test_micro_batch_tokens_config():
    for bad in (0, -5, "yes", 1.5, True):
        with pytest.raises(ConfigError, match="micro_batch_tokens: a positive integer, auto or false"):
            validate(TrainConfig(micro_batch_tokens=bad))
    from qerl.train.config import ModelConfig

    for good in (False, "auto", 4096):
        assert validate(TrainConfig(model=ModelConfig(path="m"), micro_batch_tokens=good)).micro_batch_tokens == good


def test_auto_micro_tokens_is_the_largest_budget_that_fits():
    from qerl.bench.step import SHAPES
    from qerl.train.plan import TOKEN_STEP, auto_micro_tokens, estimate

    s = SHAPES["7B"]
    kw = dict(dense=True, prompts=4)
    n = auto_micro_tokens(s, "nvfp4", 64, 1024, available=80e9, **kw)
    peak = lambda t, ck=False: estimate(s, "nvfp4", 64, 256, 1024, 1, 32, ck, True, True, update_tokens=t,
                                         **kw)["peak_bytes"]
    assert n % TOKEN_STEP == 0 and 1280 <= n < 64 * 1280
    assert peak(n) <= 0.9 * 80e9 < peak(n + TOKEN_STEP)
    ck = auto_micro_tokens(s, "nvfp4", 64, 1024, checkpointing=True, available=80e9, **kw)
    assert ck > n and peak(ck, True) <= 0.9 * 80e9
    # the whole step where it fits; None where not one longest sequence does
    small = auto_micro_tokens(SHAPES["0.5B"], "nvfp4", 64, 384, available=80e9, **kw)
    assert small == 64 * (256 + 384)
    assert auto_micro_tokens(s, "nvfp4", 64, 1024, available=10e9, **kw) is None


def test_resolve_micro_tokens_rules():
    import dataclasses

    from qerl.bench.step import SHAPES
    from qerl.rollout import SamplingSettings
    from qerl.train.config import AlgorithmConfig
    from qerl.train.plan import auto_micro_tokens, resolve_micro_tokens

    s = SHAPES["7B"]
    cfg = TrainConfig(micro_batch_size=4, prompts_per_step=4, dense_update=True,
                      algorithm=AlgorithmConfig(name="grpo", group_size=16).resolved(),
                      rollout=SamplingSettings(max_new_tokens=1024))
    got, said = resolve_micro_tokens(cfg, s, available=80e9)
    want = auto_micro_tokens(s, "nvfp4", 64, 1024, available=80e9, dense=True, prompts=4)
    assert got.micro_batch_tokens == want and got.gradient_checkpointing is False and "without" in said
    on, said = resolve_micro_tokens(dataclasses.replace(cfg, gradient_checkpointing=True), s, available=80e9)
    assert on.gradient_checkpointing is True and on.micro_batch_tokens > want and " with gradient" in said
    # auto falls back to checkpointing where one longest sequence does not fit without it
    tight = 30e9
    assert auto_micro_tokens(s, "nvfp4", 64, 1024, available=tight, dense=True, prompts=4) is None
    ck, _ = resolve_micro_tokens(cfg, s, available=tight)
    assert ck.gradient_checkpointing is True and ck.micro_batch_tokens >= 1280
    # off: a micro-batch size given by the user, packing off, or nothing fits
    for c, kw in ((cfg, {"rows_auto": False}), (dataclasses.replace(cfg, packed_sequences=False), {}),
                  (dataclasses.replace(cfg, gradient_checkpointing=False), {"available": tight})):
        off, said = resolve_micro_tokens(c, s, **{"available": 80e9, **kw})
        assert off.micro_batch_tokens is False and said is None
    given, said = resolve_micro_tokens(dataclasses.replace(cfg, micro_batch_tokens=512), s, available=80e9)
    assert given.micro_batch_tokens == 512 and said is None


def test_update_policy_by_tokens_equals_one_micro_batch(quantized_dirs, lora_policy):
    """The trainer's update phase with ``micro_batch_tokens`` (several packed micro-batches of different row counts)
    moves every adapter as one micro-batch of the whole batch does, and returns the same loss (fp32, NVFP4 base)."""
    import copy

    from transformers import AutoTokenizer

    from qerl.rollout.sampler import generate
    from qerl.rollout.sampling import SamplingSettings
    from qerl.train.config import AlgorithmConfig
    from qerl.train.update import LogprobModule, update_policy

    tok = AutoTokenizer.from_pretrained(quantized_dirs["qwen2"])
    base = lora_policy(quantized_dirs["qwen2"], 2)
    r = generate(base, tok, ["12+7=", "hello, world"], SamplingSettings(temperature=1.0, max_new_tokens=9), seed=7,
                 num_samples=4)
    r.completion_mask[1, 3:] = 0  # rows of different lengths (as if they stopped early)
    r.completion_mask[6, 1:] = 0
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.0, 0.0, 1.0, 1.0, 0.25])
    a = AlgorithmConfig(name="grpo", group_size=4, updates_per_batch=2).resolved()
    real = (r.prompt_mask.sum(1) + r.completion_mask.sum(1)).tolist()
    budget = max(real) + min(real)  # the longest row with at most the shortest: several micro-batches
    micro = token_micro_batches(r.prompt_mask, r.completion_mask, 4, budget, dist.Dist())
    assert 2 < len(micro) < 8 and len({len(m) for m, _ in micro}) > 1
    out = {}
    for tokens in (False, budget):
        policy = copy.deepcopy(base)
        cfg = TrainConfig(micro_batch_size=8, micro_batch_tokens=tokens, algorithm=a, packed_sequences=True,
                          rollout=SamplingSettings(temperature=1.0, max_new_tokens=9))
        opt = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=1e-3)
        info = update_policy(policy, LogprobModule(policy), r, rewards, cfg, None, 0.0, 0, opt)
        out[tokens] = info, {n: p.detach().clone() for n, p in policy.named_parameters() if p.requires_grad}
    (want, wp), (got, gp) = out[False], out[budget]
    assert abs(got["loss"] - want["loss"]) < 1e-5 and abs(got["grad_norm"] - want["grad_norm"]) < 1e-4 * want["grad_norm"]
    for n in wp:
        assert torch.allclose(gp[n], wp[n], atol=1e-6, rtol=1e-4), n


def test_resolve_micro_tokens_takes_the_dense_copy_only_where_it_costs_no_tokens():
    from qerl.bench.step import SHAPES
    from qerl.rollout import SamplingSettings
    from qerl.train.config import AlgorithmConfig
    from qerl.train.plan import auto_micro_tokens, resolve_micro_tokens

    a = AlgorithmConfig(name="grpo", group_size=16).resolved()
    for shape, gen, dense in (("14B", 1024, False), ("0.5B", 384, True)):
        s = SHAPES[shape]
        cfg = TrainConfig(micro_batch_size=4, prompts_per_step=4, dense_update=True, algorithm=a,
                          rollout=SamplingSettings(max_new_tokens=gen))
        got, said = resolve_micro_tokens(cfg, s, available=80e9, dense_auto=True)
        budgets = {d: auto_micro_tokens(s, "nvfp4", 64, gen, available=80e9, dense=d, prompts=4) for d in (0, 1)}
        assert (budgets[1] >= budgets[0]) == dense  # 14B: the copy halves the budget; 0.5B: the whole step either way
        assert got.dense_update is dense and got.micro_batch_tokens == budgets[dense]
        assert f"dense_update {str(dense).lower()}" in said
        kept, _ = resolve_micro_tokens(cfg, s, available=80e9)  # dense_update given: kept
        assert kept.dense_update is True and kept.micro_batch_tokens == budgets[1]


@pytest.mark.parametrize("algorithm", ["grpo", "dapo", "dr_grpo", "gspo"])
def test_diagnostics_are_the_whole_batchs_however_it_is_cut(algorithm):
    """The update's loss diagnostics combined over micro-batches of different rows and tokens equal ``policy_loss`` on
    the whole batch: token means by token share, extremes over micro-batches, the loss by its micro-batch weight."""
    from qerl.rl.losses import LossSettings, micro_weight, policy_loss
    from qerl.train.update import Diagnostics

    g = torch.Generator().manual_seed(3)
    n, T = 7, 6
    logp, old = -torch.rand(n, T, generator=g), -torch.rand(n, T, generator=g)
    ref, ent, adv = -torch.rand(n, T, generator=g), torch.rand(n, T, generator=g), torch.randn(n, generator=g)
    mask = (torch.rand(n, T, generator=g) < 0.6).float()
    mask[4] = 0  # a row without loss tokens
    settings = LossSettings(algorithm, 0.2, 0.28, 0.1, T)
    whole, info = policy_loss(logp, old, adv, mask, settings, ref, None, ent, sync=True)
    diag = Diagnostics()
    tokens = mask.sum()
    for m in (torch.tensor([0, 5]), torch.tensor([1, 2, 3, 6]), torch.tensor([4])):
        _, part = policy_loss(logp[m], old[m], adv[m], mask[m], settings, ref[m], None, ent[m], sync=False)
        diag.add(part, micro_weight(settings.aggregation, mask, m), float(mask[m].sum() / tokens))
    got = diag.result(dist.Dist(), float(whole), "test")
    assert got["loss"] == pytest.approx(float(whole), rel=1e-6)
    for key, want in info.items():
        assert got[key] == pytest.approx(want, rel=1e-5, abs=1e-7), key
