"""The ablate report's statistics: Student-t quantiles, Welch's interval and the mode comparison.

Reference quantiles are the usual table values t_{0.975, ν}; the Welch numbers are worked out by
hand below each test.
"""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sdp_cli.ablate.records import GroupRow, mode_label
from sdp_cli.ablate.stats import (
    compare_modes,
    student_t_cdf,
    student_t_quantile,
    welch,
    welch_from_moments,
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


@given(st.floats(0.01, 0.99), st.floats(1.0, 200.0))
def test_quantile_inverts_the_cdf(p, dof):
    assert student_t_cdf(student_t_quantile(p, dof), dof) == pytest.approx(p, abs=1e-9)


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
    # the same from each group's mean, sample std and size
    same = welch_from_moments(2.5, math.sqrt(5 / 3), 4, 4.0, math.sqrt(2.5), 5)
    assert same.low == pytest.approx(c.low) and same.high == pytest.approx(c.high)


def test_welch_without_spread_or_with_single_runs():
    assert welch([1.0, 1.0], [1.0, 1.0]).standard_error == 0.0
    single = welch([0.3], [0.2, 0.4])
    assert single.difference == pytest.approx(0.0, abs=1e-12) and single.low is None


def _group(mode, eta, rewards):
    n = len(rewards)
    mean = sum(rewards) / n
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / (n - 1)) if n > 1 else None
    row = GroupRow(mode, eta, (), list(range(n)))
    row.mean["reward_last"], row.std["reward_last"], row.count["reward_last"] = mean, std, n
    return row


def test_every_mode_is_compared_with_the_best_other_mode_at_its_eta():
    groups = [
        _group("decoupled", 4, [0.30, 0.28, 0.26]),  # mean 0.28
        _group("segment_wise", 4, [0.20, 0.22, 0.24]),  # mean 0.22
        _group("segment_wise_drift(κ=2)", 4, [0.29, 0.27, 0.28]),  # mean 0.28 − tiny
        _group("decoupled", 8, [0.2, 0.3]),
        _group("segment_wise", 8, [0.1]),
    ]
    by = {(c.max_head_offpolicyness, c.mode): c for c in compare_modes(groups)}
    # at η = 4 the best other mode of decoupled is drift (0.28 vs 0.22), and for both others
    # decoupled is best (ties go to the first in mode order)
    assert by[4, "decoupled"].best_other == "segment_wise_drift(κ=2)"
    assert by[4, "segment_wise"].best_other == "decoupled"
    seg = by[4, "segment_wise"].comparison
    # Δ = 0.22 − 0.28; both sample stds 0.02 → SE = √(2·0.0004/3), ν = 4
    assert seg.difference == pytest.approx(-0.06)
    assert seg.standard_error == pytest.approx(math.sqrt(0.0008 / 3))
    assert seg.dof == pytest.approx(4.0)
    assert seg.high == pytest.approx(-0.06 + 2.7764 * math.sqrt(0.0008 / 3), abs=1e-4)
    # η = 8 is compared within η = 8 only; a single run has no interval
    assert by[8, "segment_wise"].best_other == "decoupled"
    assert by[8, "segment_wise"].comparison.low is None


def test_a_mode_alone_at_its_eta_has_nothing_to_compare_with():
    (only,) = compare_modes([_group("decoupled", 2, [0.1, 0.2])])
    assert only.best_other is None and only.comparison is None


@pytest.mark.parametrize(
    ("loss", "label"),
    [
        ({"mode": "decoupled", "drift_clip": None}, "decoupled"),
        ({"mode": "segment_wise"}, "segment_wise"),  # config.yaml of runs older than the key
        ({"mode": "segment_wise", "drift_clip": 1.5}, "segment_wise_drift(κ=1.5)"),
        ({"mode": "segment_wise", "drift_clip": 2.0}, "segment_wise_drift(κ=2)"),
        ({"mode": "segment_wise", "drift_clip": float("inf")}, "segment_wise_drift(κ=inf)"),
    ],
)
def test_each_drift_clip_is_a_mode_of_its_own(loss, label):
    assert mode_label({"loss": loss}) == label


def test_against_compares_each_mode_with_the_better_baseline_only():
    groups = [
        _group("decoupled", 8, [0.26, 0.24, 0.25]),  # mean 0.25
        _group("segment_wise", 8, [0.17, 0.19, 0.18]),  # mean 0.18
        _group("segment_wise_drift(κ=2)", 8, [0.22, 0.24, 0.23]),  # mean 0.23
        _group("segment_wise_drift(κ=4)", 8, [0.27, 0.26, 0.28]),  # mean 0.27: best of all
    ]
    by = {c.mode: c for c in compare_modes(groups, against=("decoupled", "segment_wise"))}
    # without `against` κ=2 would be compared with κ=4 (0.27); with it, with decoupled (0.25)
    assert by["segment_wise_drift(κ=2)"].best_other == "decoupled"
    assert by["segment_wise_drift(κ=2)"].comparison.difference == pytest.approx(-0.02)
    assert by["segment_wise_drift(κ=4)"].best_other == "decoupled"
    assert by["segment_wise_drift(κ=4)"].comparison.difference == pytest.approx(0.02)
    # a baseline is compared with the other baseline, never with itself
    assert by["decoupled"].best_other == "segment_wise"
    assert by["decoupled"].comparison.difference == pytest.approx(0.07)
    assert by["segment_wise"].best_other == "decoupled"
    # all stds 0.01 with n = 3: SE = √(2·0.0001/3)
    assert by["segment_wise"].comparison.standard_error == pytest.approx(math.sqrt(0.0002 / 3))
