"""Hand-computed checks of sdp_cli.core.weights (docs/math.md §1–§3).

Log ratios are written as math.log(x) so that each weight is the number x itself; padded
positions hold garbage (99, NaN, inf) that must never show up in a result.
"""

import math

import pytest
import torch

from sdp_cli.core.weights import behavior_log_ratio, importance_weights, rejection_mask

LN = math.log
NAN, INF = float("nan"), float("inf")


def t64(rows):
    return torch.tensor(rows, dtype=torch.float64)


# --- behavior_log_ratio -------------------------------------------------------------------


def test_decoupled_is_prox_minus_old():
    old = t64([[-1.0, -2.0]])
    prox = t64([[-0.5, -2.5]])
    # −0.5 − (−1) = 0.5 and −2.5 − (−2) = −0.5
    assert torch.equal(behavior_log_ratio(old, prox, mode="decoupled"), t64([[0.5, -0.5]]))


def test_segment_wise_uses_prox_t_not_prox():
    old = t64([[-1.0, -2.0]])
    prox = t64([[-9.0, -9.0]])  # must be ignored
    prox_t = t64([[-1.0, -1.0]])
    # −1 − (−1) = 0 and −1 − (−2) = 1
    assert torch.equal(
        behavior_log_ratio(old, prox, prox_t, mode="segment_wise"), t64([[0.0, 1.0]])
    )


def test_bypass_has_no_weight():
    assert behavior_log_ratio(t64([[-1.0]]), mode="bypass") is None


def test_log_ratio_is_detached():
    old = t64([[-1.0]])
    prox = t64([[-0.5]]).requires_grad_(True)
    assert not behavior_log_ratio(old, prox, mode="decoupled").requires_grad


# --- importance_weights: token level ------------------------------------------------------

# Raw weights 3, 0.25, 1 on three valid tokens; the fourth position is padding.
TOKEN_LR = t64([[LN(3.0), LN(0.25), 0.0, 99.0]])
TOKEN_MASK = t64([[1, 1, 1, 0]])


def test_token_truncate_values_and_metrics():
    w, m = importance_weights(TOKEN_LR, TOKEN_MASK, level="token", cap=2.0, floor=0.5)
    # 3 → cap 2, 0.25 → floor 0.5, 1 stays; padding 0 (not e^20 from the 99).
    assert torch.allclose(w, t64([[2.0, 0.5, 1.0, 0.0]]))
    assert m["rollout_is_mean"] == pytest.approx(3.5 / 3)  # (2 + 0.5 + 1) / 3
    # population std of [2, 0.5, 1]: deviations 5/6, −2/3, −1/6 → variance 14/36
    assert m["rollout_is_std"] == pytest.approx(math.sqrt(14) / 6)
    assert m["rollout_is_min"] == 0.5 and m["rollout_is_max"] == 2.0
    # w/mean = [12/7, 3/7, 6/7]; mean of squares 9/7 → ESS 7/9
    assert m["rollout_is_eff_sample_size"] == pytest.approx(7 / 9)
    # raw 3 > cap 2 (1 of 3 tokens); raw 0.25 < floor 0.5 (1 of 3)
    assert m["rollout_is_ratio_fraction_high"] == pytest.approx(1 / 3)
    assert m["rollout_is_ratio_fraction_low"] == pytest.approx(1 / 3)
    # one sequence: its mean returned weight 7/6, std 0
    assert m["rollout_is_seq_mean"] == pytest.approx(7 / 6)
    assert m["rollout_is_seq_std"] == 0.0
    assert m["rollout_is_seq_min"] == pytest.approx(7 / 6) and m[
        "rollout_is_seq_max"
    ] == pytest.approx(7 / 6)
    # its raw mean (3 + 0.25 + 1) / 3 = 1.417 is inside [0.5, 2]
    assert m["rollout_is_seq_fraction_high"] == 0.0 and m["rollout_is_seq_fraction_low"] == 0.0
    assert "rollout_is_masked_fraction" not in m and "rollout_is_batch_norm_factor" not in m
    assert all(isinstance(v, float) for v in m.values())


def test_token_mask_action_zeroes_out_of_bound_weights():
    w, m = importance_weights(
        TOKEN_LR, TOKEN_MASK, level="token", cap=2.0, floor=0.5, action="mask"
    )
    # 3 > 2 and 0.25 < 0.5 are masked to 0; 1 stays.
    assert torch.equal(w, t64([[0.0, 0.0, 1.0, 0.0]]))
    assert m["rollout_is_masked_fraction"] == pytest.approx(2 / 3)
    assert m["rollout_is_mean"] == pytest.approx(1 / 3)
    # w/mean = [0, 0, 3]: mean of squares 3 → ESS 1/3
    assert m["rollout_is_eff_sample_size"] == pytest.approx(1 / 3)
    # fractions come from the raw weights, not from the zeros
    assert m["rollout_is_ratio_fraction_high"] == pytest.approx(1 / 3)


def test_cap_only_truncation_has_no_lower_bound():
    w, m = importance_weights(TOKEN_LR, TOKEN_MASK, level="token", cap=2.0)
    assert torch.allclose(w, t64([[2.0, 0.25, 1.0, 0.0]]))
    assert m["rollout_is_ratio_fraction_low"] == 0.0 and m["rollout_is_seq_fraction_low"] == 0.0


def test_no_bounds_returns_raw_weights():
    w, _ = importance_weights(TOKEN_LR, TOKEN_MASK)
    assert torch.allclose(w, t64([[3.0, 0.25, 1.0, 0.0]]))


def test_log_ratio_is_clamped_at_20_before_exp():
    w, _ = importance_weights(t64([[50.0, -50.0]]), t64([[1, 1]]))
    assert torch.allclose(w, t64([[math.exp(20), math.exp(-20)]]))


def test_token_batch_normalisation_divides_by_mean_after_truncation():
    w, m = importance_weights(
        TOKEN_LR, TOKEN_MASK, level="token", cap=2.0, floor=0.5, batch_normalize=True
    )
    # bounded [2, 0.5, 1] has mean 7/6 → divided: [12/7, 3/7, 6/7]
    assert torch.allclose(w, t64([[12 / 7, 3 / 7, 6 / 7, 0.0]]))
    assert m["rollout_is_batch_norm_factor"] == pytest.approx(7 / 6)
    assert m["rollout_is_mean"] == pytest.approx(1.0)
    # normalisation may push a weight above the cap: 12/7 ≈ 1.71 < 2 here, but raw fractions keep
    assert m["rollout_is_ratio_fraction_high"] == pytest.approx(1 / 3)


# --- importance_weights: sequence and geometric levels -----------------------------------

# Row 0: raw token ratios 2, 2 (product 4, geometric mean 2); row 1: 0.5; row 2: padding only.
SEQ_LR = t64([[LN(2.0), LN(2.0), NAN], [LN(0.5), INF, 99.0], [NAN, NAN, NAN]])
SEQ_MASK = t64([[1, 1, 0], [1, 0, 0], [0, 0, 0]])


def test_sequence_weight_is_product_broadcast_over_the_row():
    w, m = importance_weights(SEQ_LR, SEQ_MASK, level="sequence", cap=3.0, floor=0.6)
    # row 0: 2·2 = 4 → cap 3; row 1: 0.5 → floor 0.6; row 2: nothing valid
    assert torch.allclose(w, t64([[3.0, 3.0, 0.0], [0.6, 0.0, 0.0], [0.0, 0.0, 0.0]]))
    # fractions are over the two non-empty sequences
    assert m["rollout_is_ratio_fraction_high"] == pytest.approx(1 / 2)
    assert m["rollout_is_ratio_fraction_low"] == pytest.approx(1 / 2)
    assert m["rollout_is_seq_fraction_high"] == pytest.approx(1 / 2)
    # token-weighted mean (3 + 3 + 0.6) / 3, sequence mean (3 + 0.6) / 2
    assert m["rollout_is_mean"] == pytest.approx(6.6 / 3)
    assert m["rollout_is_seq_mean"] == pytest.approx(1.8)
    assert m["rollout_is_seq_std"] == pytest.approx(1.2)  # population std of [3, 0.6]
    assert m["rollout_is_seq_min"] == pytest.approx(0.6) and m[
        "rollout_is_seq_max"
    ] == pytest.approx(3.0)


def test_geometric_weight_is_mean_log_ratio():
    w, _ = importance_weights(SEQ_LR, SEQ_MASK, level="geometric")
    # row 0: exp(mean(ln 2, ln 2)) = 2; row 1: 0.5
    assert torch.allclose(w, t64([[2.0, 2.0, 0.0], [0.5, 0.0, 0.0], [0.0, 0.0, 0.0]]))


def test_sequence_batch_normalisation_averages_over_sequences():
    w, m = importance_weights(SEQ_LR, SEQ_MASK, level="sequence", cap=3.0, batch_normalize=True)
    # sequence weights [3, 0.5] have mean 1.75 over the two sequences (not over 3 tokens)
    assert m["rollout_is_batch_norm_factor"] == pytest.approx(1.75)
    assert torch.allclose(
        w, t64([[3 / 1.75, 3 / 1.75, 0.0], [0.5 / 1.75, 0.0, 0.0], [0.0, 0.0, 0.0]])
    )
    assert m["rollout_is_seq_mean"] == pytest.approx(1.0)


def test_sequence_mask_action_counts_masked_tokens():
    w, m = importance_weights(SEQ_LR, SEQ_MASK, level="sequence", cap=3.0, action="mask")
    # row 0 (weight 4 > 3) is masked: its 2 tokens of 3 valid ones
    assert torch.allclose(w, t64([[0.0, 0.0, 0.0], [0.5, 0.0, 0.0], [0.0, 0.0, 0.0]]))
    assert m["rollout_is_masked_fraction"] == pytest.approx(2 / 3)


def test_mask_action_without_bounds_masks_nothing():
    w, m = importance_weights(TOKEN_LR, TOKEN_MASK, action="mask")
    assert torch.allclose(w, t64([[3.0, 0.25, 1.0, 0.0]]))
    assert m["rollout_is_masked_fraction"] == 0.0


# --- empty selections ---------------------------------------------------------------------


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
def test_empty_mask_gives_defined_metrics(level):
    lr = t64([[NAN, 5.0], [INF, -INF]])
    w, m = importance_weights(
        lr, torch.zeros(2, 2), level=level, cap=2.0, floor=0.5, action="mask", batch_normalize=True
    )
    assert torch.equal(w, torch.zeros(2, 2, dtype=torch.float64))
    assert m["rollout_is_eff_sample_size"] == 1.0  # empty batch: ESS 1
    assert m["rollout_is_seq_eff_sample_size"] == 1.0  # no sequence either: ESS 1
    assert m["rollout_is_batch_norm_factor"] == 1.0  # nothing to normalise
    others = {
        k: v
        for k, v in m.items()
        if k not in ("rollout_is_eff_sample_size", "rollout_is_seq_eff_sample_size", "rollout_is_batch_norm_factor")
    }
    assert all(v == 0.0 for v in others.values()), others


def test_every_weight_masked_gives_zero_ess_and_unit_factor():
    w, m = importance_weights(
        t64([[LN(5.0), LN(6.0)]]), t64([[1, 1]]), cap=2.0, action="mask", batch_normalize=True
    )
    assert torch.equal(w, t64([[0.0, 0.0]]))
    assert m["rollout_is_eff_sample_size"] == 0.0  # no effective sample left
    assert m["rollout_is_batch_norm_factor"] == 1.0


def test_single_token_std_is_zero():
    _, m = importance_weights(t64([[LN(1.5)]]), t64([[1]]))
    assert m["rollout_is_std"] == 0.0 and m["rollout_is_eff_sample_size"] == pytest.approx(1.0)


def test_a_floor_equal_to_the_cap_is_accepted_and_pins_every_weight():
    # floor ≤ cap is the rule, so floor = cap is allowed: every weight truncated to that value
    w, m = importance_weights(t64([[LN(0.5), LN(1.0), LN(3.0)]]), t64([[1, 1, 1]]), cap=1.2, floor=1.2)
    assert w[0].tolist() == pytest.approx([1.2, 1.2, 1.2])
    assert m["rollout_is_max"] == pytest.approx(1.2) and m["rollout_is_min"] == pytest.approx(1.2)


def test_mask_action_keeps_the_bounds_themselves():
    # [floor, cap] is closed (docs/math.md §2): w̃ = 2 = cap and w̃ = 0.5 = floor stay, only 3 is
    # masked; floor = cap = 1 (verl's rollout_is: null, the decoupled_k3_rs preset) keeps w̃ = 1.
    # exp(ln 2) and exp(ln 0.5) are exactly 2 and 0.5 in float64, so the bounds are hit exactly.
    w, m = importance_weights(
        t64([[0.0, LN(2.0), LN(0.5), LN(3.0)]]), t64([[1, 1, 1, 1]]), cap=2.0, floor=0.5, action="mask"
    )
    assert w[0].tolist() == [1.0, 2.0, 0.5, 0.0]
    assert m["rollout_is_ratio_fraction_high"] == 0.25 and m["rollout_is_ratio_fraction_low"] == 0.0
    w, m = importance_weights(t64([[0.0, 0.0]]), t64([[1, 1]]), cap=1.0, floor=1.0, action="mask")
    assert w[0].tolist() == [1.0, 1.0] and m["rollout_is_masked_fraction"] == 0.0
    # a row's mean raw weight on a bound is neither above the cap nor below the floor
    _, m = importance_weights(t64([[LN(2.0), NAN], [LN(0.5), NAN]]), t64([[1, 0], [1, 0]]), cap=2.0, floor=0.5)
    assert m["rollout_is_seq_fraction_high"] == 0.0 and m["rollout_is_seq_fraction_low"] == 0.0


# --- rejection_mask -----------------------------------------------------------------------


def test_token_rejection_keeps_ratios_inside_bounds():
    lr = t64([[LN(3.0), LN(0.4), 0.0, 99.0]])
    new, m = rejection_mask(lr, t64([[1, 1, 1, 0]]), level="token", upper=2.0)
    # lower defaults to 1/2: 3 > 2 and 0.4 < 0.5 are dropped; 1 is kept
    assert torch.equal(new, t64([[0, 0, 1, 0]]))
    assert m["rollout_rs_masked_fraction"] == pytest.approx(2 / 3)
    assert m["rollout_rs_seq_masked_fraction"] == 1.0  # the one sequence lost a token
    assert m["rollout_rs_mean"] == pytest.approx((3 + 0.4 + 1) / 3)
    assert m["rollout_rs_min"] == pytest.approx(0.4) and m["rollout_rs_max"] == pytest.approx(3.0)
    assert (
        m["rollout_rs_veto_fraction"] == 0.0 and m["rollout_rs_catastrophic_token_fraction"] == 0.0
    )


def test_rejection_keeps_statistics_on_the_bounds_and_vetoes_only_below_the_threshold():
    # [lower, upper] is closed (docs/math.md §3): ratios 2 = upper and 0.5 = lower are kept, 2.5 is not.
    # The veto drops a row holding lr < log(veto), strictly: lr = ln 0.25 = log(veto) stays.
    lr = t64([[LN(2.0), LN(0.5), LN(2.5)]])
    new, _ = rejection_mask(lr, t64([[1, 1, 1]]), level="token", upper=2.0, lower=0.5)
    assert torch.equal(new, t64([[1, 1, 0]]))
    for level in ("sequence", "geometric"):  # rows of one token: statistic = that ratio
        new, _ = rejection_mask(t64([[LN(2.0)], [LN(0.5)]]), t64([[1], [1]]), level=level, upper=2.0, lower=0.5)
        assert torch.equal(new, t64([[1], [1]])), level
    # a divergence is kept where ≤ upper: k2 = ½·1² = 0.5 = upper stays, ½·2² = 2 does not
    new, _ = rejection_mask(t64([[1.0, 2.0]]), t64([[1, 1]]), level="token", upper=0.5, metric="k2")
    assert torch.equal(new, t64([[1, 0]]))
    new, m = rejection_mask(t64([[LN(0.25), 0.0], [LN(0.2), 0.0]]), t64([[1, 1], [1, 1]]), veto=0.25)
    assert torch.equal(new, t64([[1, 1], [0, 0]]))
    assert m["rollout_rs_catastrophic_token_fraction"] == 0.25


def test_explicit_asymmetric_lower_bound():
    lr = t64([[LN(0.95), LN(0.85), LN(1.4)]])
    new, _ = rejection_mask(lr, t64([[1, 1, 1]]), level="token", upper=1.5, lower=0.9)
    # 0.95 ∈ [0.9, 1.5], 0.85 < 0.9 dropped, 1.4 kept
    assert torch.equal(new, t64([[1, 0, 1]]))


def test_geometric_and_sequence_rejection_act_on_whole_rows():
    # row 0: ratios 2 and 0.5 → product 1, geometric mean 1 → kept at both levels
    # row 1: ratio 4 → 4 > upper 3 → dropped
    # row 2: ratios 1.5, 1.5 → product 2.25 (kept, ≤ 3), geometric mean 1.5 (kept)
    lr = t64([[LN(2.0), LN(0.5)], [LN(4.0), NAN], [LN(1.5), LN(1.5)]])
    mask = t64([[1, 1], [1, 0], [1, 1]])
    for level in ("sequence", "geometric"):
        new, m = rejection_mask(lr, mask, level=level, upper=3.0)
        assert torch.equal(new, t64([[1, 1], [0, 0], [1, 1]])), level
        assert m["rollout_rs_masked_fraction"] == pytest.approx(1 / 5)
        assert m["rollout_rs_seq_masked_fraction"] == pytest.approx(1 / 3)
    _, geo = rejection_mask(lr, mask, level="geometric", upper=3.0)
    assert geo["rollout_rs_mean"] == pytest.approx((1 + 4 + 1.5) / 3)  # mean over sequences
    # a tighter upper bound drops the row whose product is 2.25 but not its geometric mean 1.5
    new, _ = rejection_mask(lr, mask, level="sequence", upper=2.0)
    assert torch.equal(new, t64([[1, 1], [0, 0], [0, 0]]))
    new, _ = rejection_mask(lr, mask, level="geometric", upper=2.0)
    assert torch.equal(new, t64([[1, 1], [0, 0], [1, 1]]))


def test_veto_drops_sequence_with_a_catastrophic_token_using_raw_log_ratio():
    # row 0: lr −25 and +25 → geometric mean 0, ratio 1, kept by RS; but −25 < log(e^-22)
    #        (after the ±20 clamp it would be −20 and survive: the veto must read raw lr)
    # row 1: lr 0 → kept; row 2: padding with −inf must not trigger the veto
    lr = t64([[-25.0, 25.0], [0.0, -INF], [-INF, -INF]])
    mask = t64([[1, 1], [1, 0], [0, 0]])
    new, m = rejection_mask(lr, mask, level="geometric", upper=2.0, veto=math.exp(-22))
    assert torch.equal(new, t64([[0, 0], [1, 0], [0, 0]]))
    assert m["rollout_rs_veto_fraction"] == pytest.approx(1 / 2)  # 1 of 2 non-empty rows
    assert m["rollout_rs_catastrophic_token_fraction"] == pytest.approx(1 / 3)  # 1 of 3 tokens
    assert m["rollout_rs_masked_fraction"] == pytest.approx(2 / 3)


def test_veto_alone_needs_no_bounds():
    # verl's token veto: a row is dropped when a valid token has raw lr < log(veto), here
    # log(1e-4) = −9.21; no ratio bound applies, so row 1's lr of ±9 survives
    # row 0: −9.5 < −9.21 → dropped; row 1: −9 and +9 → kept; row 2: −inf at padding → kept
    lr = t64([[-9.5, 0.0, 3.0], [-9.0, 9.0, 0.0], [0.0, -INF, NAN]])
    mask = t64([[1, 1, 1], [1, 1, 1], [1, 0, 0]])
    new, m = rejection_mask(lr, mask, veto=1e-4)
    assert torch.equal(new, t64([[0, 0, 0], [1, 1, 1], [1, 0, 0]]))
    assert m == {
        "rollout_rs_masked_fraction": pytest.approx(3 / 7),  # row 0's 3 of 7 valid tokens
        "rollout_rs_seq_masked_fraction": pytest.approx(1 / 3),
        "rollout_rs_veto_fraction": pytest.approx(1 / 3),
        "rollout_rs_catastrophic_token_fraction": pytest.approx(1 / 7),
    }


@pytest.mark.parametrize(
    "dtype", [torch.bool, torch.int64, torch.uint8, torch.float32, torch.float64]
)
def test_rejection_keeps_the_mask_dtype(dtype):
    lr = t64([[LN(3.0), 0.0]])
    new, _ = rejection_mask(lr, torch.tensor([[1, 1]]).to(dtype), level="token", upper=2.0)
    assert new.dtype == dtype
    assert new.tolist() == torch.tensor([[0, 1]]).to(dtype).tolist()


def test_rejection_of_empty_mask_is_defined():
    new, m = rejection_mask(
        t64([[NAN, INF]]), t64([[0, 0]]), level="sequence", upper=2.0, veto=1e-4
    )
    assert torch.equal(new, t64([[0, 0]]))
    assert all(v == 0.0 for v in m.values()), m


def test_a_lower_bound_equal_to_the_upper_keeps_only_that_ratio():
    # lower ≤ upper is the rule, so lower = upper is allowed: only a ratio of exactly that value stays
    lr = t64([[0.0, LN(1.5), LN(0.5)]])
    new, _ = rejection_mask(lr, t64([[1, 1, 1]]), level="token", upper=1.0, lower=1.0)
    assert torch.equal(new, t64([[1, 0, 0]]))


def test_rows_without_tokens_at_level_max_give_no_nan():
    # no column at all: a row's largest divergence is 0 (every estimate is ≥ 0), so nothing is dropped
    new, m = rejection_mask(torch.zeros(2, 0, dtype=torch.float64), torch.zeros(2, 0), level="max", upper=0.1, metric="k2")
    assert new.shape == (2, 0)
    assert not any(math.isnan(v) for v in m.values()), m
