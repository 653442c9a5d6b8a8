"""Hand-computed checks of sdp_cli.core.loss (docs/math.md §5)."""

import math

import pytest
import torch

from sdp_cli.choices import LOSS_AGGS
from sdp_cli.core.loss import aggregate_loss, loss_count, policy_loss

LN = math.log
NAN, INF = float("nan"), float("inf")


def t64(rows):
    return torch.tensor(rows, dtype=torch.float64)


# Four tokens, ε = 0.2 (anchor = proximal logprobs 0, so lp = log r):
#   a: A = +1, r = 1.5 → −A·r = −1.5, −A·clip(r) = −1.2 → ℓ = −1.2 (clipped high)
#   b: A = −1, r = 0.5 → 0.5 vs 0.8                     → ℓ = 0.8  (clipped low)
#   c: A = +2, r = 1   → −2 vs −2                        → ℓ = −2   (not clipped)
#   d: A = −1, r = 4   → 4 vs 1.2                        → ℓ = 4    (not clipped; dual clip 3 binds)
LP = [LN(1.5), LN(0.5), 0.0, LN(4.0)]
ADV = [1.0, -1.0, 2.0, -1.0]


def run(lp=LP, adv=ADV, mask=None, weights=None, **kwargs):
    logprobs = t64([lp]).requires_grad_(True)
    mask = t64([[1] * len(lp)]) if mask is None else mask
    w = None if weights is None else t64([weights])
    loss, metrics = policy_loss(
        logprobs, torch.zeros_like(logprobs), t64([adv]), mask, weights=w, **kwargs
    )
    loss.backward()
    return loss.item(), metrics, logprobs.grad[0].tolist()


def test_ppo_clip_hand_values():
    loss, m, grad = run()
    assert loss == pytest.approx((-1.2 + 0.8 - 2 + 4) / 4)  # 0.4
    assert m["pg_loss"] == pytest.approx(0.4)
    assert m["pg_clipfrac"] == 0.5  # a and b
    assert m["pg_clipfrac_high"] == 0.25 and m["pg_clipfrac_low"] == 0.25
    assert m["pg_clipfrac_dual"] == 0.0
    # ppo_kl = mean(prox − lp) = −(ln 1.5 + ln 0.5 + 0 + ln 4) / 4 = −ln 3 / 4
    assert m["ppo_kl"] == pytest.approx(-LN(3.0) / 4)
    # dℓ/dlp = −A·r on unclipped tokens, 0 on clipped ones; token-mean divides by 4
    assert grad == pytest.approx([0.0, 0.0, -2.0 / 4, 4.0 / 4])


def test_dual_clip_bounds_negative_advantage_loss():
    loss, m, grad = run(dual_clip=3.0)
    # token d: min(4, 3·|−1|) = 3 and its gradient stops
    assert loss == pytest.approx((-1.2 + 0.8 - 2 + 3) / 4)
    assert m["pg_clipfrac_dual"] == 0.25
    assert grad == pytest.approx([0.0, 0.0, -0.5, 0.0])


def test_dual_clip_never_touches_positive_advantages():
    # A = +1, r = 0.1: ℓ = max(−0.1, −0.8) = −0.1; c·|A| = 1.5 would not bind anyway
    # A = +5, r = 1: ℓ = −5 ≤ 0 ≤ c·|A|
    loss, m, _ = run(lp=[LN(0.1), 0.0], adv=[1.0, 5.0], dual_clip=1.5)
    assert loss == pytest.approx((-0.1 - 5.0) / 2)
    assert m["pg_clipfrac_dual"] == 0.0


def test_clip_higher_widens_only_the_upper_side():
    # ε_high = 0.6: token a's r = 1.5 < 1.6 is no longer clipped: ℓ = −1.5, grad −1.5 / 4
    loss, m, grad = run(clip_high=0.6)
    assert loss == pytest.approx((-1.5 + 0.8 - 2 + 4) / 4)
    assert m["pg_clipfrac_high"] == 0.0 and m["pg_clipfrac_low"] == 0.25
    assert grad[0] == pytest.approx(-1.5 / 4)


def test_weights_multiply_the_per_token_loss_and_gradient():
    loss, _, grad = run(weights=[2.0, 1.0, 0.5, 3.0])
    # ℓ·w = [−2.4, 0.8, −1, 12]; gradients [0, 0, −2·0.5, 4·3] / 4
    assert loss == pytest.approx((-2.4 + 0.8 - 1.0 + 12.0) / 4)
    assert grad == pytest.approx([0.0, 0.0, -0.25, 3.0])


def test_reinforce_is_minus_advantage_times_logprob():
    loss, m, grad = run(loss_type="reinforce", weights=[2.0, 1.0, 1.0, 1.0])
    # ℓ = −A·lp·w: a −1·ln 1.5·2, b +1·ln 0.5, c −2·0, d +1·ln 4
    expected = (-2 * LN(1.5) + LN(0.5) + 0.0 + LN(4.0)) / 4
    assert loss == pytest.approx(expected)
    assert grad == pytest.approx([-2.0 / 4, 1.0 / 4, -2.0 / 4, 1.0 / 4])  # −A·w / n
    assert m["pg_clipfrac"] == 0.0 and m["pg_clipfrac_dual"] == 0.0


def test_log_ratio_is_clamped_at_20():
    # A = −1, lp − prox = 30 → r = e^20 (not e^30); the clamp also stops the gradient
    loss, _, grad = run(lp=[30.0], adv=[-1.0])
    assert loss == pytest.approx(math.exp(20))
    assert grad == [0.0]


# Per-token losses [1, 2, 3 | 4 | –]: rows of 3, 1 and 0 valid tokens, T = 3.
AGG_VALUES = t64([[1.0, 2.0, 3.0], [4.0, NAN, INF], [INF, NAN, -INF]])
AGG_MASK = t64([[1, 1, 1], [1, 0, 0], [0, 0, 0]])


@pytest.mark.parametrize(
    ("agg", "expected"),
    [
        ("token-mean", 10 / 4),  # Σℓ / 4 valid tokens
        ("seq-mean-token-sum", (6 + 4) / 2),  # mean over the 2 non-empty rows of row sums
        ("seq-mean-token-mean", (2 + 4) / 2),  # mean over rows of row means
    ],
)
def test_aggregations(agg, expected):
    assert aggregate_loss(AGG_VALUES, AGG_MASK, agg).item() == pytest.approx(expected)


def test_seq_mean_token_sum_norm_divides_the_sum_of_row_sums_by_its_constant():
    # (6 + 4) / 8: no row count, no padded width (T = 3 here) in the denominator
    loss = aggregate_loss(AGG_VALUES, AGG_MASK, "seq-mean-token-sum-norm", denominator=8.0)
    assert loss.item() == pytest.approx(10 / 8)


def test_the_norm_constant_ignores_prompt_columns_and_other_rows():
    # The same two responses behind 2 or 37 masked prompt columns, and with a third row of
    # zero loss (a zero-advantage group): the loss stays (6 + 4) / 8 in every case.
    def padded(prefix, extra_row=False):
        rows = [[0.0] * prefix + [1.0, 2.0, 3.0], [0.0] * prefix + [4.0, 0.0, 0.0]]
        mask = [[0] * prefix + [1, 1, 1], [0] * prefix + [1, 0, 0]]
        if extra_row:
            rows.append([0.0] * prefix + [0.0, 0.0, 0.0])
            mask.append([0] * prefix + [1, 1, 1])
        return t64(rows), t64(mask)

    for prefix, extra in ((2, False), (37, False), (2, True)):
        values, mask = padded(prefix, extra)
        loss = aggregate_loss(values, mask, "seq-mean-token-sum-norm", denominator=8.0)
        assert loss.item() == pytest.approx(10 / 8), (prefix, extra)


@pytest.mark.parametrize(
    ("agg", "expected"),
    [
        ("token-mean", 10 / 5),  # Σℓ = 10 over the 5 tokens of the whole minibatch
        ("seq-mean-token-sum", 10 / 5),  # row sums 6 + 4 over 5 rows
        ("seq-mean-token-mean", 6 / 5),  # row means 2 + 4 over 5 rows
    ],
)
def test_a_given_denominator_replaces_the_batch_count(agg, expected):
    loss = aggregate_loss(AGG_VALUES, AGG_MASK, agg, denominator=torch.tensor(5.0))
    assert loss.item() == pytest.approx(expected)


def test_loss_count_is_tokens_or_non_empty_rows():
    assert loss_count(AGG_MASK, "token-mean").item() == 4.0  # 3 + 1 valid tokens
    assert loss_count(AGG_MASK, "seq-mean-token-sum").item() == 2.0  # the empty row is not a row
    assert loss_count(AGG_MASK, "seq-mean-token-mean").item() == 2.0
    assert loss_count(AGG_MASK[2:], "token-mean").item() == 0.0  # no floor: shards add up


@pytest.mark.parametrize("agg", LOSS_AGGS)
def test_shards_with_the_global_denominator_add_up_to_the_whole(agg):
    # Data-parallel invariant (docs/math.md §5.2): split the rows into shards, give every
    # shard the count of the whole (the sum of the shards' counts), and the shard losses and
    # their gradients sum to the loss and gradient of the whole batch.
    gen = torch.Generator().manual_seed(5)
    lp = torch.randn(5, 4, generator=gen, dtype=torch.float64) * 0.3
    prox = torch.randn(5, 4, generator=gen, dtype=torch.float64) * 0.3
    adv = torch.randn(5, 4, generator=gen, dtype=torch.float64)
    mask = t64([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1], [0, 1, 1, 0]])

    def loss_of(rows, denominator):
        x = lp[rows].clone().requires_grad_(True)
        loss, _ = policy_loss(
            x, prox[rows], adv[rows], mask[rows], agg=agg, denominator=denominator
        )
        loss.backward()
        return loss, x.grad

    norm = agg == "seq-mean-token-sum-norm"
    everything = [0, 1, 2, 3, 4]
    whole, whole_grad = loss_of(everything, 9.0 if norm else None)
    shards = [[0, 2, 4], [1, 3]]
    total = 9.0 if norm else sum(loss_count(mask[rows], agg) for rows in shards)
    parts = [loss_of(rows, total) for rows in shards]
    assert sum(p[0] for p in parts).item() == pytest.approx(whole.item(), rel=1e-12)
    grad = torch.zeros_like(lp)
    for rows, (_, g) in zip(shards, parts):
        grad[rows] = g
    torch.testing.assert_close(grad, whole_grad, rtol=1e-12, atol=1e-15)


def test_policy_loss_uses_the_same_aggregation():
    # reinforce with A = −1 and lp = value gives ℓ = value; compare to aggregate_loss
    lp = t64([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = t64([[1, 1, 1], [1, 0, 0]])
    for agg in LOSS_AGGS:
        denominator = 6.0 if agg == "seq-mean-token-sum-norm" else None
        loss, _ = policy_loss(
            lp, lp, -torch.ones_like(lp), mask, agg=agg, loss_type="reinforce", denominator=denominator
        )
        expected = aggregate_loss(lp, mask, agg, denominator=denominator)
        assert loss.item() == pytest.approx(expected.item()), agg


def test_all_masked_batch_gives_zero_loss_with_a_gradient_path():
    lp = t64([[NAN, 3.0]]).requires_grad_(True)
    loss, m = policy_loss(
        lp, t64([[INF, -INF]]), t64([[NAN, 1e30]]), t64([[0, 0]]), weights=t64([[NAN, INF]])
    )
    assert loss.item() == 0.0 and loss.requires_grad
    loss.backward()
    assert torch.equal(lp.grad, torch.zeros_like(lp))
    assert m == {
        "pg_loss": 0.0,
        "pg_clipfrac": 0.0,
        "pg_clipfrac_high": 0.0,
        "pg_clipfrac_low": 0.0,
        "pg_clipfrac_dual": 0.0,
        "ppo_kl": 0.0,
    }


def test_padding_garbage_changes_nothing():
    mask = t64([[1, 1, 1, 1, 0, 0]])
    clean = run(
        lp=LP + [0.0, 0.0], adv=ADV + [0.0, 0.0], mask=mask, dual_clip=3.0, weights=[1.0] * 6
    )
    dirty = run(
        lp=LP + [NAN, 1e30],
        adv=ADV + [INF, -1e30],
        mask=mask,
        dual_clip=3.0,
        weights=[1.0] * 4 + [NAN, INF],
    )
    assert clean[0] == dirty[0] and clean[1] == dirty[1]
    assert clean[2] == dirty[2] and dirty[2][4:] == [0.0, 0.0]


def test_float32_in_float32_out():
    lp = torch.zeros(2, 3, requires_grad=True)
    loss, _ = policy_loss(
        lp, torch.zeros(2, 3), torch.ones(2, 3), torch.ones(2, 3, dtype=torch.bool)
    )
    assert loss.dtype == torch.float32
    loss.backward()
    assert lp.grad.dtype == torch.float32


@pytest.mark.parametrize("loss_type", ["ppo_clip", "reinforce"])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_gradcheck(loss_type, agg):
    gen = torch.Generator().manual_seed(3)
    lp = (torch.randn(3, 5, generator=gen, dtype=torch.float64) * 0.5).requires_grad_(True)
    prox = torch.randn(3, 5, generator=gen, dtype=torch.float64) * 0.5
    adv = torch.randn(3, 5, generator=gen, dtype=torch.float64)
    w = torch.rand(3, 5, generator=gen, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 0, 0, 0, 0], [0, 0, 0, 0, 0]], dtype=torch.bool)

    def loss(x):
        return policy_loss(
            x, prox, adv, mask, weights=w, dual_clip=2.0, agg=agg, loss_type=loss_type
        )[0]

    assert torch.autograd.gradcheck(loss, (lp,))
