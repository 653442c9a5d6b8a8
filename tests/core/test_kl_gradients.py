"""Expected gradients of the KL estimators as loss terms (docs/math.md §8), on a categorical
π_θ = softmax(θ), by exact enumeration of its support and torch autograd.

The gradient of an estimator k(y) is taken through the explicit log π_θ(y) only (the sampled y
is fixed, as in the trainer), and its expectation is Σ_y q(y)·∇k(y) for the sampling
distribution q. The references are the closed forms for a softmax, derived in §8:

    ∇_θ KL(π_θ ‖ π_ref) = π_θ ⊙ (log π_θ − log π_ref − KL(π_θ ‖ π_ref))
    ∇_θ KL(π_ref ‖ π_θ) = π_θ − π_ref
"""

import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from sdp_cli.core.regularizers import KL_CLAMP, kl_penalty

K = 6


def _expected_gradient(theta: torch.Tensor, ref_logprobs: torch.Tensor, q: torch.Tensor, kl_type: str, weight=None):
    """Σ_y q(y)·w(y)·∇_θ k(y) (w = 1 unless given), every support element one sampled token."""
    theta = theta.clone().requires_grad_(True)
    logprobs = torch.log_softmax(theta, 0)
    k = kl_penalty(logprobs, ref_logprobs, kl_type)
    w = torch.ones_like(q) if weight is None else weight
    (q * w * k).sum().backward()
    return theta.grad


def _forward_kl_gradient(theta: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    p = torch.softmax(theta, 0)
    log_ratio = torch.log(p) - ref_logprobs
    return p * (log_ratio - (p * log_ratio).sum())


def _reverse_kl_gradient(theta: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    return torch.softmax(theta, 0) - ref_logprobs.exp()


logits = st.lists(st.floats(-2.0, 2.0), min_size=K, max_size=K).map(lambda v: torch.tensor(v, dtype=torch.float64))


@settings(max_examples=50, deadline=None)
@given(theta=logits, ref=logits, behav=logits)
def test_expected_gradients_on_policy_and_under_the_behaviour_policy(theta, ref, behav):
    ref_logprobs = torch.log_softmax(ref, 0)
    p = torch.softmax(theta, 0)
    # k3's clamp at 10 (π_ref/π_θ above about 12.4) zeroes its gradient there: §8 is about the unclamped estimator
    assume(bool((kl_penalty(torch.log(p), ref_logprobs, "k3") < KL_CLAMP).all()))
    forward = _forward_kl_gradient(theta, ref_logprobs)
    reverse = _reverse_kl_gradient(theta, ref_logprobs)
    # the two closed forms against autograd of the exact divergences
    t = theta.clone().requires_grad_(True)
    lp = torch.log_softmax(t, 0)
    (lp.exp() * (lp - ref_logprobs)).sum().backward()
    torch.testing.assert_close(t.grad, forward, rtol=0, atol=1e-12)
    t = theta.clone().requires_grad_(True)
    (ref_logprobs.exp() * (ref_logprobs - torch.log_softmax(t, 0))).sum().backward()
    torch.testing.assert_close(t.grad, reverse, rtol=0, atol=1e-12)

    # y ~ π_θ: k1's expected gradient is E[∇log π_θ] = 0, k2's the forward KL's, k3's the reverse KL's
    zero = torch.zeros(K, dtype=torch.float64)
    torch.testing.assert_close(_expected_gradient(theta, ref_logprobs, p, "k1"), zero, rtol=0, atol=1e-12)
    torch.testing.assert_close(_expected_gradient(theta, ref_logprobs, p, "k2"), forward, rtol=0, atol=1e-12)
    for name in ("k3", "low_var_kl"):
        torch.testing.assert_close(_expected_gradient(theta, ref_logprobs, p, name), reverse, rtol=0, atol=1e-12)

    # y ~ π_behav without a weight (the trainer's regulariser): k1's is π_behav − π_θ = −∇KL(π_behav ‖ π_θ)
    q = torch.softmax(behav, 0)
    torch.testing.assert_close(_expected_gradient(theta, ref_logprobs, q, "k1"), q - p, rtol=0, atol=1e-12)
    # with the per-token weight π_θ/π_behav every on-policy result is back
    w = p / q
    torch.testing.assert_close(_expected_gradient(theta, ref_logprobs, q, "k1", w), zero, rtol=0, atol=1e-12)
    torch.testing.assert_close(_expected_gradient(theta, ref_logprobs, q, "k2", w), forward, rtol=0, atol=1e-10)
    torch.testing.assert_close(_expected_gradient(theta, ref_logprobs, q, "k3", w), reverse, rtol=0, atol=1e-10)


def test_the_two_divergences_have_different_gradients_so_the_checks_can_fail():
    """A fixed case by hand: π_θ = (0.5, 0.3, 0.2), π_ref uniform over 3.
    forward: log ratios L = log 1.5, log 0.9, log 0.6 = 0.405465, −0.105361, −0.510826;
    KL = 0.5·0.405465 + 0.3·(−0.105361) + 0.2·(−0.510826) = 0.068959;
    ∇ = π ⊙ (L − KL) = (0.168253, −0.052296, −0.115957).
    reverse: π − π_ref = (0.5 − 1/3, 0.3 − 1/3, 0.2 − 1/3) = (1/6, −1/30, −2/15).
    E[k2] = ½ Σ π L² = ½ (0.5·0.164402 + 0.3·0.011101 + 0.2·0.260943) = 0.068860 ≠ KL."""
    theta = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64).log()
    ref_logprobs = torch.full((3,), 1 / 3, dtype=torch.float64).log()
    p = torch.softmax(theta, 0)
    k2 = _expected_gradient(theta, ref_logprobs, p, "k2")
    k3 = _expected_gradient(theta, ref_logprobs, p, "k3")
    torch.testing.assert_close(k2, torch.tensor([0.168253, -0.052296, -0.115957], dtype=torch.float64), rtol=0, atol=1e-6)
    torch.testing.assert_close(k3, torch.tensor([1 / 6, -1 / 30, -2 / 15], dtype=torch.float64), rtol=0, atol=1e-6)
    # as values, k1 and k3 average to KL(π_θ ‖ π_ref) = 0.068959 exactly, k2 to 0.068860
    lp = torch.log_softmax(theta, 0)
    for name, expected in (("k1", 0.068959), ("k3", 0.068959), ("k2", 0.068860)):
        assert abs(float((p * kl_penalty(lp, ref_logprobs, name)).sum()) - expected) < 1e-6
