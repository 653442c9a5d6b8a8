"""Welch's two-sample comparison of per-seed results, and the ablate report's comparison of
every mode with the best other mode at the same η.

For two groups of independent runs (seeds) with means m₁, m₂, sample variances s₁², s₂² and
sizes n₁, n₂:

    Δ  = m₁ − m₂,          SE = sqrt(s₁²/n₁ + s₂²/n₂)
    ν  = SE⁴ / ((s₁²/n₁)²/(n₁ − 1) + (s₂²/n₂)²/(n₂ − 1))       (Welch–Satterthwaite)
    CI = Δ ± t_{(1+c)/2, ν} · SE

The Student-t quantile is computed here (no SciPy): the t CDF is a regularized incomplete beta
function, evaluated by its continued fraction, and the quantile is found by bisection.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from sdp_cli.ablate.records import GroupRow


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


def student_t_cdf(t: float, df: float) -> float:
    """P(T ≤ t) for Student's t with ``df`` > 0 degrees of freedom."""
    tail = 0.5 * _incomplete_beta(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t > 0 else tail


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


@dataclass(frozen=True)
class Comparison:
    """Welch comparison of group 1 against group 2: Δ = mean₁ − mean₂ with its standard error,
    degrees of freedom and confidence interval (None where fewer than two runs per group)."""

    difference: float
    standard_error: float | None
    dof: float | None
    low: float | None
    high: float | None


def _mean_var(values: Sequence[float]) -> tuple[float, float, int]:
    n = len(values)
    mean = sum(values) / n
    var = sum((v - mean) ** 2 for v in values) / (n - 1) if n > 1 else math.nan
    return mean, var, n


def welch(first: Sequence[float], second: Sequence[float], confidence: float = 0.95) -> Comparison:
    """Welch's comparison of the mean of ``first`` against the mean of ``second``."""
    if not first or not second:
        raise ValueError("welch needs at least one value in each group")
    m1, v1, n1 = _mean_var(first)
    m2, v2, n2 = _mean_var(second)
    return welch_from_moments(m1, math.sqrt(v1), n1, m2, math.sqrt(v2), n2, confidence)


def welch_from_moments(
    mean1: float,
    std1: float,
    n1: int,
    mean2: float,
    std2: float,
    n2: int,
    confidence: float = 0.95,
) -> Comparison:
    """Welch's comparison from each group's mean, sample std (n − 1) and size."""
    diff = mean1 - mean2
    if n1 < 2 or n2 < 2:
        return Comparison(diff, None, None, None, None)
    a, b = std1 * std1 / n1, std2 * std2 / n2
    se = math.sqrt(a + b)
    if se == 0.0:
        return Comparison(diff, 0.0, math.inf, diff, diff)
    dof = (a + b) ** 2 / (a * a / (n1 - 1) + b * b / (n2 - 1))
    half = student_t_quantile(0.5 + confidence / 2.0, dof) * se
    return Comparison(diff, se, dof, diff - half, diff + half)


@dataclass(frozen=True)
class ModeComparison:
    """One mode at one η (and one set of other swept values) against the best other mode there:
    the mode with the highest mean of the metric among the others (chosen on the same data, so
    the interval is slightly optimistic for that mode — the report says so)."""

    max_head_offpolicyness: int
    extra: tuple[str, ...]
    mode: str
    mean: float
    n: int
    best_other: str | None
    comparison: Comparison | None


def compare_modes(
    groups: Sequence[GroupRow],
    key: str = "reward_last",
    confidence: float = 0.95,
    against: Sequence[str] = (),
) -> list[ModeComparison]:
    """For every group with a value of ``key``: its difference to the best other mode at the
    same η and other swept values, with Welch's ``confidence`` interval over the seeds.

    ``against`` narrows "other mode" to these modes (e.g. the baselines a new weight must match:
    ``("decoupled", "segment_wise")``); a mode is never compared with itself."""
    cells: dict[tuple[int, tuple[str, ...]], list[GroupRow]] = {}
    for g in groups:
        if g.mean.get(key) is not None:
            cells.setdefault((g.max_head_offpolicyness, g.extra), []).append(g)
    out = []
    for (bound, extra), members in sorted(cells.items()):
        for g in sorted(members, key=lambda r: r.mode):
            others = [o for o in members if o is not g and (not against or o.mode in against)]
            best = max(others, key=lambda o: o.mean[key]) if others else None
            comparison = None
            if best is not None:
                comparison = welch_from_moments(
                    g.mean[key],
                    g.std[key] or 0.0,
                    g.count[key],
                    best.mean[key],
                    best.std[key] or 0.0,
                    best.count[key],
                    confidence,
                )
            out.append(
                ModeComparison(
                    bound, extra, g.mode, g.mean[key], g.count[key], best.mode if best else None, comparison
                )
            )
    return out
