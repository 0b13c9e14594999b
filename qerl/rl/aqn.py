"""Adaptive Quantization Noise (AQN), paper §3 / Alg. 1.

A fresh Gaussian vector ``Z ~ N(0, σ² I_hidden)`` is added to each RMSNorm weight that feeds the
quantized linears (``input_layernorm`` -> q, k, v; ``post_attention_layernorm`` -> gate, up; the
final norm optionally). Since ``RMSNorm_noise(x) · Ŵᵀ = RMSNorm(x) · ((1 + Z/w) ⊙ Ŵ)ᵀ``, additive
channel noise on the norm weight is row-wise multiplicative noise on the next quantized weights
(rows of Ŵᵀ = input channels), at zero extra parameters.

σ follows stages over training: stage 0 has σ = 0 (quantization noise only); stages k = 1..K
decay from σ_start to σ_end (exponential in the paper; linear, cosine and logarithmic for the
ablation). Training is cut into K + 1 equal intervals, as in the reference code, so the paper's
``σ_k = σ_start (σ_end/σ_start)^((k-1)/(K-1))`` reaches σ_end in the last one.

How it is applied here (deviations from the reference code, which are deliberate):

* The noise is never written into the weights. Each targeted norm's forward computes
  ``(w + Z) · x̂`` in fp32 and rounds once to the activation dtype, so σ down to 5e-4 still acts
  (added to a bf16 weight near 1 it would round away: the bf16 spacing there is 2⁻⁷; in a bf16
  activation it shows as a shifted rounding, unbiased in expectation), noise cannot accumulate, and
  trained norms (``train_norms``) get noise on their current value. With no noise drawn the
  original forward runs: methods without AQN are bit-unaffected.
* ``Z`` is drawn from a seeded generator per rollout step; the same ``Z`` can stay active for the
  training forward (``apply_to="rollout+train"``) or be removed (``"rollout"``, as in the paper).
* The norms are found in our own transformers model (the reference code walks vLLM's model with
  transformers' class names, so its noise most likely never fires).
"""
from __future__ import annotations

import contextlib
import math
import re
import types
from dataclasses import dataclass

import torch
from torch import nn

SCHEDULES = ("exponential", "linear", "cosine", "logarithmic")
_LAYER_NORM = re.compile(r"(^|\.)layers\.\d+\.(input_layernorm|post_attention_layernorm)(\.modules_to_save\.default)?$")
_FINAL_NORM = re.compile(r"(^|\.)model\.norm(\.modules_to_save\.default)?$")


@dataclass(frozen=True)
class AQNSettings:
    """σ_start/σ_end: paper Table 4 1e-2 -> 5e-4; stages K = 10; schedule: exponential (paper). ``enabled``:
    ``auto`` (the method's: on for ``qerl`` only), ``true`` (also on another method's base: the bf16 LoRA + AQN
    ablation, is it the noise or the quantization that helps?) or ``false``."""

    enabled: str | bool = "auto"
    sigma_start: float = 1e-2
    sigma_end: float = 5e-4
    stages: int = 10
    schedule: str = "exponential"
    apply_to: str = "rollout"  # "rollout" (paper) | "rollout+train"
    final_norm: bool = False

    def __post_init__(self):
        if str(self.enabled).lower() not in ("auto", "true", "false"):
            raise ValueError(f"aqn.enabled must be auto, true or false, got {self.enabled!r}")
        if self.stages < 1:
            raise ValueError(f"aqn.stages (K) must be >= 1, got {self.stages}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"aqn.schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if not (self.sigma_start > 0 and self.sigma_end > 0):
            raise ValueError(f"aqn sigmas must be > 0, got start={self.sigma_start}, end={self.sigma_end}")
        if self.sigma_end > self.sigma_start:
            raise ValueError(f"aqn.sigma_end ({self.sigma_end}) must be <= aqn.sigma_start ({self.sigma_start})")
        if self.apply_to not in ("rollout", "rollout+train"):
            raise ValueError(f"aqn.apply_to must be 'rollout' or 'rollout+train', got {self.apply_to!r}")


def enabled(settings: AQNSettings, method_aqn: bool) -> bool:
    """Whether a run adds AQN: ``settings.enabled`` when set, else the method's own choice ``method_aqn``."""
    from qerl.methods import resolve_aqn

    return resolve_aqn(settings.enabled, method_aqn)


def stage_of(step: int, total_steps: int, stages: int) -> int:
    """Stage k in 0..K of optimizer step ``step`` (0-based): training is cut into K + 1 equal
    intervals, the first noise-free and one per noise level (as the QeRL reference code does:
    ``interval = floor(step / (total / (K + 1)))``)."""
    if not 0 <= step < total_steps:
        raise ValueError(f"step {step} outside [0, {total_steps})")
    return min(stages, step * (stages + 1) // total_steps)


def sigma_at(step: int, total_steps: int, s: AQNSettings) -> float:
    """σ for ``step``: 0 in stage 0, then for stage k = 1..K with ``t = (k-1)/(K-1)`` (0 if K = 1):

    exponential ``σ_s (σ_e/σ_s)^t`` (paper, reaching σ_e in the last stage); linear
    ``σ_s + (σ_e-σ_s) t``; cosine ``σ_e + (σ_s-σ_e)(1+cos πt)/2``; logarithmic
    ``σ_s - (σ_s-σ_e) ln(1+(e-1)t)``.
    """
    k = stage_of(step, total_steps, s.stages)
    if k == 0:
        return 0.0
    t = (k - 1) / (s.stages - 1) if s.stages > 1 else 0.0
    a, b = s.sigma_start, s.sigma_end
    if s.schedule == "exponential":
        return a * (b / a) ** t
    if s.schedule == "linear":
        return a + (b - a) * t
    if s.schedule == "cosine":
        return b + (a - b) * (1 + math.cos(math.pi * t)) / 2
    return a - (a - b) * math.log(1 + (math.e - 1) * t)


def target_norms(model: nn.Module, final_norm: bool = False) -> dict[str, nn.Module]:
    """The RMSNorm modules AQN perturbs, by qualified name (PEFT-wrapped ones resolved to the
    active copy)."""
    found = {}
    for name, mod in model.named_modules():
        if not hasattr(mod, "weight") or not type(mod).__name__.endswith("RMSNorm"):
            continue
        if name.endswith("original_module") or ".original_module." in name:
            continue
        if _LAYER_NORM.search(name) or (final_norm and _FINAL_NORM.search(name)):
            found[name] = mod
    if not found:
        raise ValueError("AQN found no input_layernorm/post_attention_layernorm RMSNorm modules in the model")
    return found


def active_noise(norm: nn.Module) -> torch.Tensor | None:
    """The AQN noise ``Z`` drawn on ``norm`` now (fp32 ``[hidden]`` on its device), or None: no draw active, or a
    norm AQN does not perturb. The declared way for other code to see the noise (the rollout engine copies it into
    the fixed buffers its CUDA graphs read, :meth:`qerl.rollout.engine.runner.RolloutEngine._sync`)."""
    return getattr(norm, "_aqn_noise", None)


def _noisy_rmsnorm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    noise = active_noise(self)
    if noise is None:
        return self._aqn_original_forward(hidden_states)
    input_dtype = hidden_states.dtype
    h = hidden_states.to(torch.float32)
    eps = getattr(self, "variance_epsilon", getattr(self, "eps", 1e-6))
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    # (w + Z) · x̂ entirely in fp32 and rounded once. Rounding x̂ to bf16 first (as the stock
    # forward does) would put it on the bf16 grid, where a relative perturbation below half an ulp
    # (2^-9, i.e. σ below ~2e-3) could never move it; from fp32 it moves the rounding instead, so
    # the noise survives in expectation.
    return ((self.weight.float() + noise) * h).to(input_dtype)


class AQN:
    """Attach AQN to a model; ``with aqn.noise(sigma, seed): ...`` activates a fresh draw."""

    def __init__(self, model: nn.Module, settings: AQNSettings):
        self.settings = settings
        self.norms = target_norms(model, settings.final_norm)
        for mod in self.norms.values():
            if not hasattr(mod, "_aqn_original_forward"):
                mod._aqn_original_forward = mod.forward
                mod.forward = types.MethodType(_noisy_rmsnorm_forward, mod)
            mod._aqn_noise = None

    def draw(self, sigma: float, seed: int) -> None:
        """Draw a fresh ``Z ~ N(0, σ²I)`` per norm from a generator seeded with ``seed`` (σ = 0: off)."""
        if sigma == 0:
            self.clear()
            return
        gen = torch.Generator(device="cpu").manual_seed(seed)
        for mod in self.norms.values():
            z = torch.randn(mod.weight.shape, generator=gen, dtype=torch.float32) * sigma
            mod._aqn_noise = z.to(mod.weight.device)

    def clear(self) -> None:
        for mod in self.norms.values():
            mod._aqn_noise = None

    @contextlib.contextmanager
    def noise(self, sigma: float, seed: int):
        self.draw(sigma, seed)
        try:
            yield
        finally:
            self.clear()

    def current(self) -> dict[str, torch.Tensor | None]:
        return {n: active_noise(m) for n, m in self.norms.items()}
