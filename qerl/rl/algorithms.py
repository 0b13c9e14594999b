"""The RL algorithms as presets over a few orthogonal axes: one table, the only place that names an algorithm.

An algorithm is the clipped policy-gradient loss of :mod:`qerl.rl.losses` with

* ``aggregation`` — how per-token losses become the batch loss:
  ``sequence-mean`` (each sequence's tokens averaged, then the sequences: GRPO, TRL ``loss_type="grpo"``),
  ``token-mean`` (all completion tokens of the batch averaged: DAPO, TRL ``"dapo"``), or
  ``constant`` (summed over tokens, divided by ``n_sequences · max_len``: Dr. GRPO, TRL ``"dr_grpo"``);
* ``ratio_level`` — the importance ratio ``ρ`` the clip acts on: ``token`` (``ρ_it = π(y_it) / π_old(y_it)``) or
  ``sequence`` (GSPO, Zheng et al. 2025, eq. 7: ``s_i = (π(y_i) / π_old(y_i))^(1 / |y_i|)``, the geometric mean of the
  token ratios, one per completion; TRL ``importance_sampling_level="sequence"``);
* ``clip_low`` / ``clip_high`` — ε of ``clip(ρ, 1 − ε_low, 1 + ε_high)`` (GSPO's sequence ratios stay close to 1,
  so its ε are ~1000x smaller);
* ``adv_scale`` — group advantages divided by the group's std (``std``) or not (``none``: Dr. GRPO);
* ``dynamic_sampling`` / ``overlong_mask`` — DAPO's refill of all-equal groups and masking of cut completions.

The KL term (``kl_coef``) is an axis of every preset (0 by default, as the paper's Table 4). A new algorithm is one
row of :data:`PRESETS` (plus its tests); its settings can also be set one by one in a training config
(``algorithm.aggregation``, ``algorithm.ratio_level``, ...). Light: no torch.
"""
from __future__ import annotations

from dataclasses import dataclass

AGGREGATIONS = ("sequence-mean", "token-mean", "constant")
RATIO_LEVELS = ("token", "sequence")
ADV_SCALES = ("std", "none")


def check_axes(aggregation: str, ratio_level: str, adv_scale: str = "std", where: str = "algorithm") -> None:
    """ValueError naming the axis whose value is not one of its choices."""
    for axis, value, choices in (("aggregation", aggregation, AGGREGATIONS), ("ratio_level", ratio_level, RATIO_LEVELS),
                                 ("adv_scale", adv_scale, ADV_SCALES)):
        if value not in choices:
            raise ValueError(f"{where}.{axis}: {value!r} is not one of {choices}")


@dataclass(frozen=True)
class Preset:
    """One algorithm's defaults (see the module docstring for each axis)."""

    aggregation: str
    ratio_level: str = "token"
    clip_low: float = 0.2
    clip_high: float = 0.2
    adv_scale: str = "std"
    dynamic_sampling: bool = False
    overlong_mask: bool = False
    doc: str = ""

    def __post_init__(self):
        check_axes(self.aggregation, self.ratio_level, self.adv_scale, where="Preset")


#: name -> defaults. Sources: GRPO (Shao et al. 2024; the paper §2), DAPO (Yu et al. 2025: clip-higher 0.28,
#: dynamic sampling, token-level loss, overlong masking), Dr. GRPO (Liu et al. 2025: no std scaling, a constant
#: normaliser), GSPO (Zheng et al. 2025: sequence-level ratio, ε 3e-4 / 4e-4, the GSPO paper's and TRL's values).
PRESETS: dict[str, Preset] = {
    "grpo": Preset("sequence-mean", doc="GRPO: token ratios, each sequence's mean, ε 0.2"),
    "dapo": Preset("token-mean", clip_high=0.28, dynamic_sampling=True, overlong_mask=True,
                   doc="DAPO: token-level mean, clip-higher ε_high 0.28, dynamic sampling, overlong masking"),
    "dr_grpo": Preset("constant", adv_scale="none", doc="Dr. GRPO: constant normaliser n · max_len, no std scaling"),
    "gspo": Preset("sequence-mean", ratio_level="sequence", clip_low=3e-4, clip_high=4e-4,
                   doc="GSPO: sequence-level (length-normalised) importance ratio, ε 3e-4 / 4e-4"),
}
NAMES = tuple(PRESETS)


def preset(name: str) -> Preset:
    """The preset called ``name``; ValueError listing the known ones."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"algorithm {name!r} is not one of {NAMES}") from None
