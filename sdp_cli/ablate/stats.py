"""The ablate report's statistics: paired differences by seed (docs/ablate.md "Statistics").

Two cells of a sweep pair by seed: one seed gives both runs the same warm start, prompts and
evaluation set, so the per-seed difference d_s = y_treatment,s − y_baseline,s removes what the
two runs share. For n ≥ 2 pairs with mean d̄ and sample std s_d (n − 1 in the denominator):

    SE = s_d / √n,   ν = n − 1,   t = d̄ / SE
    p  = P(|T_ν| ≥ |t|)                                    the paired t test, two-sided
    CI = d̄ ± t_{1−α/2, ν} · SE                             the paired t interval, level 1 − α
    bootstrap CI: the α/2 and 1 − α/2 percentiles of the mean of n differences drawn with
                  replacement, 10 000 resamples from a fixed RNG seed
    TOST at margin δ: p₁ = P(T_ν ≥ (d̄ + δ)/SE), p₂ = P(T_ν ≤ (d̄ − δ)/SE), p_TOST = max(p₁, p₂);
                  p_TOST < α exactly when the 1 − 2α interval lies inside (−δ, δ)
    MDE = (t_{1−α/2, ν} + t_{power, ν}) · SE               the smallest |Δ| the design detects
                                                           with that power at level α
    Holm: with p-values sorted p_(1) ≤ … ≤ p_(m), p̃_(i) = max_{j ≤ i} min(1, (m − j + 1) p_(j))

Without spread (s_d = 0, e.g. bit-identical runs) t is 0/0 or ±∞: then p = 1 when d̄ = 0 and 0
otherwise, both intervals are the point d̄, p_TOST is 0 when |d̄| < δ and 1 otherwise, and the
MDE is 0.

Student's t distribution is computed here (no SciPy at run time): its CDF is a regularized
incomplete beta function, evaluated by its continued fraction; quantiles are found by bisection.
Welch's unpaired interval (``welch``) stays for scripts/drift_goal.py.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

#: resamples and RNG seed of the bootstrap interval: fixed, so a report is reproducible
BOOTSTRAP_RESAMPLES = 10_000
BOOTSTRAP_SEED = 0


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the incomplete beta function (modified Lentz)."""
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 500):
        for numerator in (
            m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1)),
        ):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return h


def _incomplete_beta(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = (
        math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    )
    front = math.exp(log_front)
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def _two_sided(t: float, df: float) -> float:
    """P(|T| ≥ |t|) = I_{ν/(ν+t²)}(ν/2, 1/2) = 1 − I_{t²/(ν+t²)}(1/2, ν/2): the second form for
    |t| < 1 (a result above 0.3, where ν/(ν+t²) may round to 1), the first for the small tails."""
    if math.isinf(t):
        return 0.0
    if t * t < 1.0:
        return 1.0 - _incomplete_beta(0.5, df / 2.0, t * t / (df + t * t))
    return _incomplete_beta(df / 2.0, 0.5, df / (df + t * t))


def student_t_sf(t: float, df: float) -> float:
    """P(T > t) for Student's t with ``df`` > 0 degrees of freedom (accurate in both tails)."""
    tail = 0.5 * _two_sided(t, df)
    return tail if t > 0 else 1.0 - tail


def student_t_cdf(t: float, df: float) -> float:
    """P(T ≤ t) for Student's t with ``df`` > 0 degrees of freedom."""
    return student_t_sf(-t, df)


def student_t_quantile(p: float, df: float) -> float:
    """The t with P(T ≤ t) = p, for 0 < p < 1 (bisection on the CDF to 1e-12)."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"p must be in (0, 1), got {p}")
    if p == 0.5:
        return 0.0
    if p < 0.5:
        return -student_t_quantile(1.0 - p, df)
    low, high = 0.0, 1.0
    while student_t_cdf(high, df) < p:
        high *= 2.0
    for _ in range(200):
        mid = 0.5 * (low + high)
        if student_t_cdf(mid, df) < p:
            low = mid
        else:
            high = mid
        if high - low < 1e-12:
            break
    return 0.5 * (low + high)


# ------------------------------------------------------------------ paired
@dataclass(frozen=True)
class PairedT:
    """The paired t test of n ≥ 2 differences: mean d̄, sample std s_d, SE, ν = n − 1, t, the
    two-sided p-value and the (1 − α) interval (module docstring)."""

    n: int
    mean: float
    sd: float
    se: float
    dof: int
    t: float
    p: float
    low: float
    high: float


def paired_t(differences: Sequence[float], alpha: float) -> PairedT:
    """The paired t test and (1 − α) interval of the per-seed differences (n ≥ 2)."""
    d = np.asarray(differences, dtype=np.float64)
    n = len(d)
    assert n >= 2, f"a paired t test needs two differences, got {n}"
    dof = n - 1
    # equal differences are checked exactly: their computed mean and std may round off zero
    constant = bool(np.all(d == d[0]))
    mean, sd = (float(d[0]), 0.0) if constant else (float(d.mean()), float(d.std(ddof=1)))
    se = sd / math.sqrt(n)
    if se == 0.0:  # no spread (or one that underflows)
        t = 0.0 if mean == 0.0 else math.copysign(math.inf, mean)
        return PairedT(n, mean, 0.0, 0.0, dof, t, 1.0 if mean == 0.0 else 0.0, mean, mean)
    t = mean / se
    half = student_t_quantile(1.0 - alpha / 2.0, dof) * se
    p = _two_sided(t, dof)  # not 2·(1 − CDF): that cancels for small p
    return PairedT(n, mean, sd, se, dof, t, p, mean - half, mean + half)


def bootstrap_interval(
    differences: Sequence[float],
    confidence: float,
    resamples: int = BOOTSTRAP_RESAMPLES,
    seed: int = BOOTSTRAP_SEED,
) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean: the (1 − c)/2 and (1 + c)/2 quantiles (numpy's
    linear interpolation) of the means of ``resamples`` resamples of n differences drawn with
    replacement by a generator seeded with ``seed`` (each call starts from that seed)."""
    d = np.asarray(differences, dtype=np.float64)
    assert len(d) >= 1, "a bootstrap interval needs at least one difference"
    rng = np.random.default_rng(seed)
    means = d[rng.integers(0, len(d), size=(resamples, len(d)))].mean(axis=1)
    low, high = np.quantile(means, [(1.0 - confidence) / 2.0, (1.0 + confidence) / 2.0])
    return float(low), float(high)


def tost_p(test: PairedT, margin: float) -> float:
    """p-value of the two one-sided tests of equivalence within ±``margin``: the larger of the
    p-values of H₀: Δ ≤ −δ and H₀: Δ ≥ δ (module docstring)."""
    assert margin > 0, f"an equivalence margin must be positive, got {margin}"
    if test.se == 0.0:
        return 0.0 if abs(test.mean) < margin else 1.0
    above_lower = student_t_sf((test.mean + margin) / test.se, test.dof)
    below_upper = student_t_cdf((test.mean - margin) / test.se, test.dof)
    return max(above_lower, below_upper)


def minimum_detectable_effect(sd: float, n: int, alpha: float, power: float) -> float:
    """MDE = (t_{1−α/2, n−1} + t_{power, n−1}) · s_d / √n of a paired design with n ≥ 2 pairs:
    the smallest true |Δ| that a two-sided paired t test at level α detects with probability
    ``power``, were the true std of the differences s_d."""
    assert n >= 2, f"a minimum detectable effect needs two pairs, got {n}"
    dof = n - 1
    return (student_t_quantile(1.0 - alpha / 2.0, dof) + student_t_quantile(power, dof)) * sd / math.sqrt(n)


def holm(p_values: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values, in the input's order: reject H_(i) at family-wise
    level α exactly when its adjusted p-value is below α."""
    m = len(p_values)
    order = sorted(range(m), key=lambda i: p_values[i])
    adjusted = [0.0] * m
    running = 0.0
    for rank, index in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p_values[index]))
        adjusted[index] = running
    return adjusted


# ---------------------------------------------------------------- unpaired
@dataclass(frozen=True)
class Comparison:
    """Welch comparison of group 1 against group 2: Δ = mean₁ − mean₂ with its standard error,
    degrees of freedom and confidence interval (None where fewer than two runs per group)."""

    difference: float
    standard_error: float | None
    dof: float | None
    low: float | None
    high: float | None


def welch(first: Sequence[float], second: Sequence[float], confidence: float = 0.95) -> Comparison:
    """Welch's unpaired comparison of the mean of ``first`` with the mean of ``second``:
    SE = √(s₁²/n₁ + s₂²/n₂), ν by Welch–Satterthwaite, CI = Δ ± t_{(1+c)/2, ν} · SE."""
    if not first or not second:
        raise ValueError("welch needs at least one value in each group")
    a, b = np.asarray(first, dtype=np.float64), np.asarray(second, dtype=np.float64)
    diff = float(a.mean() - b.mean())
    n1, n2 = len(a), len(b)
    if n1 < 2 or n2 < 2:
        return Comparison(diff, None, None, None, None)
    v1, v2 = float(a.var(ddof=1)) / n1, float(b.var(ddof=1)) / n2
    se = math.sqrt(v1 + v2)
    if se == 0.0:
        return Comparison(diff, 0.0, math.inf, diff, diff)
    dof = (v1 + v2) ** 2 / (v1 * v1 / (n1 - 1) + v2 * v2 / (n2 - 1))
    half = student_t_quantile(0.5 + confidence / 2.0, dof) * se
    return Comparison(diff, se, dof, diff - half, diff + half)
