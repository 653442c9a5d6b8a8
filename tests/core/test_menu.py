"""The field's corrections that sdp adds to its kernels (docs/math.md §2–§5), against values worked
out by hand from each peer's semantics (the derivations are in the comments; GSPO: arXiv
2507.18071, M2PO: AReaL m2_threshold / arXiv 2510.01161, IcePop: verl rollout_is_threshold
"0.5_5.0" / OpenRLHF icepop). Every tensor is 2 sequences × 3 positions, the last position of
row 1 padding, advantages +1 for row 0 and −1 for row 1."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sdp_cli.core.loss import policy_loss
from sdp_cli.core.weights import importance_weights, second_moment_mask

MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], dtype=torch.float64)
ADV = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, 0.0]], dtype=torch.float64)


def t64(rows):
    return torch.tensor(rows, dtype=torch.float64)


def _grad(loss_fn, logprobs):
    logprobs = logprobs.clone().requires_grad_()
    loss, metrics = loss_fn(logprobs)
    loss.backward()
    return loss.item(), logprobs.grad, metrics


# --- GSPO: the sequence-level PPO ratio (loss.ratio_level=sequence) --------------------------
# log π_old = −1 everywhere; log π_θ − log π_old = row 0 [0.3, −0.1, 0.1], row 1 [0.2, −0.4, pad].
# s_0 = exp(0.3/3) = exp(0.1) = 1.105171, s_1 = exp(−0.2/2) = exp(−0.1) = 0.904837.
OLD = t64([[-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]])
THETA = OLD + t64([[0.3, -0.1, 0.1], [0.2, -0.4, 0.0]])


def test_gspo_unclipped_value_and_gradient_with_each_sequence_weighing_one_over_g():
    # ε = 0.2: both s_i lie in [0.8, 1.2]. seq-mean-token-mean (the paper's 1/G Σ_i):
    # L = −(1/2)(+1·1.105171 − 1·0.904837) = −0.100167; ∂L/∂lp_t = −A_i s_i / (G |y_i|):
    # row 0 −1.105171/6 = −0.184195 per token, row 1 +0.904837/4 = +0.226209 per token.
    loss, grad, m = _grad(
        lambda lp: policy_loss(lp, OLD, ADV, MASK, agg="seq-mean-token-mean", ratio_level="sequence"), THETA
    )
    assert loss == pytest.approx(-0.100167, abs=1e-6)
    assert torch.allclose(grad, t64([[-0.184195] * 3, [0.226209, 0.226209, 0.0]]), atol=1e-6)
    assert m["pg_clipfrac"] == 0.0


def test_gspo_with_token_mean_weighs_sequences_by_length_as_areal_does():
    # token-mean over N = 5: L = (3·(−1.105171) + 2·0.904837)/5 = −0.301168; gradient −A_i s_i / N:
    # row 0 −0.221034, row 1 +0.180967 per token
    loss, grad, _ = _grad(lambda lp: policy_loss(lp, OLD, ADV, MASK, ratio_level="sequence"), THETA)
    assert loss == pytest.approx(-0.301168, abs=1e-6)
    assert torch.allclose(grad, t64([[-0.221034] * 3, [0.180967, 0.180967, 0.0]]), atol=1e-6)


def test_gspo_with_the_papers_clip_range_clips_both_sequences_and_passes_no_gradient():
    # ε = 3e-4 / 4e-4: s_0 = 1.105 > 1.0004 with A > 0 and s_1 = 0.905 < 0.9997 with A < 0 are both
    # clipped: L = (−1.0004 + 0.9997)/2 = −0.00035 and the gradient is 0 everywhere
    loss, grad, m = _grad(
        lambda lp: policy_loss(
            lp, OLD, ADV, MASK, clip=3e-4, clip_high=4e-4, agg="seq-mean-token-mean", ratio_level="sequence"
        ),
        THETA,
    )
    assert loss == pytest.approx(-0.00035, abs=1e-9)
    assert torch.equal(grad, torch.zeros_like(grad))
    assert m["pg_clipfrac"] == 1.0  # every valid token belongs to a clipped sequence


@settings(max_examples=40, deadline=None)
@given(
    deltas=st.lists(st.floats(-0.5, 0.5), min_size=6, max_size=6),
    clip=st.floats(0.01, 0.5),
    agg=st.sampled_from(["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]),
)
def test_gspo_gradient_is_autograds_gradient_of_the_sequence_objective(deltas, clip, agg):
    # the closed-form slope against autograd through an explicit GSPO objective
    theta = OLD + t64([deltas[:3], deltas[3:]])
    weights = t64([[1.3, 0.7, 1.0], [0.9, 1.1, 1.0]])
    _, grad, _ = _grad(
        lambda lp: policy_loss(lp, OLD, ADV, MASK, weights=weights, clip=clip, agg=agg, ratio_level="sequence"), theta
    )
    lp = theta.clone().requires_grad_()
    delta = (lp - OLD) * MASK
    s = torch.exp(delta.sum(-1) / MASK.sum(-1)).unsqueeze(-1).expand_as(lp)
    per_token = torch.maximum(-ADV * s, -ADV * s.clamp(1 - clip, 1 + clip)) * weights * MASK
    if agg == "token-mean":
        reference = per_token.sum() / MASK.sum()
    elif agg == "seq-mean-token-sum":
        reference = per_token.sum(-1).mean()
    else:
        reference = (per_token.sum(-1) / MASK.sum(-1)).mean()
    reference.backward()
    assert torch.allclose(grad, lp.grad, atol=1e-9)


def test_a_sequence_ratio_refuses_a_loss_without_a_clip():
    with pytest.raises(ValueError, match="ratio_level='sequence' is a PPO-clip ratio"):
        policy_loss(THETA, OLD, ADV, MASK, loss_type="reinforce", ratio_level="sequence")


# --- M2PO: the second-moment token mask (loss.m2_threshold) -------------------------------------
# lr row 0 [−0.2, 1.0, 0.0], row 1 [0.5, −0.1, pad]; lr² = [0.04, 1.0, 0.0 | 0.25, 0.01].
LR = t64([[-0.2, 1.0, 0.0], [0.5, -0.1, 7.0]])  # 7.0 at padding must not count


def test_m2po_drops_the_largest_squared_ratios_until_the_mean_is_below_the_threshold():
    # sorted descending [1.0, 0.25, 0.04, 0.01, 0.0]: dropping none leaves mean 1.30/5 = 0.26, one
    # 0.30/4 = 0.075, two 0.05/3 = 0.016667 < 0.04: drop the tokens with 1.0 and 0.25. The token
    # with lr² = 0.04 = τ stays (the test is on the mean, strictly below τ).
    mask, m = second_moment_mask(LR, MASK, 0.04)
    assert torch.equal(mask, t64([[1.0, 0.0, 1.0], [0.0, 1.0, 0.0]]))
    assert m["m2_before"] == pytest.approx(0.26)
    assert m["m2_after"] == pytest.approx(0.05 / 3)
    assert m["masked_fraction"] == pytest.approx(2 / 5)


def test_m2po_keeps_one_token_when_no_subset_is_below_the_threshold():
    # lr² = [1, 1]: no prefix mean is below 0.04, so exactly one token is kept
    lr, mask = t64([[1.0, -1.0]]), torch.ones(1, 2, dtype=torch.bool)
    kept, m = second_moment_mask(lr, mask, 0.04)
    assert kept.dtype == torch.bool and int(kept.sum()) == 1
    assert m["m2_after"] == pytest.approx(1.0)
    # lr² = [0.25, 0.25] with τ = 0.25 (exact in binary): a mean equal to τ is not below it, so again one is kept
    kept, _ = second_moment_mask(t64([[0.5, -0.5]]), mask, 0.25)
    assert int(kept.sum()) == 1


@settings(max_examples=60, deadline=None)
@given(values=st.lists(st.floats(-3, 3), min_size=1, max_size=12), threshold=st.floats(0.001, 2.0))
def test_m2po_keeps_the_largest_set_of_smallest_values_whose_mean_is_below_the_threshold(values, threshold):
    lr = t64([values])
    kept, _ = second_moment_mask(lr, torch.ones_like(lr, dtype=torch.bool), threshold)
    squares = lr.square()[0]
    kept_sq, dropped_sq = squares[kept[0]], squares[~kept[0]]
    assert kept_sq.numel() >= 1
    # every dropped value is at least every kept one, and the kept mean is below τ unless one is kept
    if dropped_sq.numel():
        assert dropped_sq.min() >= kept_sq.max()
    assert kept_sq.mean() < threshold or kept_sq.numel() == 1
    # maximal: adding back the smallest dropped value would reach τ
    if dropped_sq.numel() and kept_sq.mean() < threshold:
        assert torch.cat([kept_sq, dropped_sq.min().view(1)]).mean() >= threshold


# --- IcePop: the two-sided token mask of the weight (is_level=token, weight_action=mask) ---------
def test_icepop_is_the_masked_token_weight_with_the_token_kept_in_the_denominator():
    # lr row 0 [−1, 2, 0], row 1 [1, −0.5]: w̃ = [0.367879, 7.389056, 1 | 2.718282, 0.606531];
    # outside [0.5, 5] → 0: w = [0, 0, 1 | 2.718282, 0.606531]. θ = π_prox (r = 1): ℓ = −A·w,
    # token-mean over all 5 valid tokens: (−1 + 2.718282 + 0.606531)/5 = 0.464963; ∂L/∂lp = −A·w/5
    lr = t64([[-1.0, 2.0, 0.0], [1.0, -0.5, 0.0]])
    w, m = importance_weights(lr, MASK, level="token", cap=5.0, floor=0.5, action="mask")
    assert torch.allclose(w, t64([[0.0, 0.0, 1.0], [math.e, math.exp(-0.5), 0.0]]), atol=1e-12)
    prox = t64([[-1.0, -2.0, -0.5], [-1.5, -0.2, 0.0]])
    loss, grad, _ = _grad(lambda lp: policy_loss(lp, prox, ADV, MASK, weights=w), prox)
    assert loss == pytest.approx(0.464963, abs=1e-6)
    assert torch.allclose(grad, t64([[0.0, 0.0, -0.2], [0.543656, 0.121306, 0.0]]), atol=1e-6)
    assert m["rollout_is_masked_fraction"] == pytest.approx(2 / 5)


# --- the trained weight's ESS at its level --------------------------------------------------------
def test_the_sequence_ess_is_that_of_one_weight_per_sequence():
    # sequence level: row sums log 2 and log 0.5 → w = 2 and 0.5 on every token of their rows.
    # Per sequence: mean 1.25, population variance ((0.75)² + (0.75)²)/2 = 0.5625,
    # ESS = 1.25² / (1.25² + 0.5625) = 1.5625 / 2.125 = 0.735294. Per token the long row counts
    # 3 times: mean (3·2 + 2·0.5)/5 = 1.4, E[w²] = (12 + 0.5)/5 = 2.5, ESS = 1.96/2.5 = 0.784.
    lr = t64([[math.log(2) / 3] * 3, [math.log(0.5) / 2, math.log(0.5) / 2, 0.0]])
    _, m = importance_weights(lr, MASK, level="sequence")
    assert m["rollout_is_seq_eff_sample_size"] == pytest.approx(1.5625 / 2.125)
    assert m["rollout_is_eff_sample_size"] == pytest.approx(0.784)
