"""Resuming a ZeroRedundancyOptimizer over an optimizer that nests part of its state in ``state_dict`` (as
bitsandbytes' 8-bit AdamW does, under ``_FSDP_WRAPPED_QUANT_STATE_KEY``): ZeRO's own load assigns the nested
form, so the next step would miss its states; ``load_optimizer_state`` un-nests them (found on an H200 with
bitsandbytes, reproduced here with a stand-in on a one-process gloo group)."""
import copy

import pytest
import torch
import torch.distributed as tdist
from torch.distributed.optim import ZeroRedundancyOptimizer

from qerl.train.state import load_optimizer_state


class NestingAdamW(torch.optim.AdamW):
    """AdamW whose state_dict nests the moments like bitsandbytes' optimizers nest their quantized states."""

    _FSDP_WRAPPED_QUANT_STATE_KEY = "__nested__"
    MOMENTS = ("exp_avg", "exp_avg_sq")

    def state_dict(self):
        sd = super().state_dict()
        sd["state"] = {i: {**{k: v for k, v in st.items() if k not in self.MOMENTS},
                           self._FSDP_WRAPPED_QUANT_STATE_KEY: {k: st[k] for k in self.MOMENTS}}
                       for i, st in sd["state"].items()}
        return sd

    def load_state_dict(self, sd):
        sd = {**sd, "state": {i: {**{k: v for k, v in st.items() if k != self._FSDP_WRAPPED_QUANT_STATE_KEY},
                                  **st.get(self._FSDP_WRAPPED_QUANT_STATE_KEY, {})} for i, st in sd["state"].items()}}
        super().load_state_dict(sd)


@pytest.fixture
def one_process_group(tmp_path):
    tdist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    yield
    tdist.destroy_process_group()


def _params():
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(4, 3, generator=g)), torch.nn.Parameter(torch.randn(5, generator=g))]


def _step(opt, params, seed):
    g = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)
    opt.step()


def test_zero_resume_of_a_nesting_optimizer(one_process_group):
    a = _params()
    opt = ZeroRedundancyOptimizer(a, optimizer_class=NestingAdamW, lr=0.1)
    _step(opt, a, 1)
    opt.consolidate_state_dict(to=0)
    sd = copy.deepcopy(opt.state_dict())  # as read back from the checkpoint file (no tensor shared with `opt`)
    assert "__nested__" in next(iter(sd["state"].values()))

    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    plain = ZeroRedundancyOptimizer(b, optimizer_class=NestingAdamW, lr=0.1)
    plain.load_state_dict(sd)  # ZeRO's own load: the nested form reaches the inner optimizer's state
    with pytest.raises(KeyError):
        _step(plain, b, 2)

    c = [torch.nn.Parameter(p.detach().clone()) for p in a]
    resumed = ZeroRedundancyOptimizer(c, optimizer_class=NestingAdamW, lr=0.1)
    load_optimizer_state(resumed, sd)
    _step(opt, a, 2)
    _step(resumed, c, 2)
    for x, y in zip(a, c):
        assert torch.equal(x, y)
