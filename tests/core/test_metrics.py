"""Hand-computed checks of sdp_cli.core.metrics: offpolicy_metrics (docs/math.md §4) and the per-lag weight statistics."""

import math

import pytest
import torch

from sdp_cli.core.metrics import lag_weight_stats, offpolicy_metrics

E = math.e
NAN, INF = float("nan"), float("inf")

# Rows: [−1, −2] and [−1, pad] under the rollout policy; [−1.5, −1.5] and [−0.5, pad] under
# the training policy. lr = training − rollout = [−0.5, +0.5 | +0.5]. Row 2 is padding only.
ROLLOUT = torch.tensor([[-1.0, -2.0], [-1.0, NAN], [INF, NAN]], dtype=torch.float64)
TRAINING = torch.tensor([[-1.5, -1.5], [-0.5, -INF], [NAN, 7.0]], dtype=torch.float64)
MASK = torch.tensor([[1, 1], [1, 0], [0, 0]], dtype=torch.float64)


def test_hand_values():
    m = offpolicy_metrics(ROLLOUT, TRAINING, MASK)
    assert m["kl"] == pytest.approx((0.5 - 0.5 - 0.5) / 3)  # mean(−lr) = −1/6
    # k3 = e^lr − 1 − lr: (e^−0.5 − 0.5) for −0.5, (e^0.5 − 1.5) twice
    assert m["k3_kl"] == pytest.approx((math.exp(-0.5) - 0.5 + 2 * (math.exp(0.5) - 1.5)) / 3)
    # training row means −1.5, −0.5 → log ppl 1.5, 0.5
    assert m["training_log_ppl"] == pytest.approx(1.0)
    assert m["training_ppl"] == pytest.approx((math.exp(1.5) + math.exp(0.5)) / 2)
    # rollout row means −1.5, −1 → log ppl 1.5, 1
    assert m["rollout_log_ppl"] == pytest.approx(1.25)
    assert m["rollout_ppl"] == pytest.approx((math.exp(1.5) + E) / 2)
    # d = rollout mean − training mean = [0, −0.5]
    assert m["log_ppl_diff"] == pytest.approx(-0.25)
    assert m["log_ppl_abs_diff"] == pytest.approx(0.25)
    assert m["log_ppl_diff_max"] == pytest.approx(0.0)
    assert m["log_ppl_diff_min"] == pytest.approx(-0.5)
    assert m["ppl_ratio"] == pytest.approx((1 + math.exp(-0.5)) / 2)
    # chi2_token = mean(e^{2 lr}) − 1 = (e^−1 + e + e) / 3 − 1
    assert m["chi2_token"] == pytest.approx((math.exp(-1) + 2 * E) / 3 - 1)
    # chi2_seq = mean over rows of e^{2 Σ lr} − 1, with Σ lr = 0 and 0.5
    assert m["chi2_seq"] == pytest.approx((1 + E) / 2 - 1)
    assert list(m) == [
        "kl",
        "k3_kl",
        "training_ppl",
        "training_log_ppl",
        "rollout_ppl",
        "rollout_log_ppl",
        "log_ppl_diff",
        "log_ppl_abs_diff",
        "log_ppl_diff_max",
        "log_ppl_diff_min",
        "ppl_ratio",
        "chi2_token",
        "chi2_seq",
    ]


def test_identical_policies_give_zero_divergence():
    m = offpolicy_metrics(ROLLOUT, ROLLOUT, MASK)
    for name in ("kl", "k3_kl", "log_ppl_diff", "log_ppl_abs_diff", "chi2_token", "chi2_seq"):
        assert m[name] == 0.0, name
    assert m["ppl_ratio"] == 1.0


def test_k3_does_not_overflow_on_a_huge_log_ratio():
    # lr = 200 would overflow e^lr in float32; the clamp gives e^20 − 1 − 20
    m = offpolicy_metrics(torch.tensor([[-200.0]]), torch.tensor([[0.0]]), torch.tensor([[True]]))
    assert math.isfinite(m["k3_kl"])
    assert m["k3_kl"] == pytest.approx(math.exp(20) - 21, rel=1e-5)


def test_k3_is_accurate_for_tiny_log_ratios():
    # e^x − 1 − x ≈ x²/2 = 5e-17 for x = 1e-8; evaluated naively in float64 it is −6e-17
    m = offpolicy_metrics(
        torch.tensor([[0.0]], dtype=torch.float64),
        torch.tensor([[1e-8]], dtype=torch.float64),
        torch.tensor([[1]]),
    )
    assert m["k3_kl"] == pytest.approx(5e-17, rel=1e-6)


def test_empty_batch_gives_neutral_values():
    m = offpolicy_metrics(ROLLOUT, TRAINING, torch.zeros(3, 2))
    ones = {"training_ppl", "rollout_ppl", "ppl_ratio"}
    assert m == {name: (1.0 if name in ones else 0.0) for name in m}
    assert len(m) == 13


def test_lag_weight_stats_by_hand():
    ln2 = math.log(2.0)
    lr = torch.tensor([[0.0, ln2, 2 * ln2], [ln2, 0.0, 5.0]])
    lag = torch.tensor([[0, 1, 1], [1, 0, 2]])
    selected = torch.tensor([[True, True, True], [True, True, False]])
    stats = lag_weight_stats(lr, selected, lag)
    assert sorted(stats) == [0, 1]  # lag 2's only token is not selected
    # lag 0: weights 1, 1 → mean 1, std 0, ESS 1, mean log 0
    assert stats[0] == pytest.approx({"tokens": 2.0, "mean": 1.0, "std": 0.0, "ess": 1.0, "log_mean": 0.0})
    # lag 1: weights 2, 4, 2 → mean 8/3; population variance ((2/3)²·2 + (4/3)²)/3 = 8/9;
    # ESS = (64/9) / (64/9 + 8/9) = 8/9; mean log = (1 + 2 + 1)·ln 2 / 3
    assert stats[1] == pytest.approx(
        {"tokens": 3.0, "mean": 8 / 3, "std": math.sqrt(8 / 9), "ess": 8 / 9, "log_mean": 4 * ln2 / 3}, rel=1e-6
    )
