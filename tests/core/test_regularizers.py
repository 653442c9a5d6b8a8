"""KL-to-reference estimators and the entropy bonus (sdp_cli/core/regularizers.py, docs/math.md §8)
against hand-computed values of verl's kl_penalty formulas."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from sdp_cli.core.regularizers import KL_TYPES, kl_penalty, regularizer_loss

LN2 = math.log(2.0)


def _pair(lp, ref):
    return torch.tensor([lp], dtype=torch.float64, requires_grad=True), torch.tensor([ref], dtype=torch.float64)


@pytest.mark.parametrize(
    "kl_type, value, grad",
    [
        # π_θ = 1/2, π_ref = 1/4 → d = log π_θ − log π_ref = ln 2
        ("k1", LN2, 1.0),  # k1 = d; ∂/∂lp = 1
        ("k2", 0.5 * LN2**2, LN2),  # ½d² = 0.2402; ∂/∂lp = d
        # e^{−d} + d − 1 = ½ + ln 2 − 1 = 0.1931; ∂/∂lp = 1 − e^{−d} = 1 − π_ref/π_θ = ½
        ("k3", 0.5 + LN2 - 1, 0.5),
        ("low_var_kl", 0.5 + LN2 - 1, 0.5),
    ],
)
def test_hand_values_and_gradients(kl_type, value, grad):
    lp, ref = _pair(math.log(0.5), math.log(0.25))
    kl = kl_penalty(lp, ref, kl_type)
    kl.sum().backward()
    assert kl.item() == pytest.approx(value, rel=1e-12)
    assert lp.grad.item() == pytest.approx(grad, rel=1e-12)


def test_k3_below_the_reference():
    # π_θ = 1/4, π_ref = 1/2 → d = −ln 2: e^{ln 2} − ln 2 − 1 = 2 − 0.6931 − 1 = 0.3069
    lp, ref = _pair(math.log(0.25), math.log(0.5))
    assert kl_penalty(lp, ref, "k3").item() == pytest.approx(1 - LN2, rel=1e-12)
    # k1 is negative there; k2 is the same as above
    assert kl_penalty(lp, ref, "k1").item() == pytest.approx(-LN2, rel=1e-12)
    assert kl_penalty(lp, ref, "k2").item() == pytest.approx(0.5 * LN2**2, rel=1e-12)


def test_k3_is_clamped_like_verl():
    # d = −30: −d clamps to 20, e^20 − 20 − 1 ≈ 4.85e8 clamps to 10, and the clamp stops the gradient
    lp, ref = _pair(-31.0, -1.0)
    kl = kl_penalty(lp, ref, "low_var_kl")
    kl.sum().backward()
    assert kl.item() == 10.0
    assert lp.grad.item() == 0.0


def test_reference_gets_no_gradient():
    lp = torch.tensor([-1.0], requires_grad=True)
    ref = torch.tensor([-2.0], requires_grad=True)
    kl_penalty(lp, ref, "k2").sum().backward()
    assert ref.grad is None and lp.grad.item() == pytest.approx(1.0)


# logits in [−½, ½] keep |d| ≤ 2, so k3 ≤ e² − 3 < 10 stays clear of its clamp
@given(
    st.lists(st.floats(-0.5, 0.5), min_size=2, max_size=6),
    st.lists(st.floats(-0.5, 0.5), min_size=6, max_size=6),
)
def test_k1_and_k3_are_unbiased_over_the_whole_distribution(logits_p, logits_q):
    # E_{y~π}[k1(y)] = E_{y~π}[k3(y)] = KL(π ‖ π_ref) exactly (k3: Σ π·(π_ref/π) = 1), and E[k2] ≥ 0
    v = len(logits_p)
    log_p = torch.log_softmax(torch.tensor(logits_p, dtype=torch.float64), -1)
    log_q = torch.log_softmax(torch.tensor(logits_q[:v], dtype=torch.float64), -1)
    p = log_p.exp()
    exact = float((p * (log_p - log_q)).sum())
    for kl_type in ("k1", "k3"):
        assert float((p * kl_penalty(log_p, log_q, kl_type)).sum()) == pytest.approx(exact, abs=1e-9)
    assert float((p * kl_penalty(log_p, log_q, "k2")).sum()) >= 0


def _batch():
    lp = torch.log(torch.tensor([[0.5, 0.25, 0.5], [0.25, 0.5, 0.9]], dtype=torch.float64)).requires_grad_(True)
    ref = torch.log(torch.tensor([[0.25, 0.25, 0.5], [0.5, 0.5, 0.1]], dtype=torch.float64))
    ent = torch.tensor([[1.0, 2.0, 0.0], [3.0, 4.0, 9.0]], dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])  # the third column is padding
    return lp, ref, ent, mask


def test_regularizer_loss_token_mean():
    lp, ref, ent, mask = _batch()
    term, metrics = regularizer_loss(
        lp, mask, ref_logprobs=ref, entropy=ent, kl_coef=0.1, kl_type="k1", entropy_coef=0.01
    )
    # k1 at the valid tokens: ln 2, 0, −ln 2, 0 → token mean 0
    assert metrics["kl_ref"] == pytest.approx(0.0, abs=1e-12)
    # entropy token mean (1 + 2 + 3 + 4) / 4 = 2.5
    assert metrics["entropy"] == pytest.approx(2.5)
    # 0.1·0 − 0.01·2.5 = −0.025
    assert term.item() == pytest.approx(-0.025)
    term.backward()
    # ∂/∂lp of 0.1·mean(k1) = 0.1 / 4 at each valid token, 0 at padding
    expected = torch.tensor([[0.025, 0.025, 0.0], [0.025, 0.025, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(lp.grad, expected)
    # ∂/∂H of −0.01·mean(H) = −0.01 / 4
    torch.testing.assert_close(ent.grad, -expected / 10)


def test_regularizer_loss_follows_the_aggregation():
    lp, ref, ent, mask = _batch()
    mask = torch.tensor([[1, 0, 0], [1, 1, 1]])
    _, metrics = regularizer_loss(lp, mask, ref_logprobs=ref, entropy=ent, kl_type="k2", agg="seq-mean-token-mean")
    # k2 = ½d²: row 0 [ln 2] → ½ln²2; row 1 [ln 2, 0, ln 9] → (½ln²2 + 0 + ½ln²9) / 3
    k2_row0 = 0.5 * LN2**2
    k2_row1 = (0.5 * LN2**2 + 0.5 * math.log(9.0) ** 2) / 3
    assert metrics["kl_ref"] == pytest.approx((k2_row0 + k2_row1) / 2)
    # entropy rows: [1] → 1; [3, 4, 9] → 16/3; mean of rows (1 + 16/3) / 2 = 19/6
    assert metrics["entropy"] == pytest.approx(19 / 6)


def test_zero_coefficients_add_nothing_but_still_report():
    lp, ref, ent, mask = _batch()
    term, metrics = regularizer_loss(lp, mask, ref_logprobs=ref, entropy=ent)
    assert term.item() == 0.0 and set(metrics) == {"kl_ref", "entropy"}
    term, metrics = regularizer_loss(lp, mask)
    assert term.item() == 0.0 and metrics == {}


def test_bad_arguments_are_refused():
    lp, ref, ent, mask = _batch()
    with pytest.raises(ValueError, match="kl_type must be one of"):
        kl_penalty(lp, ref, "k4")
    with pytest.raises(ValueError, match="needs ref_logprobs"):
        regularizer_loss(lp, mask, kl_coef=0.1)
    with pytest.raises(ValueError, match="needs entropy"):
        regularizer_loss(lp, mask, entropy_coef=0.1)
    with pytest.raises(ValueError, match="kl_coef must be >= 0"):
        regularizer_loss(lp, mask, ref_logprobs=ref, kl_coef=-1.0)
    assert set(KL_TYPES) == {"k1", "k2", "k3", "low_var_kl"}


def test_an_explicit_denominator_replaces_the_batch_count():
    # data-parallel shards divide by the whole minibatch's count; Dr.GRPO by its constant
    lp, ref, ent, mask = _batch()
    _, metrics = regularizer_loss(lp, mask, ref_logprobs=ref, entropy=ent, kl_type="k2", denominator=10.0)
    # k2 at the valid tokens: ½ln²2, 0, ½ln²2, 0 → sum ln²2, over 10
    assert metrics["kl_ref"] == pytest.approx(LN2**2 / 10)
    # entropy sum 1 + 2 + 3 + 4 = 10, over 10
    assert metrics["entropy"] == pytest.approx(1.0)
    _, metrics = regularizer_loss(
        lp, mask, entropy=ent, agg="seq-mean-token-sum-norm", denominator=4.0
    )
    # row sums 3 and 7, over the constant 4
    assert metrics["entropy"] == pytest.approx(2.5)
