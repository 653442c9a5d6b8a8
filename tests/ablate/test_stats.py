"""The ablate report's statistics (sdp_cli/ablate/stats.py) against SciPy and hand values.

Reference quantiles are the usual table values t_{0.975, ν}; the paired test, its interval and
the t tails are checked against scipy.stats; Holm, TOST, the MDE and the bootstrap are worked out
by hand in the comments, with properties where a hand value cannot be exact.
"""

import math

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from scipy import stats as sps

from sdp_cli.ablate.stats import (
    bootstrap_interval,
    holm,
    minimum_detectable_effect,
    paired_t,
    student_t_cdf,
    student_t_quantile,
    student_t_sf,
    tost_p,
    welch,
)


@pytest.mark.parametrize(
    ("dof", "quantile"),
    [(1, 12.7062), (2, 4.3027), (4, 2.7764), (10, 2.2281), (30, 2.0423), (1e7, 1.9600)],
)
def test_t_quantile_matches_the_table(dof, quantile):
    assert student_t_quantile(0.975, dof) == pytest.approx(quantile, abs=1e-4)


def test_t_distribution_is_symmetric_and_cauchy_at_one_degree():
    # ν = 1 is the Cauchy distribution: P(T ≤ 1) = 1/2 + atan(1)/π = 3/4
    assert student_t_cdf(1.0, 1) == pytest.approx(0.75, abs=1e-12)
    assert student_t_cdf(0.0, 7) == 0.5
    assert student_t_quantile(0.025, 4) == pytest.approx(-student_t_quantile(0.975, 4))


@pytest.mark.parametrize("p", [0.0, 1.0, -0.1, 1.5])
def test_a_quantile_outside_the_open_unit_interval_is_refused(p):
    # ±∞ is not a number a search can return (at p = 1 it would double its bound for ever)
    with pytest.raises(ValueError, match=r"p must be in \(0, 1\)"):
        student_t_quantile(p, 4)


@given(st.floats(0.01, 0.99), st.floats(1.0, 200.0))
def test_quantile_inverts_the_cdf(p, dof):
    assert student_t_cdf(student_t_quantile(p, dof), dof) == pytest.approx(p, abs=1e-9)


@given(st.floats(-60.0, 60.0), st.integers(1, 60))
def test_t_tails_match_scipy_far_out(t, dof):
    # relative accuracy in the tail: Holm multiplies p-values of 1e-6 by the family size
    assert student_t_sf(t, dof) == pytest.approx(float(sps.t.sf(t, dof)), rel=1e-8, abs=1e-300)
    assert student_t_cdf(t, dof) == pytest.approx(float(sps.t.cdf(t, dof)), rel=1e-8, abs=1e-300)


# ------------------------------------------------------------------- paired
def test_paired_t_by_hand():
    # treatment (3, 5, 4, 6) − baseline (1, 2, 3, 3): d = (2, 3, 1, 3), mean 2.25; deviations
    # −0.25, 0.75, −1.25, 0.75 → Σ² = 2.75, s² = 2.75/3, SE = √(2.75/12) = 0.47871, t = 4.7001, ν = 3
    test = paired_t([2, 3, 1, 3], alpha=0.05)
    assert (test.n, test.dof, test.mean) == (4, 3, 2.25)
    assert test.se == pytest.approx(math.sqrt(2.75 / 12))
    assert test.t == pytest.approx(4.700097, abs=1e-6)
    # t_{0.975, 3} = 3.18245: the interval is 2.25 ± 3.18245 · 0.47871 = [0.72652, 3.77348]
    assert (test.low, test.high) == (pytest.approx(0.726520, abs=1e-6), pytest.approx(3.773480, abs=1e-6))
    # scipy.stats.ttest_rel([3, 5, 4, 6], [1, 2, 3, 3]).pvalue
    assert test.p == pytest.approx(0.0182198547, rel=1e-8)


@settings(max_examples=200)
@given(
    st.lists(st.tuples(st.floats(-1.0, 1.0), st.floats(-1.0, 1.0)), min_size=2, max_size=30),
    st.sampled_from([0.01, 0.05, 0.1]),
)
def test_paired_t_matches_scipy(pairs, alpha):
    treatment, baseline = (np.array(x) for x in zip(*pairs))
    d = treatment - baseline
    assume(np.std(d) > 1e-6)
    ours = paired_t(list(d), alpha)
    theirs = sps.ttest_rel(treatment, baseline)
    interval = theirs.confidence_interval(1 - alpha)
    assert ours.t == pytest.approx(float(theirs.statistic), rel=1e-9)
    assert ours.p == pytest.approx(float(theirs.pvalue), rel=1e-7, abs=1e-12)
    assert (ours.low, ours.high) == (
        pytest.approx(float(interval.low), rel=1e-7, abs=1e-9),
        pytest.approx(float(interval.high), rel=1e-7, abs=1e-9),
    )


def test_without_spread_the_test_is_decided_by_the_mean():
    # bit-identical runs (the drift weight at η = 1 is decoupled's): no difference at all
    same = paired_t([0.0, 0.0, 0.0, 0.0, 0.0], alpha=0.05)
    assert (same.p, same.low, same.high, same.se) == (1.0, 0.0, 0.0, 0.0)
    assert tost_p(same, 0.02) == 0.0 and minimum_detectable_effect(same.sd, 5, 0.05, 0.8) == 0.0
    # the same nonzero difference on every seed: certain, and outside a margin smaller than it
    shift = paired_t([0.1, 0.1, 0.1], alpha=0.05)
    assert (shift.p, shift.low, shift.high, shift.t) == (0.0, 0.1, 0.1, math.inf)
    assert tost_p(shift, 0.05) == 1.0 and tost_p(shift, 0.2) == 0.0


# ---------------------------------------------------------------- TOST
def test_tost_by_hand():
    # d = (2, 3, 1, 3): mean 2.25, SE 0.47871, ν = 3 (test_paired_t_by_hand). Margin 3:
    # p₁ = P(T₃ ≥ (2.25 + 3)/SE) = P(T₃ ≥ 10.967), p₂ = P(T₃ ≤ (2.25 − 3)/SE) = P(T₃ ≤ −1.5667)
    test = paired_t([2, 3, 1, 3], alpha=0.05)
    se = math.sqrt(2.75 / 12)
    p_low, p_high = sps.t.sf(5.25 / se, 3), sps.t.cdf(-0.75 / se, 3)
    # scipy.stats.t.cdf(−1.5667, 3) = 0.107585, scipy.stats.t.sf(10.967, 3) = 0.000812
    assert p_high == pytest.approx(0.107585, abs=1e-6) and p_low == pytest.approx(0.000812, abs=1e-6)
    assert tost_p(test, 3.0) == pytest.approx(max(p_low, p_high), rel=1e-9)
    # not equivalent at α = 0.05: the 90 % interval 2.25 ± 2.35336·SE = [1.1234, 3.3766] crosses 3
    assert tost_p(test, 3.0) > 0.05
    # a margin of 3.5 holds it: p₂ = P(T₃ ≤ −1.25/SE) = P(T₃ ≤ −2.6112) = 0.039802 (scipy)
    assert tost_p(test, 3.5) == pytest.approx(0.039802, abs=1e-6)


@settings(max_examples=200)
@given(
    st.lists(st.floats(-1.0, 1.0), min_size=2, max_size=20),
    st.floats(0.001, 2.0),
    st.sampled_from([0.01, 0.05, 0.1]),
)
def test_tost_equivalence_is_the_1_minus_2_alpha_interval_inside_the_margin(d, margin, alpha):
    test = paired_t(d, alpha)
    assume(test.se > 1e-9)
    wide = paired_t(d, 2 * alpha)  # the 1 − 2α interval
    inside = -margin < wide.low and wide.high < margin
    p = tost_p(test, margin)
    assume(abs(p - alpha) > 1e-9)  # not on the boundary, where rounding decides
    assert (p < alpha) == inside


# ----------------------------------------------------------------- MDE
def test_mde_by_hand():
    # n = 5, s_d = 0.05, α = 0.05, power 0.8: t_{0.975, 4} = 2.776445, t_{0.8, 4} = 0.940965,
    # (2.776445 + 0.940965) · 0.05 / √5 = 0.083124
    assert minimum_detectable_effect(0.05, 5, 0.05, 0.8) == pytest.approx(0.0831238, abs=1e-6)
    # at Holm's first step over m = 25 contrasts, α/m = 0.002: t_{0.999, 4} = 7.173182
    assert minimum_detectable_effect(0.05, 5, 0.002, 0.8) == pytest.approx(
        (7.173182 + 0.940965) * 0.05 / math.sqrt(5), abs=1e-5
    )


@pytest.mark.parametrize("n", [5, 10, 30])
def test_a_true_effect_of_one_mde_is_found_with_about_the_stated_power(n):
    # the exact power of the two-sided paired t test at Δ = MDE (noncentral t, δ/SE = t₁ + t₂);
    # the MDE formula is the usual approximation, within 0.01 of 0.8 from n = 5 (0.791) on
    mde = minimum_detectable_effect(1.0, n, 0.05, 0.8)
    critical = sps.t.ppf(0.975, n - 1)
    noncentrality = mde / (1.0 / math.sqrt(n))
    power = sps.nct.sf(critical, n - 1, noncentrality) + sps.nct.cdf(-critical, n - 1, noncentrality)
    assert power == pytest.approx(0.8, abs=0.01)


# ------------------------------------------------------------------ Holm
def test_holm_by_hand():
    # p = (0.01, 0.04, 0.03, 0.005), m = 4, sorted: 0.005, 0.01, 0.03, 0.04
    # step 1: 4 · 0.005 = 0.02; step 2: 3 · 0.01 = 0.03; step 3: 2 · 0.03 = 0.06;
    # step 4: 1 · 0.04 = 0.04, raised to the running maximum 0.06 (step-down is monotone)
    assert holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    # capped at 1; a family of one is its own p-value; an empty family is empty
    assert holm([0.5, 0.6]) == [1.0, 1.0]
    assert holm([0.2]) == [0.2]
    assert holm([]) == []


def test_holm_on_the_first_sweeps_numbers():
    # issue 22: the smallest of 36 p-values, 0.0067, meets Holm's first threshold 0.05/36 = 0.0014
    # only if 36 · 0.0067 = 0.24 < 0.05: it does not
    family = [0.0067] + [0.5] * 35
    assert holm(family)[0] == pytest.approx(36 * 0.0067)


@given(st.lists(st.floats(0.0, 1.0), min_size=1, max_size=40))
def test_holm_is_between_the_raw_and_the_bonferroni_p_and_keeps_the_order(p):
    adjusted = holm(p)
    m = len(p)
    for raw, adj in zip(p, adjusted, strict=True):
        assert raw - 1e-15 <= adj <= min(1.0, m * raw) + 1e-15
    order = sorted(range(m), key=lambda i: p[i])
    assert all(adjusted[a] <= adjusted[b] for a, b in zip(order, order[1:]))


# ------------------------------------------------------------- bootstrap
def test_bootstrap_by_hand_two_pairs():
    # d = (0, 1): a resample's mean is 0 (p = 1/4), 0.5 (1/2) or 1 (1/4), so over 10 000
    # resamples the 2.5 % and 97.5 % quantiles are 0 and 1
    assert bootstrap_interval([0.0, 1.0], 0.95) == (0.0, 1.0)
    # at 40 %: the 30 % and 70 % quantiles both fall among the means 0.5
    assert bootstrap_interval([0.0, 1.0], 0.4) == (0.5, 0.5)


def test_bootstrap_is_reproducible_and_shifts_with_the_data():
    d = [0.03, -0.01, 0.05, 0.02, 0.00]
    first = bootstrap_interval(d, 0.95)
    assert bootstrap_interval(d, 0.95) == first  # fixed seed: the report reproduces itself
    shifted = bootstrap_interval([x + 0.25 for x in d], 0.95)
    assert shifted == (pytest.approx(first[0] + 0.25), pytest.approx(first[1] + 0.25))


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(-1.0, 1.0), min_size=2, max_size=20))
def test_bootstrap_interval_holds_the_mean(d):
    low, high = bootstrap_interval(d, 0.95)
    assert low - 1e-12 <= float(np.mean(d)) <= high + 1e-12


def test_bootstrap_interval_shrinks_like_one_over_root_n():
    # the same empirical distribution with 4× the pairs: the mean's spread halves
    d = [0.03, -0.01, 0.05, 0.02, 0.00, -0.02, 0.04, 0.01]
    low, high = bootstrap_interval(d, 0.95)
    low4, high4 = bootstrap_interval(d * 4, 0.95)
    assert (high4 - low4) / (high - low) == pytest.approx(0.5, abs=0.06)


def test_bootstrap_agrees_with_scipys_percentile_bootstrap():
    d = np.array([0.031, -0.012, 0.054, 0.020, 0.003, -0.025, 0.041])
    ours = bootstrap_interval(list(d), 0.95)
    theirs = sps.bootstrap((d,), np.mean, confidence_level=0.95, method="percentile", n_resamples=100_000,
                           random_state=np.random.default_rng(1)).confidence_interval
    # two Monte-Carlo estimates of the same quantiles (ours: 10 000 resamples)
    assert ours == (pytest.approx(theirs.low, abs=2e-3), pytest.approx(theirs.high, abs=2e-3))


# ---------------------------------------------------------------- Welch
def test_welch_by_hand():
    # first {1,2,3,4}: mean 2.5, s² = 5/3 → s²/n = 5/12; second {2,…,6}: mean 4, s² = 2.5 → 0.5
    # SE = √(5/12 + 1/2) = √(11/12); ν = (11/12)² / ((5/12)²/3 + 0.5²/4) = 6.9808
    c = welch([1, 2, 3, 4], [2, 3, 4, 5, 6])
    assert c.difference == -1.5
    assert c.standard_error == pytest.approx(math.sqrt(11 / 12))
    assert c.dof == pytest.approx((11 / 12) ** 2 / ((5 / 12) ** 2 / 3 + 0.25 / 4))
    half = student_t_quantile(0.975, c.dof) * math.sqrt(11 / 12)
    assert (c.low, c.high) == (pytest.approx(-1.5 - half), pytest.approx(-1.5 + half))
    assert half == pytest.approx(2.2652, abs=1e-3)  # t_{0.975, 6.98} ≈ 2.366


def test_welch_bootstrap_and_tost_refuse_what_they_cannot_compute():
    for first, second in (([], [1.0]), ([1.0], []), ([], [])):
        with pytest.raises(ValueError, match="at least one value in each group"):
            welch(first, second)
    with pytest.raises(AssertionError, match="at least one difference"):
        bootstrap_interval([], 0.95)
    assert bootstrap_interval([0.25], 0.95) == (0.25, 0.25)  # one difference: every resample is it
    with pytest.raises(AssertionError, match="must be positive"):
        tost_p(paired_t([0.5, 0.7], 0.05), 0.0)


def test_welch_without_spread_or_with_single_runs():
    assert welch([1.0, 1.0], [1.0, 1.0]).standard_error == 0.0
    single = welch([0.3], [0.2, 0.4])
    assert single.difference == pytest.approx(0.0, abs=1e-12) and single.low is None
