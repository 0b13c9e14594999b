"""The intervals ``qerl claims`` judges by, each at the level its data are independent at.

* accuracy (pass@1): ``scores[seed][problem]``; seeds and problems resampled together (:func:`boot_mean`,
  :func:`boot_diff`, paired by problem);
* curves (reward growth, early entropy): one number a run (a run's steps stay together: its window mean);
  each arm's seeds resampled on their own (:func:`boot_seeds`);
* step time: one median a timed run; the ratio of the geometric means with a Welch t-interval on the logs
  (:func:`welch_log_ratio`): few runs, so the interval carries the t distribution's wider tails.

Every bootstrap has a fixed seed and :data:`BOOT` resamples (a rerun writes the same numbers). Pure Python, no
SciPy: :func:`t_quantile` inverts the Student t CDF (the regularized incomplete beta by its continued fraction).
"""
from __future__ import annotations

import math
import random

BOOT = 2000


def pct(xs: list[float], q: float) -> float:
    """The ``q`` quantile of ``xs`` (linear interpolation between order statistics)."""
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def boot_mean(scores: list[list[float]], seed: int = 0) -> tuple[float, float, float]:
    """Mean of ``scores[seed][problem]`` and its 95% percentile interval, resampling seeds and problems."""
    rng = random.Random(seed)
    n_s, n_p = len(scores), len(scores[0])
    mean = sum(map(sum, scores)) / (n_s * n_p)
    stats = []
    for _ in range(BOOT):
        ss = [rng.randrange(n_s) for _ in range(n_s)]
        pp = [rng.randrange(n_p) for _ in range(n_p)]
        stats.append(sum(scores[s][p] for s in ss for p in pp) / (n_s * n_p))
    return mean, pct(stats, 0.025), pct(stats, 0.975)


def boot_diff(a: list[list[float]], b: list[list[float]], seed: int = 0) -> tuple[float, float, float]:
    """Mean of ``a`` minus mean of ``b`` (same problems; seeds paired by position) and its 95% interval."""
    rng = random.Random(seed)
    n_s, n_p = min(len(a), len(b)), len(a[0])
    if len(b[0]) != n_p:
        raise ValueError(f"methods were evaluated on different problem counts ({n_p} vs {len(b[0])})")

    def diff(ss, pp):
        return sum(a[s][p] - b[s][p] for s in ss for p in pp) / (len(ss) * len(pp))

    stats = []
    for _ in range(BOOT):
        stats.append(diff([rng.randrange(n_s) for _ in range(n_s)], [rng.randrange(n_p) for _ in range(n_p)]))
    return diff(range(n_s), range(n_p)), pct(stats, 0.025), pct(stats, 0.975)


def boot_seeds(a: list[float], b: list[float], seed: int = 0) -> tuple[float, float, float]:
    """mean(``a``) - mean(``b``), one value a run (seed), and its 95% percentile interval: each arm's runs resampled
    with replacement on their own (runs of two arms are separate trainings). Needs >= 2 runs an arm."""
    if len(a) < 2 or len(b) < 2:
        raise ValueError(f"a seed-level interval needs >= 2 runs an arm, got {len(a)} and {len(b)}")
    rng = random.Random(seed)

    def mean(xs):
        return sum(xs) / len(xs)

    stats = [mean([rng.choice(a) for _ in a]) - mean([rng.choice(b) for _ in b]) for _ in range(BOOT)]
    return mean(a) - mean(b), pct(stats, 0.025), pct(stats, 0.975)


# -- Student t --------------------------------------------------------------------------------------------------
def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the incomplete beta function (modified Lentz)."""
    tiny, qab, qap, qam = 1e-300, a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 300):
        m2 = 2 * m
        for aa in (m * (b - m) * x / ((qam + m2) * (a + m2)), -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))):
            d = 1.0 + aa * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + aa / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return h


def _betainc(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b)."""
    if x <= 0:
        return 0.0
    if x >= 1:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1) / (a + b + 2):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with ``df`` (> 0, not necessarily whole) degrees of freedom."""
    tail = 0.5 * _betainc(df / 2, 0.5, df / (df + t * t))
    return 1.0 - tail if t > 0 else tail


def t_quantile(p: float, df: float) -> float:
    """The ``p`` quantile of Student's t (bisection on :func:`t_cdf`; 1e-10 absolute)."""
    if not 0 < p < 1 or df <= 0:
        raise ValueError(f"t_quantile needs 0 < p < 1 and df > 0, got p={p}, df={df}")
    lo, hi = -1e3, 1e3
    for _ in range(200):
        mid = (lo + hi) / 2
        if t_cdf(mid, df) < p:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-10:
            break
    return (lo + hi) / 2


def welch_log_ratio(num: list[float], den: list[float]) -> tuple[float, float, float, float]:
    """The ratio of the geometric means of ``num`` and ``den`` (two independent sets of positive run times) and its
    95% interval: Welch's t-interval on ``mean(log num) - mean(log den)``, exponentiated. Returns ``(ratio, lo, hi,
    df)`` (Welch-Satterthwaite degrees of freedom). Needs >= 2 values a set."""
    if len(num) < 2 or len(den) < 2:
        raise ValueError(f"a t-interval needs >= 2 runs a set, got {len(num)} and {len(den)}")
    if any(not (x > 0 and math.isfinite(x)) for x in (*num, *den)):
        raise ValueError("run times must be finite and > 0")
    la, lb = [math.log(x) for x in num], [math.log(x) for x in den]
    ma, mb = sum(la) / len(la), sum(lb) / len(lb)
    va = sum((x - ma) ** 2 for x in la) / (len(la) - 1) / len(la)
    vb = sum((x - mb) ** 2 for x in lb) / (len(lb) - 1) / len(lb)
    se = math.sqrt(va + vb)
    if se == 0:
        r = math.exp(ma - mb)
        return r, r, r, float("inf")
    df = (va + vb) ** 2 / ((va ** 2 / (len(la) - 1) if va else 0) + (vb ** 2 / (len(lb) - 1) if vb else 0))
    q = t_quantile(0.975, df)
    d = ma - mb
    return math.exp(d), math.exp(d - q * se), math.exp(d + q * se), df
