"""NVFP4 weight quantization, the pure-torch reference (no I/O, CPU or GPU).

Format (``../shared/docs/nvfp4.md``; bit-exact with ``compressed-tensors`` ``nvfp4-pack-quantized``):

* element: FP4 E2M1, codes ``0..7 -> 0, .5, 1, 1.5, 2, 3, 4, 6``; bit 3 is the sign. Values round to
  nearest with ties to the even mantissa; a small negative value that rounds to 0 keeps its sign
  (-0, code 8), as compressed-tensors writes it (an input of exactly -0.0 gives +0, code 0).
* blocks of 16 consecutive elements along K of a ``[N, K]`` Linear weight, each with an FP8 E4M3
  block scale ``s_b = fp8(clamp(gs * amax_block / 6, -448, 448))`` (an exact 0 is stored as 0.125);
* one fp32 global scale per tensor in the *quantize* direction, ``gs = 448 * 6 / amax(|W|)``
  (1.0 for an all-zero tensor); fused projections (q/k/v, gate/up) share the minimum of theirs.
* quantize ``q = rne_e2m1(clamp(x / (fp32(s_b) / gs), -6, 6))``;
  dequantize ``x_hat = e2m1(q) * (fp32(s_b) / gs)`` in fp32, then cast.
* packing: byte ``[n, j]`` holds ``W[n, 2j]`` in its low nibble and ``W[n, 2j+1]`` in its high one.

Cost 4.5 bits per weight (3.56x smaller than bf16). Public, stable API: :func:`quantize`,
:func:`dequantize`, :func:`pack_fp4`, :func:`unpack_fp4`, :func:`global_scale`,
:func:`fused_global_scale`.
"""
from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from qerl.quant import scale_rules as _rules

BLOCK_SIZE = 16
FP4_MAX = 6.0
FP8_MAX = 448.0
ZERO_SCALE_REPLACEMENT = 0.125
#: E2M1 magnitudes indexed by the 3-bit magnitude code.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
#: All 16 code values (bit 3 = sign; code 8 is -0).
E2M1_LUT = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32)

# Rounding thresholds on |x| for round-half-to-even onto the E2M1 grid. ``_UPPER[i]`` is the
# largest |x| mapped to code ``i``; at a tie the even-mantissa neighbour wins, so the bound is
# inclusive (``<=``) for codes 0, 2, 4, 6 and exclusive (``<``) for codes 1, 3, 5.
_BOUNDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


class NVFP4Error(ValueError):
    """Invalid input to NVFP4 quantization (shape, dtype, non-finite values, bad scales)."""


def _check_weight(w: torch.Tensor, name: str) -> None:
    if not isinstance(w, torch.Tensor) or w.ndim != 2:
        got = tuple(w.shape) if isinstance(w, torch.Tensor) else type(w).__name__
        raise NVFP4Error(f"{name}: expected a 2-D [N_out, K_in] weight, got shape {got}")
    if not w.dtype.is_floating_point:
        raise NVFP4Error(f"{name}: expected a floating-point weight, got dtype {w.dtype}")
    if w.shape[1] % BLOCK_SIZE != 0:
        raise NVFP4Error(
            f"{name}: K_in = {w.shape[1]} is not a multiple of the NVFP4 block size {BLOCK_SIZE} "
            f"(weight shape {tuple(w.shape)})"
        )
    if not bool(torch.isfinite(w).all()):
        bad = int((~torch.isfinite(w)).sum())
        raise NVFP4Error(f"{name}: weight holds {bad} NaN/Inf value(s); refusing to quantize")


def rne_e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """Round fp32 values already clamped to [-6, 6] to E2M1 codes (uint8 in 0..15).

    Round-half-to-even on the grid (ties go to the value whose mantissa bit is 0). The sign bit is
    set for every strictly negative input, so a small negative value that rounds to magnitude 0
    is stored as -0 (code 8), while an input of exactly -0.0 gives +0: exactly as
    compressed-tensors packs them (its CPU and Triton paths agree on this).
    """
    mag = x.abs()
    code = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for i, bound in enumerate(_BOUNDS):
        # Codes 0, 2, 4, 6 (even mantissa) own their upper tie; codes 1, 3, 5 do not.
        above = mag > bound if i % 2 == 0 else mag >= bound
        code += above.to(torch.uint8)
    sign = (x < 0).to(torch.uint8) << 3  # strictly negative: an input of -0.0 stays +0
    return code | sign


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """Pack ``[N, K]`` uint8 codes (0..15) into ``[N, K/2]`` bytes: low nibble = even k."""
    if codes.ndim != 2 or codes.shape[1] % 2:
        raise NVFP4Error(f"pack_fp4: expected [N, K] codes with even K, got {tuple(codes.shape)}")
    c = codes.to(torch.uint8)
    return (c[:, 0::2] & 0xF) | ((c[:, 1::2] & 0xF) << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_fp4`: ``[N, K/2]`` uint8 -> ``[N, K]`` uint8 codes."""
    if packed.dtype != torch.uint8 or packed.ndim != 2:
        raise NVFP4Error(
            f"unpack_fp4: expected a 2-D uint8 tensor, got {packed.dtype} {tuple(packed.shape)}"
        )
    lo = packed & 0xF
    hi = packed >> 4
    return torch.stack((lo, hi), dim=-1).reshape(packed.shape[0], packed.shape[1] * 2)


def e2m1_to_float(codes: torch.Tensor) -> torch.Tensor:
    """Codes (any integer dtype, 0..15) -> fp32 values."""
    return E2M1_LUT.to(codes.device)[codes.long()]


#: block-scale rules (the registry :mod:`qerl.quant.scale_rules`: name -> scale cap, block quantizer): ``max6`` (the
#: paper's: each block's largest value lands on ±6) and ``four-over-six`` (Cook et al. 2025, arXiv 2512.02010: per
#: block the scale mapping its largest value to 6 or to 4, whichever gives the smaller squared error — e2m1's step
#: from 4 to 6 is its coarsest). Every rule writes ordinary NVFP4.
SCALE_RULES = _rules.RULES
DEFAULT_RULE = _rules.DEFAULT  # max6
#: four-over-six keeps the max-to-6 block scales <= 256 (global scale ``6 * 256 / amax``) so that the max-to-4
#: candidate, 1.5x larger, still fits E4M3 (<= 384 < 448)
FOS_SCALE_MAX = _rules.get("four-over-six").scale_cap


def _check_rule(scale_rule: str) -> "_rules.ScaleRule":
    try:
        return _rules.get(scale_rule)
    except ValueError as e:
        raise NVFP4Error(str(e)) from None


def compute_global_scale(w: torch.Tensor, scale_rule: str = DEFAULT_RULE) -> torch.Tensor:
    """Per-tensor fp32 global scale ``[1]`` in the quantize direction: ``scale_cap * 6 / amax(|w|)``, the rule's cap
    (``448*6 / amax`` under ``max6``, ``256*6 / amax`` under ``four-over-six``)."""
    cap = _check_rule(scale_rule).scale_cap
    amax = w.detach().abs().amax().float()
    gs = (cap * FP4_MAX) / amax
    # amax = 0 (or so tiny that 2688/amax overflows) -> 1.0, exactly as compressed-tensors does.
    gs = torch.nan_to_num(gs, nan=1.0, posinf=1.0, neginf=1.0)
    return gs.reshape(1).to(torch.float32)


#: Public alias (``quantize`` takes a ``global_scale`` argument, hence the longer internal name).
global_scale = compute_global_scale


def fused_global_scale(weights: Iterable[torch.Tensor], scale_rule: str = DEFAULT_RULE) -> torch.Tensor:
    """Shared global scale of fused projections (q/k/v or gate/up): the minimum of theirs."""
    scales = [compute_global_scale(w, scale_rule) for w in weights]
    if not scales:
        raise NVFP4Error("fused_global_scale: needs at least one weight")
    return torch.stack(scales).amin(dim=0)


def check_global_scale(gs, name: str, *, reject_reciprocal: bool = False) -> torch.Tensor:
    """A ``[1]`` fp32 global scale; finite and positive. With ``reject_reciprocal``, below 1 too.

    A stored global scale below 1 almost always means the reciprocal convention (``amax / 2688``,
    as ModelOpt's ``weight_scale_2`` and torchao store it); only a tensor with ``amax > 2688``
    legitimately has one. Checkpoint readers pass ``reject_reciprocal=True``.
    """
    gs = torch.as_tensor(gs).detach().to(torch.float32).reshape(-1)
    if gs.numel() != 1:
        raise NVFP4Error(f"{name}: global scale must hold one value, got shape {tuple(gs.shape)}")
    value = float(gs)
    if not math.isfinite(value) or value <= 0:
        raise NVFP4Error(f"{name}: global scale is {value}; expected a finite positive number")
    if reject_reciprocal and value < 1.0:
        raise NVFP4Error(
            f"{name}: global scale {value:.6g} is below 1. NVFP4 global scales are stored in the "
            "quantize direction (gs = 2688 / amax, e.g. ~1e4 for typical weights); a value below 1 "
            "means the reciprocal (amax / 2688, as ModelOpt `weight_scale_2` or torchao store it) "
            "was given. Use 1 / that value."
        )
    return gs


def block_scales(w: torch.Tensor, gs: torch.Tensor) -> torch.Tensor:
    """FP8 E4M3 block scales ``[N, K/16]`` of ``w`` under global scale ``gs``."""
    n, k = w.shape
    amax_b = w.detach().float().reshape(n, k // BLOCK_SIZE, BLOCK_SIZE).abs().amax(dim=-1)
    s = torch.clamp(gs.to(w.device) * (amax_b / FP4_MAX), min=-FP8_MAX, max=FP8_MAX)
    s = s.to(torch.float8_e4m3fn)
    zero = s.float() == 0
    if bool(zero.any()):
        s = torch.where(zero, torch.tensor(ZERO_SCALE_REPLACEMENT).to(s.dtype), s)
    return s


@torch.no_grad()
def quantize(
    w: torch.Tensor, global_scale: torch.Tensor | float | None = None, *, name: str = "weight",
    scale_rule: str = DEFAULT_RULE,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize a Linear weight to NVFP4.

    Args:
        w: ``[N_out, K_in]`` float weight (any float dtype; math in fp32), K a multiple of 16.
        global_scale: fp32 global scale to use as is (e.g. the fused minimum); ``None`` computes
            ``2688 / amax(|w|)`` (``1536 / amax`` under four-over-six).
        name: tensor name used in error messages.
        scale_rule: a rule of :data:`SCALE_RULES` — ``max6`` (the paper's, :func:`quantize_max6`),
            ``four-over-six`` (:func:`quantize_four_over_six`) or any registered one.

    Returns:
        ``(packed uint8 [N, K/2], scale float8_e4m3fn [N, K/16], global_scale float32 [1])``.
    """
    _check_weight(w, name)
    rule = _check_rule(scale_rule)
    if global_scale is None:
        gs = compute_global_scale(w, scale_rule)
    else:
        # A given scale below 1 is the reciprocal convention unless this tensor's own is below 1.
        own_below_one = float(compute_global_scale(w, scale_rule)) < 1.0
        gs = check_global_scale(global_scale, name, reject_reciprocal=not own_below_one)
    return rule.quantize_blocks()(w, gs.to(w.device), own_scale=global_scale is None)


def quantize_max6(w: torch.Tensor, gs: torch.Tensor, own_scale: bool = True
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The paper's rule (compressed-tensors' arithmetic, bit for bit): per 16-block of ``w [N, K]`` the E4M3 scale
    ``fp8(gs · amax_b / 6)``, codes ``rne_e2m1(w / (scale / gs))``. Returns ``(packed, scale, gs)`` like
    :func:`quantize` (``own_scale``: unused, every block scale follows from ``gs``)."""
    n, k = w.shape
    scale = block_scales(w, gs)
    eff = scale.float() / gs  # [N, K/16]; computed exactly like compressed-tensors (no 1/gs)
    x = w.float().reshape(n, k // BLOCK_SIZE, BLOCK_SIZE) / eff.unsqueeze(-1)
    codes = rne_e2m1_codes(torch.clamp(x, -FP4_MAX, FP4_MAX)).reshape(n, k)
    return pack_fp4(codes), scale, gs.clone()


def quantize_four_over_six(w: torch.Tensor, gs: torch.Tensor, own_scale: bool = True
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Four Over Six (Cook et al. 2025): per 16-block ``b`` of ``w`` ``[N, K]`` under global scale ``gs``
    (``6·256 / amax``; ``amax = 6·256 / gs``, the tensor's own when ``own_scale``):

    * candidates ``s6 = fp8(gs · amax_b / 6)`` and ``s4 = fp8(1.5 · gs · amax_b / 6)`` (largest value on 6 / on 4);
    * ``q_c = rne_e2m1(w · 1 / (s_c / gs))``, ``ŵ_c = q_c · s_c · amax / 1536``;
    * keep ``s4`` where ``Σ_b (ŵ_4 − w)² < Σ_b (ŵ_6 − w)²`` (strictly), else ``s6``.

    The arithmetic follows the authors' reference (``fouroversix`` ``quantize_to_fp4``, ``ScaleRule.mse``) op for
    op, so the codes and scales are theirs bit for bit (tests/quant/test_four_over_six.py); a block whose scale
    rounds to 0 in fp8 is stored with scale 0.125 and zero codes — the same value, as ``max6`` stores it. Returns
    ``(packed, scale, gs)`` like :func:`quantize`; vectorised (runs wherever ``w`` is). On a GPU the block sums of
    squared errors are reduced in another order than on the CPU, so a block whose two candidates err equally to fp32
    rounding may take the other one (H100, Student-t 7B q/k/v and o weights: 1 of 1,032,192 and 3 of 802,816
    blocks, float64 error gap <= 8.7e-7 relative; the same reconstruction error to 7 digits)."""
    n, k = w.shape
    x = w.float().reshape(-1, BLOCK_SIZE)
    amax = (FP4_MAX * FOS_SCALE_MAX) / gs.float() if not own_scale else w.detach().abs().amax().float()
    enc = torch.tensor(FP4_MAX * FOS_SCALE_MAX, device=w.device) / amax
    dec = 1 / enc
    s6_hp = x.abs().amax(dim=-1) / torch.tensor(FP4_MAX, device=w.device) * enc
    cands = []
    for s_hp in (s6_hp, s6_hp * 1.5):
        s = s_hp.to(torch.float8_e4m3fn)
        sf = s.float()
        scaled = torch.where(sf.unsqueeze(1) != 0, x * (1 / (dec * sf.unsqueeze(1))), torch.zeros_like(x))
        codes = rne_e2m1_codes(torch.clamp(scaled, -FP4_MAX, FP4_MAX))
        deq = e2m1_to_float(codes) * sf.unsqueeze(1) * amax / torch.tensor(FP4_MAX * FOS_SCALE_MAX, device=w.device)
        cands.append((s, codes, ((deq - x) ** 2).sum(dim=-1)))
    (s6, c6, e6), (s4, c4, e4) = cands
    four = e4 < e6
    codes = torch.where(four.unsqueeze(1), c4, c6).reshape(n, k)
    scale = torch.where(four, s4.float(), s6.float())
    zero = scale == 0
    scale = torch.where(zero, torch.full_like(scale, ZERO_SCALE_REPLACEMENT), scale).to(torch.float8_e4m3fn)
    return pack_fp4(codes), scale.reshape(n, k // BLOCK_SIZE), gs.reshape(1).to(torch.float32).clone()


def dequantize(
    packed: torch.Tensor,
    scale: torch.Tensor,
    global_scale: torch.Tensor | float,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Dequantize NVFP4 to a dense ``[N, K]`` tensor of ``dtype`` (math in fp32).

    Args:
        packed: ``[N, K/2]`` uint8, low nibble = even k.
        scale: ``[N, K/16]`` float8_e4m3fn block scales.
        global_scale: fp32 ``[1]`` (quantize direction: divided out here).
    """
    check_packed(packed, scale, "dequantize")
    gs = check_global_scale(global_scale, "dequantize").to(packed.device)
    n = packed.shape[0]
    k = packed.shape[1] * 2
    values = e2m1_to_float(unpack_fp4(packed)).reshape(n, k // BLOCK_SIZE, BLOCK_SIZE)
    eff = (scale.float() / gs).unsqueeze(-1)
    return (values * eff).reshape(n, k).to(dtype)


def check_packed(packed: torch.Tensor, scale: torch.Tensor, name: str) -> None:
    """Validate dtypes and shapes of a packed weight and its block scales."""
    if packed.dtype != torch.uint8 or packed.ndim != 2:
        raise NVFP4Error(
            f"{name}: weight_packed must be 2-D uint8 [N, K/2], got {packed.dtype} "
            f"{tuple(packed.shape)}"
        )
    if scale.dtype != torch.float8_e4m3fn or scale.ndim != 2:
        raise NVFP4Error(
            f"{name}: weight_scale must be 2-D float8_e4m3fn [N, K/16], got {scale.dtype} "
            f"{tuple(scale.shape)}"
        )
    n, half_k = packed.shape
    if (half_k * 2) % BLOCK_SIZE or tuple(scale.shape) != (n, half_k * 2 // BLOCK_SIZE):
        raise NVFP4Error(
            f"{name}: weight_scale shape {tuple(scale.shape)} does not match weight_packed "
            f"{tuple(packed.shape)}; expected ({n}, {half_k * 2 // BLOCK_SIZE})"
        )


def quantization_error(w: torch.Tensor, w_hat: torch.Tensor) -> dict[str, float]:
    """Relative Frobenius error ``||w - w_hat|| / ||w||`` and SQNR in dB of a reconstruction."""
    w = w.float()
    err = (w - w_hat.float()).norm()
    ref = w.norm()
    rel = float(err / ref) if float(ref) > 0 else 0.0
    sqnr = float(20 * torch.log10(ref / err)) if float(err) > 0 else float("inf")
    return {"rel_fro_error": rel, "sqnr_db": sqnr}
