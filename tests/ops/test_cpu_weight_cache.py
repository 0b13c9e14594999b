"""The CPU path's cache of dequantized weights (`qerl.ops.linear.dequantized_weight`): reused while the packed
tensors are unchanged, rebuilt after an in-place write or a replaced tensor, dropped with its weight, bounded by
`QERL_CPU_WEIGHT_CACHE_MB` (LRU; 0 = off); results equal the uncached reference's bit for bit."""
import gc

import torch

from qerl.ops import linear
from qerl.quant import nvfp4


def _weight(n=32, k=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return nvfp4.quantize(torch.randn(n, k, generator=g))


def test_reused_until_changed_and_dropped_with_the_weight(monkeypatch):
    monkeypatch.setenv("QERL_CPU_WEIGHT_CACHE_MB", "64")
    p, s, g = _weight()
    w1 = linear.dequantized_weight(p, s, g, torch.float32)
    assert linear.dequantized_weight(p, s, g, torch.float32) is w1  # a hit: no rebuild
    assert torch.equal(w1, nvfp4.dequantize(p, s, g, torch.float32))
    assert linear.dequantized_weight(p, s, g, torch.bfloat16).dtype == torch.bfloat16  # one entry per dtype
    p[0, 0] ^= 0x11  # an in-place write (e.g. loading other weights into the buffer)
    w2 = linear.dequantized_weight(p, s, g, torch.float32)
    assert w2 is not w1 and torch.equal(w2, nvfp4.dequantize(p, s, g, torch.float32)) and not torch.equal(w1, w2)
    s2 = s.clone()  # a replaced scale tensor (same values): rebuilt, not trusted by value
    assert linear.dequantized_weight(p, s2, g, torch.float32) is not w2
    x = torch.randn(3, 64)
    assert torch.equal(linear.reference_forward(x, p, s2, g, None),
                       torch.nn.functional.linear(x, nvfp4.dequantize(p, s2, g, torch.float32)))
    gc.collect()  # (weights of earlier tests still in reference cycles leave the cache now, not below)
    n = len(linear._CPU_CACHE)
    del p
    gc.collect()
    assert len(linear._CPU_CACHE) == n - 2  # both dtypes of the freed weight


def test_bounded_lru_and_off(monkeypatch):
    ws = [_weight(64, 64, seed=i) for i in range(4)]  # 16 KiB each in fp32
    monkeypatch.setenv("QERL_CPU_WEIGHT_CACHE_MB", str(40 / 1024))  # room for two
    linear._CPU_CACHE.clear()
    linear._CPU_CACHE_BYTES[0] = 0
    outs = [linear.dequantized_weight(*w, torch.float32) for w in ws]
    assert len(linear._CPU_CACHE) == 2 and linear._CPU_CACHE_BYTES[0] == 2 * 64 * 64 * 4
    assert linear.dequantized_weight(*ws[3], torch.float32) is outs[3]  # the newest kept
    assert linear.dequantized_weight(*ws[0], torch.float32) is not outs[0]  # the oldest evicted
    monkeypatch.setenv("QERL_CPU_WEIGHT_CACHE_MB", "0")
    assert linear.dequantized_weight(*ws[1], torch.float32) is not linear.dequantized_weight(*ws[1], torch.float32)
