"""The exact decomposition's small pieces by hand: a set's moments and what a drift clip keeps."""

from __future__ import annotations

import math

import pytest
import torch

from sdp_cli.analysis.decomposition import Moments, drift_kept


def test_moments_by_hand():
    # [1, −3]: mean −1, population std 2, mean |x| 2, max |x| 3
    assert Moments.of(torch.tensor([1.0, -3.0])) == Moments(mean=-1.0, std=2.0, mean_abs=2.0, max_abs=3.0)


def test_a_drift_clip_keeps_a_factor_exactly_at_its_bound_whole():
    # d = 2, 1/2, 1, 4 under κ = 2: the first three inside [1/κ, κ] (the bounds included), and the
    # clipped log mass is log 2 · 3 of log 2 · 4
    dropped = torch.tensor([math.log(2), -math.log(2), 0.0, math.log(4)], dtype=torch.float64)
    kept = drift_kept(dropped, 2.0)
    assert (kept.kappa, kept.tokens_unclipped) == (2.0, 0.75)
    assert kept.log_kept == pytest.approx(0.75, rel=1e-12)


def test_a_drift_clip_over_no_tokens_or_no_drift_keeps_everything():
    assert drift_kept(torch.zeros(0, dtype=torch.float64), 3.0).tokens_unclipped == 1.0
    none = drift_kept(torch.zeros(4, dtype=torch.float64), 3.0)
    assert (none.tokens_unclipped, none.log_kept) == (1.0, 1.0)
