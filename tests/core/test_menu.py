"""The field's corrections that sdp adds to its kernels (docs/math.md §2–§5, §9), against values
worked out by hand from each peer's semantics (the derivations are in the comments; GSPO: arXiv
2507.18071, M2PO: AReaL m2_threshold / arXiv 2510.01161, IcePop: verl rollout_is_threshold
"0.5_5.0" / OpenRLHF icepop, rejection by divergence: verl rollout_rs, OPSM: TRL
off_policy_mask_threshold, CISPO: ROLL/AReaL/TRL, DPPO: prime-rl default_loss_fn, A-3PO: AReaL
prox_logp_method loglinear). Every tensor is 2 sequences × 3 positions, the last position of
row 1 padding, advantages +1 for row 0 and −1 for row 1."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sdp_cli.config.schema import SdpConfig
from sdp_cli.config.validation import ConfigValueError, validate
from sdp_cli.core.loss import policy_loss
from sdp_cli.core.weights import (
    importance_weights,
    loglinear_proximal,
    off_policy_sequence_mask,
    rejection_mask,
    second_moment_mask,
)

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



# --- rejection by divergence (loss.rejection.metric/level; verl rollout_rs) -----------------------
# The same lr as M2PO's above (E1): row 0 [−0.2, 1.0, 0.0], row 1 [0.5, −0.1, pad]. verl's estimates:
# k2 = lr²/2 = [0.02, 0.5, 0 | 0.125, 0.005];
# k3 = e^lr − 1 − lr = [0.818731 − 0.8 = 0.018731, 2.718282 − 2 = 0.718282, 0 | 1.648721 − 1.5 = 0.148721,
#                       0.904837 − 0.9 = 0.004837].
# Row means of k3: 0.737013/3 = 0.245671 and 0.153559/2 = 0.076779; row sums 0.737013 and 0.153559.
def _kept(**kwargs):
    mask, metrics = rejection_mask(LR, MASK, **kwargs)
    return mask, metrics


def test_verl_seq_mean_k3_rejects_the_rows_whose_mean_k3_is_above_the_threshold():
    # threshold 0.2: row 0 (0.245671) out, row 1 (0.076779) in; the statistics are the rows' means
    mask, m = _kept(level="geometric", metric="k3", upper=0.2)
    assert torch.equal(mask, t64([[0.0, 0.0, 0.0], [1.0, 1.0, 0.0]]))
    assert m["rollout_rs_max"] == pytest.approx(0.245671, abs=1e-6)
    assert m["rollout_rs_min"] == pytest.approx(0.076779, abs=1e-6)
    assert m["rollout_rs_masked_fraction"] == pytest.approx(3 / 5)
    assert m["rollout_rs_seq_masked_fraction"] == pytest.approx(1 / 2)


def test_verls_k3_sign_is_e_to_the_lr_not_arealss_reversed_one():
    # threshold 0.07: verl's seq_mean_k3 rejects row 1 too (0.076779 > 0.07). AReaL's kl_k3 is
    # e^−lr − 1 + lr, whose row-1 mean is (0.106531 + 0.005171)/2 = 0.055851 ≤ 0.07: it would keep it.
    mask, _ = _kept(level="geometric", metric="k3", upper=0.07)
    assert torch.equal(mask, torch.zeros_like(MASK))


def test_verl_seq_sum_k3_and_seq_max_k2_and_token_k2():
    # seq_sum_k3 at 0.5: sums 0.737013 (out) and 0.153559 (in)
    mask, _ = _kept(level="sequence", metric="k3", upper=0.5)
    assert torch.equal(mask, t64([[0.0, 0.0, 0.0], [1.0, 1.0, 0.0]]))
    # seq_max_k2 at 0.4: maxima 0.5 (out) and 0.125 (in); at 0.6 both in
    mask, m = _kept(level="max", metric="k2", upper=0.4)
    assert torch.equal(mask, t64([[0.0, 0.0, 0.0], [1.0, 1.0, 0.0]]))
    assert (m["rollout_rs_min"], m["rollout_rs_max"]) == pytest.approx((0.125, 0.5))
    mask, _ = _kept(level="max", metric="k2", upper=0.6)
    assert torch.equal(mask, MASK)
    # token_k2 at 0.1: only 0.5 and 0.125 exceed it
    mask, _ = _kept(level="token", metric="k2", upper=0.1)
    assert torch.equal(mask, t64([[1.0, 0.0, 1.0], [0.0, 1.0, 0.0]]))


def test_verls_k1_bounds_are_sdps_ratio_bounds_mirrored():
    # verl token_k1 "0.5_4.0" keeps log 0.5 ≤ −lr ≤ log 4, i.e. lr ∈ [−1.386, 0.693]: lr = 1 out,
    # lr = −1 in. The same in sdp is lower = 1/4, upper = 1/0.5: ρ = e = 2.718 > 2 out, ρ = 0.368 ≥ 0.25 in.
    lr, mask = t64([[1.0, -1.0]]), torch.ones(1, 2, dtype=torch.float64)
    mirrored, _ = rejection_mask(lr, mask, level="token", lower=0.25, upper=2.0)
    assert torch.equal(mirrored, t64([[0.0, 1.0]]))
    # reading "0.5_4.0" as sdp's lower = 0.5, upper = 4 keeps the opposite token
    naive, _ = rejection_mask(lr, mask, level="token", lower=0.5, upper=4.0)
    assert torch.equal(naive, t64([[1.0, 0.0]]))
    # symmetric bounds coincide: token_k1 "0.5_2.0" rejects lr = 1.0 of E1 only (e = 2.718 > 2)
    sym, _ = _kept(level="token", lower=0.5, upper=2.0)
    assert torch.equal(sym, t64([[1.0, 0.0, 1.0], [1.0, 1.0, 0.0]]))


def test_rejected_tokens_leave_the_denominator():
    # ratio bounds [0.5, 2] reject lr = 1 (ρ = 2.718). θ = π_prox (r = 1), w = e^lr untruncated:
    # ℓ = −A·w = row 0 [−0.818731, –, −1.0], row 1 [+1.648721, +0.904837]; Σ = 0.734827 over the
    # 4 kept tokens = 0.183707 (AReaL, which keeps them in the count, gives 0.734827/5 = 0.146965)
    kept, _ = _kept(level="token", upper=2.0)
    w, _ = importance_weights(LR, kept, level="token")
    prox = t64([[-1.2, -1.0, -0.5], [-1.0, -0.3, 0.0]])
    loss, _, _ = _grad(lambda lp: policy_loss(lp, prox, ADV, kept, weights=w), prox)
    assert loss == pytest.approx(0.183707, abs=1e-6)


def test_dppo_where_the_log_ratio_clamp_binds_only_the_penalty_has_a_gradient():
    # Row 0 (A = +1): t0 log π_θ = −25 against −50, Δ = 25, r = e^20 (clamped), π − μ ≈ 1.4e-11: kept;
    # t1 −0.1 against −30, Δ = 29.9, π − μ ≈ 0.905 > ε_high: dropped; t2 Δ = 0. Row 1 (A = −1): Δ = 0.
    # ℓ = −keep·A·r + κΔ² = [−e^20 + 625κ, 894.01κ, −1 | 1, 1]; ∂ℓ/∂log π = [50κ, 59.8κ, −1 | 1, 1]:
    # where the clamp binds the ratio passes no gradient, kept or dropped, and nothing is NaN.
    anchor = t64([[-50.0, -30.0, -1.0], [-1.0, -1.0, 0.0]])
    theta = t64([[-25.0, -0.1, -1.0], [-1.0, -1.0, 0.0]])
    for kl in (0.0, 1e-3):
        loss, grad, m = _grad(lambda lp: policy_loss(lp, anchor, ADV, MASK, loss_type="dppo", dppo_kl_coef=kl), theta)
        assert loss == pytest.approx((-math.exp(20) + 625 * kl + 894.01 * kl - 1 + 1 + 1) / 5, rel=1e-12)
        assert torch.allclose(grad, t64([[50 * kl, 59.8 * kl, -1.0], [1.0, 1.0, 0.0]]) / 5, rtol=0, atol=1e-15)
        assert (m["pg_clipfrac_high"], m["pg_clipfrac_low"]) == pytest.approx((1 / 5, 0.0))


def test_dppo_counts_a_zero_advantage_with_the_negative_ones():
    # keep = 0 where A > 0 and π − μ > ε_high, or A ≤ 0 and π − μ < −ε: a token of A = 0 (a group
    # whose rewards are all equal) is judged by the lower bound. Row 0 A = 0 with π − μ = e^−0.1 − e^−3
    # = 0.855 (> ε_high, yet kept), row 1 A = 0 with π − μ = e^−3 − e^−0.1 = −0.855 (< −ε: dropped, low).
    # Every loss is 0 (A = 0).
    anchor = t64([[-3.0, -1.0, -1.0], [-0.1, -1.0, 0.0]])
    theta = t64([[-0.1, -1.0, -1.0], [-3.0, -1.0, 0.0]])
    loss, grad, m = _grad(lambda lp: policy_loss(lp, anchor, torch.zeros_like(ADV), MASK, loss_type="dppo"), theta)
    assert loss == 0.0 and not grad.any()
    assert (m["pg_clipfrac"], m["pg_clipfrac_high"], m["pg_clipfrac_low"]) == pytest.approx((1 / 5, 0.0, 1 / 5))


def test_dppo_keeps_a_probability_difference_on_the_trust_regions_edge():
    # keep = 0 only where π − μ > ε_high (A > 0) or π − μ < −ε (A ≤ 0): on the edge the token stays.
    # ε = ε_high = 0.25; π − μ = 0.5 − 0.25 = +0.25 (row 0 t0) and 0.25 − 0.5 = −0.25 (row 1 t0), exact in
    # float64 (exp(ln 0.5) = 0.5, exp(ln 0.25) = 0.25); the other tokens have π = μ.
    half, quarter = math.log(0.5), math.log(0.25)
    anchor = t64([[quarter, -1.0, -1.0], [half, -1.0, 0.0]])
    theta = t64([[half, -1.0, -1.0], [quarter, -1.0, 0.0]])
    _, grad, m = _grad(lambda lp: policy_loss(lp, anchor, ADV, MASK, loss_type="dppo", clip=0.25), theta)
    assert m["pg_clipfrac"] == 0.0
    # ∂ℓ/∂log π = −A·r/5, r = [2, 1, 1 | 0.5, 1]
    assert torch.allclose(grad, t64([[-2.0, -1.0, -1.0], [0.5, 1.0, 0.0]]) / 5, rtol=0, atol=1e-15)


def test_cispo_ratios_on_the_band_edges_are_not_counted_clipped():
    # clip(r, 1 − ε, 1 + ε_high) leaves r = 1 + ε_high and r = 1 − ε as they are, so neither is counted;
    # exp(ln 2) = 2 and exp(ln 0.5) = 0.5 exactly in float64. ε = 0.5, ε_high = 1: r = [2, 0.5, 1 | 2.5, 1].
    anchor = t64([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    theta = t64([[math.log(2.0), math.log(0.5), 0.0], [math.log(2.5), 0.0, 0.0]])
    loss, grad, m = _grad(
        lambda lp: policy_loss(lp, anchor, ADV, MASK, loss_type="cispo", clip=0.5, clip_high=1.0), theta
    )
    assert (m["pg_clipfrac"], m["pg_clipfrac_high"], m["pg_clipfrac_low"]) == pytest.approx((1 / 5, 1 / 5, 0.0))
    # ∂ℓ/∂log π = −ŵ·A/5 with ŵ = [2, 0.5, 1 | 2 (clipped from 2.5), 1]
    assert torch.allclose(grad, t64([[-2.0, -0.5, -1.0], [2.0, 1.0, 0.0]]) / 5, rtol=0, atol=1e-15)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"level": "max"}, "loss.rejection.level=max takes a sequence's largest divergence"),
        ({"level": "token", "metric": "k3", "lower": 0.1}, "loss.rejection.lower=0.1 bounds a ratio"),
        ({"metric": "k2"}, "loss.rejection.metric=k2 is bounded only with a level"),
    ],
)
def test_rejection_refuses_bounds_that_do_not_fit_its_statistic(overrides, message):
    cfg = SdpConfig()
    for key, value in overrides.items():
        setattr(cfg.loss.rejection, key, value)
    with pytest.raises(ConfigValueError, match=message):
        validate(cfg)


# --- OPSM (loss.opsm_delta; TRL off_policy_mask_threshold) ---------------------------------------
# log π_behav: row 0 [−0.5, −0.5, −0.5], row 1 [−0.5, −0.2, pad]; log π_θ: row 0 [−2.0, −1.5, −0.5],
# row 1 [−1.5, −0.4, pad]. D_0 = (1.5 + 1.0 + 0)/3 = 0.833333 but A_0 > 0: kept;
# D_1 = (1.0 + 0.2)/2 = 0.6 > δ = 0.5 and A_1 < 0: dropped.
BEHAV_OPSM = t64([[-0.5, -0.5, -0.5], [-0.5, -0.2, 0.0]])
THETA_OPSM = t64([[-2.0, -1.5, -0.5], [-1.5, -0.4, 0.0]])


def test_opsm_drops_the_negative_advantage_sequence_that_drifted_more_than_delta():
    keep, m = off_policy_sequence_mask(THETA_OPSM, BEHAV_OPSM, ADV, MASK, 0.5)
    assert torch.equal(keep, t64([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]))
    assert m["masked_fraction"] == pytest.approx(2 / 5)
    assert m["seq_masked_fraction"] == pytest.approx(1 / 2)
    assert m["seq_kl_mean"] == pytest.approx((0.833333 + 0.6) / 2, abs=1e-6)
    # δ = 0.7 ≥ D_1: nothing is dropped
    keep, _ = off_policy_sequence_mask(THETA_OPSM, BEHAV_OPSM, ADV, MASK, 0.7)
    assert torch.equal(keep, MASK)
    # "exceeds δ" is strict: δ = D_1 keeps row 1 (its drifts are 1.0 and 0.2, so D_1 is (1.0 + 0.2)/2
    # in float64 too)
    keep, _ = off_policy_sequence_mask(THETA_OPSM, BEHAV_OPSM, ADV, MASK, (1.0 + 0.2) / 2)
    assert torch.equal(keep, MASK)


def test_opsm_keeps_a_zero_advantage_sequence_however_far_it_drifted():
    # a group whose rewards are all equal has advantage exactly 0: not negative, so OPSM keeps it
    # (and its masked fraction says so) though D_1 = 0.6 > δ
    zero = t64([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    keep, m = off_policy_sequence_mask(THETA_OPSM, BEHAV_OPSM, zero, MASK, 0.5)
    assert torch.equal(keep, MASK)
    assert m["masked_fraction"] == 0.0 and m["seq_masked_fraction"] == 0.0


@pytest.mark.parametrize(("agg", "loss_value", "slope"), [("token-mean", -0.6, -0.2), ("seq-mean-token-mean", -0.5, -1 / 6)])
def test_opsm_keeps_the_dropped_tokens_in_the_denominator(agg, loss_value, slope):
    # a 0 weight: PPO at r = 1 gives ℓ = row 0 [−1, −1, −1], row 1 [0, 0]. TRL dapo (token-mean):
    # −3/5 = −0.6, gradient −1/5 on row 0; grpo (mean of row means): (−1 + 0)/2 = −0.5, gradient −1/6
    keep, _ = off_policy_sequence_mask(THETA_OPSM, BEHAV_OPSM, ADV, MASK, 0.5)
    loss, grad, _ = _grad(lambda lp: policy_loss(lp, THETA_OPSM, ADV, MASK, weights=keep, agg=agg), THETA_OPSM)
    assert loss == pytest.approx(loss_value)
    assert torch.allclose(grad, t64([[slope] * 3, [0.0, 0.0, 0.0]]))


# --- CISPO (loss.loss_type=cispo) ----------------------------------------------------------------
# log π_old: row 0 [−1.0, −1.5, −1.5], row 1 [−1.2, −1.0, pad]; log π_θ: row 0 [−1.0, −0.5, −2.0],
# row 1 [−0.7, −3.0, pad]: r = [1, e = 2.718282, e^−0.5 = 0.606531 | e^0.5 = 1.648721, e^−2 = 0.135335].
OLD_CISPO = t64([[-1.0, -1.5, -1.5], [-1.2, -1.0, 0.0]])
THETA_CISPO = t64([[-1.0, -0.5, -2.0], [-0.7, -3.0, 0.0]])


def test_cispo_with_rolls_band_and_sequence_mean():
    # ROLL's [0.9, 1.1]: ŵ = [1.0, 1.1, 0.9 | 1.1, 0.9]; ℓ = −ŵ·A·log π = row 0 [1.0, 0.55, 1.8],
    # row 1 [−0.77, −2.7]; row means 1.116667 and −1.735 → L = −0.309167. ∂L/∂log π = −ŵ·A/(G|y_i|):
    # row 0 [−1/6, −1.1/6, −0.9/6], row 1 [1.1/4, 0.9/4]. Four ratios are outside the band.
    loss, grad, m = _grad(
        lambda lp: policy_loss(lp, OLD_CISPO, ADV, MASK, loss_type="cispo", clip=0.1, agg="seq-mean-token-mean"),
        THETA_CISPO,
    )
    assert loss == pytest.approx(-0.309167, abs=1e-6)
    assert torch.allclose(grad, t64([[-1 / 6, -1.1 / 6, -0.15], [0.275, 0.225, 0.0]]), atol=1e-9)
    assert (m["pg_clipfrac"], m["pg_clipfrac_high"], m["pg_clipfrac_low"]) == pytest.approx((4 / 5, 2 / 5, 2 / 5))


def test_cispo_with_a_cap_of_five_passes_every_gradient():
    # clip 1.0, clip_high 4.0 (AReaL's recommendation, TRL's cap 5): every r < 5, ŵ = r;
    # ℓ = [1.0, 1.359141, 1.213061 | −1.154105, −0.406006], token-mean 2.012091/5 = 0.402418;
    # gradient −r·A/5 = row 0 [−0.2, −0.543656, −0.121306], row 1 [0.329744, 0.027067] — row 0's
    # r = e with A > 0, which PPO (ε = 0.2) would clip to a zero gradient
    loss, grad, m = _grad(
        lambda lp: policy_loss(lp, OLD_CISPO, ADV, MASK, loss_type="cispo", clip=1.0, clip_high=4.0), THETA_CISPO
    )
    assert loss == pytest.approx(0.402418, abs=1e-6)
    assert torch.allclose(grad, t64([[-0.2, -0.543656, -0.121306], [0.329744, 0.027067, 0.0]]), atol=1e-6)
    assert m["pg_clipfrac"] == 0.0
    _, ppo_grad, _ = _grad(lambda lp: policy_loss(lp, OLD_CISPO, ADV, MASK), THETA_CISPO)
    assert ppo_grad[0, 1] == 0.0


@settings(max_examples=40, deadline=None)
@given(
    deltas=st.lists(st.floats(-1.0, 1.0), min_size=6, max_size=6),
    clip=st.floats(0.05, 1.0),
    clip_high=st.floats(0.05, 4.0),
    agg=st.sampled_from(["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]),
)
def test_cispo_gradient_is_autograds_through_the_detached_clipped_ratio(deltas, clip, clip_high, agg):
    theta = OLD_CISPO + t64([deltas[:3], deltas[3:]])
    weights = t64([[1.3, 0.7, 1.0], [0.9, 1.1, 1.0]])
    loss, grad, _ = _grad(
        lambda lp: policy_loss(
            lp, OLD_CISPO, ADV, MASK, weights=weights, loss_type="cispo", clip=clip, clip_high=clip_high, agg=agg
        ),
        theta,
    )
    lp = theta.clone().requires_grad_()
    ratio = torch.exp(lp - OLD_CISPO).clamp(1 - clip, 1 + clip_high).detach()
    reference = _reduce(-ratio * ADV * lp * weights * MASK, agg)
    reference.backward()
    assert loss == pytest.approx(reference.item(), abs=1e-12)
    assert torch.allclose(grad, lp.grad, atol=1e-12)


def _reduce(per_token, agg):
    """sdp's aggregations (docs/math.md §5.2), written out on the 2 × 3 batch."""
    if agg == "token-mean":
        return per_token.sum() / MASK.sum()
    if agg == "seq-mean-token-sum":
        return per_token.sum(-1).mean()
    return (per_token.sum(-1) / MASK.sum(-1)).mean()


# --- DPPO (loss.loss_type=dppo, loss.dppo_kl_coef; prime-rl) -------------------------------------
# log μ = π_behav: row 0 [−0.1, −2.0, −1.0], row 1 [−1.0, −0.2, pad]; log π_θ: row 0 [−0.5, −0.7, −1.2],
# row 1 [−2.0, −0.25, pad]. μ = [0.904837, 0.135335, 0.367879 | 0.367879, 0.818731],
# π = [0.606531, 0.496585, 0.301194 | 0.135335, 0.778801],
# π − μ = [−0.298307, +0.361250, −0.066685 | −0.232544, −0.039930]. Row 0 (A > 0) drops π − μ > 0.2 (t1),
# row 1 (A < 0) drops π − μ < −0.2 (t0). log r = [−0.4, 1.3, −0.2 | −1.0, −0.05],
# r = [0.670320, 3.669297, 0.818731 | 0.367879, 0.951229].
MU = t64([[-0.1, -2.0, -1.0], [-1.0, -0.2, 0.0]])
THETA_DPPO = t64([[-0.5, -0.7, -1.2], [-2.0, -0.25, 0.0]])


def test_dppo_masks_by_probability_difference_and_penalises_the_squared_log_ratio():
    # ℓ = −keep·A·r + 1e-3·(log r)²: row 0 [−0.670320 + 0.000160, 0 + 0.001690, −0.818731 + 0.000040],
    # row 1 [0 + 0.001, 0.951229 + 0.0000025]; Σ = −0.534929, token-mean −0.106986.
    # ∂ℓ/∂log π = −keep·A·r + 2e-3·log r = row 0 [−0.671120, 0.0026, −0.819131], row 1 [−0.002, 0.951129]; /5
    loss, grad, m = _grad(
        lambda lp: policy_loss(lp, MU, ADV, MASK, loss_type="dppo", clip=0.2, dppo_kl_coef=1e-3), THETA_DPPO
    )
    assert loss == pytest.approx(-0.106986, abs=1e-6)
    expected = t64([[-0.671120, 0.0026, -0.819131], [-0.002, 0.951129, 0.0]]) / 5
    assert torch.allclose(grad, expected, atol=1e-6)
    assert (m["pg_clipfrac"], m["pg_clipfrac_high"], m["pg_clipfrac_low"]) == pytest.approx((2 / 5, 1 / 5, 1 / 5))


@settings(max_examples=40, deadline=None)
@given(
    deltas=st.lists(st.floats(-1.5, 1.5), min_size=6, max_size=6),
    clip=st.floats(0.01, 0.5),
    clip_high=st.floats(0.01, 0.5),
    kl=st.sampled_from([0.0, 1e-3, 0.5]),
    agg=st.sampled_from(["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]),
)
def test_dppo_gradient_is_autograds_of_the_masked_ratio_plus_penalty(deltas, clip, clip_high, kl, agg):
    theta = MU + t64([deltas[:3], deltas[3:]])
    weights = t64([[1.3, 0.7, 1.0], [0.9, 1.1, 1.0]])
    loss, grad, _ = _grad(
        lambda lp: policy_loss(
            lp, MU, ADV, MASK, weights=weights, loss_type="dppo", clip=clip, clip_high=clip_high, dppo_kl_coef=kl, agg=agg
        ),
        theta,
    )
    lp = theta.clone().requires_grad_()
    gap = (lp.exp() - MU.exp()).detach()
    keep = torch.where(ADV > 0, gap <= clip_high, gap >= -clip).double()
    per_token = (-keep * ADV * torch.exp(lp - MU) + kl * (lp - MU).square()) * weights * MASK
    reference = _reduce(per_token, agg)
    reference.backward()
    assert loss == pytest.approx(reference.item(), abs=1e-12)
    assert torch.allclose(grad, lp.grad, atol=1e-12)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"loss_type": "cispo", "dual_clip": 3.0}, "loss.dual_clip bounds the PPO clip's loss"),
        ({"dppo_kl_coef": 1e-3}, "loss.dppo_kl_coef=0.001 is DPPO's penalty"),
        ({"loss_type": "dppo", "ratio_level": "sequence"}, "loss.ratio_level=sequence is the ratio of the PPO clip"),
        ({"mode": "bypass", "loss_type": "cispo"}, "loss.weight_cap=5.0 bounds a behavioural weight"),
    ],
)
def test_loss_variants_refuse_what_they_do_not_have(overrides, message):
    cfg = SdpConfig()
    for key, value in overrides.items():
        setattr(cfg.loss, key, value)
    with pytest.raises(ConfigValueError, match=message):
        validate(cfg)


# --- A-3PO (loss.proximal_source=loglinear; AReaL prox_logp_method) ------------------------------
# c = 4, versions row 0 [4, 3, 2], row 1 [1, 0, pad] → lags k = [0, 1, 2 | 3, 4];
# α = clamp((k − 1)/k, 0, 1) = [0, 0, 0.5 | 2/3, 0.75].
LAG = torch.tensor([[0, 1, 2], [3, 4, -1]])
BEHAV_A3PO = t64([[-1.0, -2.0, -0.5], [-1.5, -0.2, 0.0]])
THETA_A3PO = t64([[-1.2, -1.0, -0.9], [-0.6, -1.0, 0.0]])


def test_a3po_interpolates_the_proximal_policy_by_staleness():
    # log π̂ = behav + α(θ − behav): row 0 [−1.0, −2.0, −0.5 + 0.5·(−0.4) = −0.7],
    # row 1 [−1.5 + (2/3)·0.9 = −0.9, −0.2 + 0.75·(−0.8) = −0.8]; mean α = (0.5 + 2/3 + 0.75)/5
    prox, m = loglinear_proximal(BEHAV_A3PO, THETA_A3PO, LAG, MASK)
    assert torch.allclose(prox, t64([[-1.0, -2.0, -0.7], [-0.9, -0.8, 0.0]]), atol=1e-12)
    assert m["alpha_mean"] == pytest.approx((0.5 + 2 / 3 + 0.75) / 5)


def test_a3po_decoupled_loss_on_the_interpolated_proximal_policy():
    # w = e^{π̂ − behav} = [1, 1, 0.818731 | 1.822119, 0.548812]; r = e^{θ − π̂} = [0.818731, 2.718282,
    # 0.818731 | 1.349859, 0.818731]. PPO ε = 0.2: row 0 t1 clipped (A > 0, r > 1.2); row 1 t0 takes
    # the unclipped branch (A < 0, r > 1.2). ℓ·w = [−0.818731, −1.2, −0.670320 | 2.459603, 0.449329],
    # token-mean 0.219881/5 = 0.043976; gradient −A·r·w/5 except the clipped token
    prox, _ = loglinear_proximal(BEHAV_A3PO, THETA_A3PO, LAG, MASK)
    w, _ = importance_weights(prox - BEHAV_A3PO, MASK, level="token")
    loss, grad, _ = _grad(lambda lp: policy_loss(lp, prox, ADV, MASK, weights=w), THETA_A3PO)
    assert loss == pytest.approx(0.043976, abs=1e-6)
    assert torch.allclose(grad, t64([[-0.818731, 0.0, -0.670320], [2.459603, 0.449329, 0.0]]) / 5, atol=1e-6)


def test_a3po_anchors_fresh_and_one_step_stale_tokens_at_the_behaviour_policy():
    # α = 0 for k ≤ 1: π̂ = π_behav, the weight is 1 and the PPO ratio is π_θ/π_behav: bypass
    lag = torch.tensor([[0, 1, 1], [0, 1, -1]])
    prox, m = loglinear_proximal(BEHAV_A3PO, THETA_A3PO, lag, MASK)
    assert torch.equal(prox, BEHAV_A3PO * MASK)
    assert m["alpha_mean"] == 0.0


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"mode": "segment_wise"}, "loss.proximal_source=loglinear \\(A-3PO\\) approximates the decoupled"),
        ({"m2_threshold": 0.04}, "loss.m2_threshold reads the batch's π_prox"),
    ],
)
def test_a3po_refuses_what_needs_the_batchs_proximal_policy(overrides, message):
    cfg = SdpConfig()
    cfg.loss.proximal_source = "loglinear"
    for key, value in overrides.items():
        setattr(cfg.loss, key, value)
    with pytest.raises(ConfigValueError, match=message):
        validate(cfg)
