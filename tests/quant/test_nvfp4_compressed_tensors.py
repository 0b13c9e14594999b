"""Bit-exact agreement with the ``compressed-tensors`` package (the independent judge), both ways."""
import pytest
import torch

from qerl.quant import nvfp4

ct = pytest.importorskip("compressed_tensors")
from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor  # noqa: E402
from compressed_tensors.quantization import preset_name_to_scheme  # noqa: E402
from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam  # noqa: E402

SCHEME = preset_name_to_scheme("NVFP4A16", ["Linear"])


def ct_compress(w: torch.Tensor, gs: torch.Tensor | None = None):
    """compressed-tensors' own NVFP4 path: min/max observers (fp32), qparams, compressor."""
    n, k = w.shape
    w32 = w.float()
    if gs is None:
        gs = generate_gparam(w32.amin().reshape(1), w32.amax().reshape(1))
    groups = w32.reshape(n, k // 16, 16)
    scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), SCHEME.weights, global_scale=gs)
    sd = NVFP4PackedCompressor.compress({"weight": w, "weight_scale": scale, "weight_global_scale": gs}, SCHEME)
    return sd["weight_packed"], sd["weight_scale"], gs


def ct_decompress(packed, scale, gs):
    """compressed-tensors' decompressor; it computes in fp32 and returns bf16."""
    sd = NVFP4PackedCompressor.decompress(
        {"weight_packed": packed, "weight_scale": scale, "weight_global_scale": gs}, SCHEME)
    assert sd["weight"].dtype == torch.bfloat16
    return sd["weight"]


def matrices():
    g = torch.Generator().manual_seed(1234)
    yield "gaussian", torch.randn(96, 256, generator=g) * 0.02
    yield "unit", torch.randn(64, 512, generator=g)
    yield "student_t2", torch.distributions.StudentT(2.0).sample((128, 256)) * 0.01
    yield "student_t1_cauchy", torch.distributions.StudentT(1.0).sample((64, 128)).clamp(-6e4, 6e4)
    yield "outlier_rows", torch.randn(32, 64, generator=g) * torch.logspace(-4, 2, 32).unsqueeze(1)
    w = torch.randn(48, 160, generator=g)
    w[:, :16] = 0  # all-zero blocks
    w[5, 17] = 40.0  # a single outlier
    yield "zeros_and_outlier", w
    yield "odd_rows", torch.randn(37, 48, generator=g)
    yield "tiny", torch.randn(16, 64, generator=g) * 1e-6  # fp16: subnormals and exact -0.0
    yield "signed_zeros", torch.tensor([[-0.0, 0.0, -1e-9, 1e-9] * 4 + [1.0] * 16] * 2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("case", list(matrices()), ids=lambda c: c[0])
def test_quantize_bit_exact(case, dtype):
    _, w = case
    w = w.to(dtype)
    packed, scale, gs = nvfp4.quantize(w)
    cp, cs, cgs = ct_compress(w)
    assert torch.equal(gs, cgs)
    assert torch.equal(scale.view(torch.uint8), cs.view(torch.uint8))
    assert torch.equal(packed, cp)


@pytest.mark.parametrize("case", list(matrices()), ids=lambda c: c[0])
def test_dequantize_bit_exact_both_directions(case):
    _, w = case
    bf16 = torch.bfloat16
    cp, cs, cgs = ct_compress(w.to(bf16))
    # their packing: our dequantize == their decompressor (bf16), and our fp32 rounds to it
    assert torch.equal(nvfp4.dequantize(cp, cs, cgs, dtype=bf16), ct_decompress(cp, cs, cgs))
    assert torch.equal(nvfp4.dequantize(cp, cs, cgs, dtype=torch.float32).to(bf16), ct_decompress(cp, cs, cgs))
    # our packing, either scale rule: their decompressor == our dequantize
    for rule in nvfp4.SCALE_RULES:
        p, s, g = nvfp4.quantize(w.to(bf16), scale_rule=rule)
        assert torch.equal(ct_decompress(p, s, g), nvfp4.dequantize(p, s, g, dtype=bf16)), rule


def test_fused_global_scale_bit_exact():
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(64, 128, generator=g) * s for s in (0.02, 0.05, 0.01))
    gs = nvfp4.fused_global_scale([q, k, v])
    for w in (q, k, v):
        packed, scale, got_gs = nvfp4.quantize(w, global_scale=gs)
        cp, cs, _ = ct_compress(w, gs=gs)
        assert torch.equal(got_gs, gs)
        assert torch.equal(scale.view(torch.uint8), cs.view(torch.uint8))
        assert torch.equal(packed, cp)


def test_all_sixteen_codes_unpack_like_compressed_tensors():
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8

    packed = torch.arange(256, dtype=torch.uint8).reshape(16, 16)
    ours = nvfp4.e2m1_to_float(nvfp4.unpack_fp4(packed))
    theirs = unpack_fp4_from_uint8(packed, 16, 32, dtype=torch.float32)
    assert torch.equal(ours, theirs)
