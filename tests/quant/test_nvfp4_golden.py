"""Hand-built golden vectors for the NVFP4 reference (nvfp4.md §1)."""
import pytest
import torch

from qerl.quant import nvfp4
from qerl.quant.nvfp4 import NVFP4Error, rne_e2m1_codes

GRID = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def test_every_grid_value_maps_to_its_code():
    x = torch.tensor(GRID + [-v for v in GRID[1:]])
    codes = rne_e2m1_codes(x)
    assert codes.tolist() == list(range(8)) + list(range(9, 16))
    assert nvfp4.e2m1_to_float(codes).tolist() == GRID + [-v for v in GRID[1:]]
    assert nvfp4.e2m1_to_float(torch.tensor([8])).item() == 0.0  # code 8 is -0


@pytest.mark.parametrize(
    "x, want",
    [  # every tie goes to the neighbour whose mantissa bit is 0 (even code)
        (0.25, 0.0), (0.75, 1.0), (1.25, 1.0), (1.75, 2.0), (2.5, 2.0), (3.5, 4.0), (5.0, 4.0),
        # just either side of each tie
        (0.2500001, 0.5), (0.7499999, 0.5), (1.2500001, 1.5), (1.7499999, 1.5),
        (2.5000002, 3.0), (3.4999998, 3.0), (5.0000005, 6.0),
        # saturation is the caller's clamp; the grid tops out at 6
        (6.0, 6.0), (5.9, 6.0),
    ],
)
def test_round_half_to_even(x, want):
    for sign in (1.0, -1.0):
        got = nvfp4.e2m1_to_float(rne_e2m1_codes(torch.tensor([sign * x])))
        assert got.item() == sign * want


def test_negative_zero_keeps_its_sign_bit():
    # compressed-tensors sets the sign bit for strictly negative values: -0.1 -> -0 (code 8),
    # while an exact -0.0 input (x < 0 is False) packs as +0
    assert rne_e2m1_codes(torch.tensor([-0.1, -0.0, 0.0, 0.1])).tolist() == [8, 0, 0, 0]


def test_pack_nibble_order_low_is_even_k():
    codes = torch.tensor([[1, 2, 15, 0]], dtype=torch.uint8)
    packed = nvfp4.pack_fp4(codes)
    assert packed.tolist() == [[0x21, 0x0F]]
    assert torch.equal(nvfp4.unpack_fp4(packed), codes)


def test_quantize_known_block():
    # amax = 6 -> gs = 448; block scale = fp8(448 * 6 / 6) = 448; eff = 1: values land on the grid
    row = torch.tensor([6.0, -6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.1, 0.0, 1.0, 2.0, 3.0, 4.0, -4.0])
    packed, scale, gs = nvfp4.quantize(row.reshape(1, 16))
    assert gs.item() == pytest.approx(448.0)
    assert scale.float().tolist() == [[448.0]]
    deq = nvfp4.dequantize(packed, scale, gs, dtype=torch.float32)[0]
    assert deq.tolist() == [6, -6, 0, 1, 1, 2, 2, 4, 4, -0.0, 0, 1, 2, 3, 4, -4]


def test_saturation_with_given_global_scale():
    # A given (fused) global scale larger than this tensor's own pushes block scales past 448:
    # they clamp to 448 and the elements clamp to +-6.
    w = torch.full((1, 16), 10.0)
    packed, scale, gs = nvfp4.quantize(w, global_scale=torch.tensor([1000.0]))
    assert scale.float().item() == 448.0
    deq = nvfp4.dequantize(packed, scale, gs, dtype=torch.float32)
    assert torch.allclose(deq, torch.full((1, 16), 6 * 448 / 1000.0))


def test_all_zero_block_and_tensor():
    w = torch.zeros(2, 32)
    w[1, 16:] = torch.linspace(-1, 1, 16)
    packed, scale, gs = nvfp4.quantize(w)
    assert scale[0].float().tolist() == [0.125, 0.125]  # exact-zero block scale stored as 0.125
    assert scale[1, 0].float().item() == 0.125
    assert nvfp4.dequantize(packed, scale, gs)[0].abs().sum() == 0
    packed, scale, gs = nvfp4.quantize(torch.zeros(4, 16))
    assert gs.item() == 1.0 and torch.all(packed == 0)


@pytest.mark.parametrize("magnitude", [1e-30, 1e-8, 1e-3, 1.0, 1e3, 1e8, 1e30])
def test_tiny_and_huge_magnitudes_keep_relative_error(magnitude):
    torch.manual_seed(0)
    w = torch.randn(8, 64) * magnitude
    packed, scale, gs = nvfp4.quantize(w)
    deq = nvfp4.dequantize(packed, scale, gs, dtype=torch.float32)
    rel = (deq.double() - w.double()).norm() / w.double().norm()
    assert rel < 0.15


def test_gaussian_error_and_size():
    torch.manual_seed(0)
    w = torch.randn(256, 1024)
    packed, scale, gs = nvfp4.quantize(w)
    err = nvfp4.quantization_error(w, nvfp4.dequantize(packed, scale, gs, torch.float32))
    assert 0.08 < err["rel_fro_error"] < 0.11  # nvfp4.md: ~0.09-0.10 on Gaussian weights
    bits = 8 * (packed.numel() + scale.numel()) / w.numel()
    assert bits == 4.5


def test_fused_global_scale_is_the_minimum():
    a, b = torch.randn(16, 32), torch.randn(8, 32) * 3
    gs = nvfp4.fused_global_scale([a, b])
    assert gs.item() == min(nvfp4.global_scale(a).item(), nvfp4.global_scale(b).item())


@pytest.mark.parametrize(
    "w, match",
    [
        (torch.randn(4, 24), "multiple of the NVFP4 block size 16"),
        (torch.tensor([[float("nan")] + [0.0] * 15]), "NaN/Inf"),
        (torch.tensor([[float("inf")] + [0.0] * 15]), "NaN/Inf"),
        (torch.randn(16), "2-D"),
        (torch.ones(2, 16, dtype=torch.int32), "floating-point"),
    ],
)
def test_bad_weights_raise_clear_errors(w, match):
    with pytest.raises(NVFP4Error, match=match):
        nvfp4.quantize(w)


def test_reciprocal_global_scale_is_rejected():
    w = torch.randn(4, 16)
    with pytest.raises(NVFP4Error, match="below 1.*reciprocal"):
        nvfp4.quantize(w, global_scale=torch.tensor([w.abs().max() / 2688]))
    for bad in (float("nan"), float("inf"), 0.0, -3.0):
        with pytest.raises(NVFP4Error, match="finite positive"):
            nvfp4.quantize(w, global_scale=torch.tensor([bad]))


def test_huge_weights_legitimately_have_global_scale_below_one():
    w = torch.randn(4, 16) * 1e6  # amax > 2688 -> gs < 1 (compressed-tensors does the same)
    packed, scale, gs = nvfp4.quantize(w)
    assert gs.item() < 1
    packed2, _, _ = nvfp4.quantize(w, global_scale=gs)  # a given gs < 1 is fine for such a tensor
    assert torch.equal(packed, packed2)


def test_dequantize_checks_shapes_and_dtypes():
    packed, scale, gs = nvfp4.quantize(torch.randn(4, 32))
    with pytest.raises(NVFP4Error, match="does not match"):
        nvfp4.dequantize(packed, scale[:, :1], gs)
    with pytest.raises(NVFP4Error, match="float8_e4m3fn"):
        nvfp4.dequantize(packed, scale.float(), gs)
    with pytest.raises(NVFP4Error, match="uint8"):
        nvfp4.dequantize(packed.to(torch.int8), scale, gs)
