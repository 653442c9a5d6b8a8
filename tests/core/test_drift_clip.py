"""The drift-clipped segment-wise weight (docs/math.md §1.1):

    w = (π_{v+1}/π_v) · clip(π_prox/π_{v+1}, 1/κ, κ),   in log space
    lr = (log π_prox_t − log π_behav) + clamp(log π_prox − log π_prox_t, −log κ, log κ)

Hand-computed values, the two limits (κ = 1 is segment-wise, κ = ∞ decoupled) bit for bit at
every level, and no gradient through the weight.
"""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from sdp_cli.core.weights import behavior_log_ratio, drift_log_factor, importance_weights

LN = math.log
LEVELS = ("token", "sequence", "geometric")


def t64(rows):
    return torch.tensor(rows, dtype=torch.float64)


def test_hand_computed_token_values():
    # token 0: π_{v+1}/π_v = 1.5, d = π_prox/π_{v+1} = 1.2 inside [1/2, 2] → w = 1.5·1.2 = 1.8
    # token 1: π_{v+1}/π_v = 0.8, d = 3 → clipped to 2 → w = 1.6
    # token 2: π_{v+1}/π_v = 1,   d = 0.1 → clipped to 1/2 → w = 0.5
    old = t64([[LN(0.2), LN(0.5), LN(0.4)]])
    prox_t = t64([[LN(0.3), LN(0.4), LN(0.4)]])
    prox = t64([[LN(0.36), LN(1.2), LN(0.04)]])
    lr = behavior_log_ratio(old, prox, prox_t, mode="segment_wise", drift_clip=2.0)
    assert torch.allclose(lr.exp(), t64([[1.8, 1.6, 0.5]]), rtol=1e-12)
    log_d, clipped = drift_log_factor(prox, prox_t, 2.0)
    assert clipped.tolist() == [[False, True, True]]
    assert torch.allclose(log_d.exp(), t64([[1.2, 2.0, 0.5]]), rtol=1e-12)


def test_sequence_and_geometric_aggregate_the_log_of_the_whole_product():
    # Row of two tokens with κ = 2: token weights 1.8 and 1.6 (as above, d clipped on token 1).
    # sequence: w = 1.8·1.6 = 2.88; geometric: w = sqrt(2.88).
    old = t64([[LN(0.2), LN(0.5)]])
    prox_t = t64([[LN(0.3), LN(0.4)]])
    prox = t64([[LN(0.36), LN(1.2)]])
    mask = t64([[1, 1]])
    lr = behavior_log_ratio(old, prox, prox_t, mode="segment_wise", drift_clip=2.0)
    seq, _ = importance_weights(lr, mask, level="sequence")
    geo, _ = importance_weights(lr, mask, level="geometric")
    assert torch.allclose(seq, t64([[2.88, 2.88]]), rtol=1e-12)
    assert torch.allclose(geo, t64([[math.sqrt(2.88)] * 2]), rtol=1e-12)


def _random_batch(seed):
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(5, 7, generator=gen, dtype=torch.float64) * 3
    prox_t = old + 0.4 * torch.randn(5, 7, generator=gen, dtype=torch.float64)
    prox = prox_t + 0.8 * torch.randn(5, 7, generator=gen, dtype=torch.float64)
    mask = torch.arange(7) < torch.randint(0, 8, (5,), generator=gen)[:, None]
    return old, prox, prox_t, mask


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("seed", range(4))
def test_kappa_one_is_segment_wise_bit_for_bit(level, seed):
    old, prox, prox_t, mask = _random_batch(seed)
    drift = behavior_log_ratio(old, prox, prox_t, mode="segment_wise", drift_clip=1.0)
    plain = behavior_log_ratio(old, prox, prox_t, mode="segment_wise")
    assert torch.equal(drift, plain)
    w_drift, m_drift = importance_weights(drift, mask, level=level, cap=5.0, floor=0.2)
    w_plain, m_plain = importance_weights(plain, mask, level=level, cap=5.0, floor=0.2)
    assert torch.equal(w_drift, w_plain) and m_drift == m_plain


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("seed", range(4))
def test_kappa_infinity_is_decoupled_bit_for_bit(level, seed):
    old, prox, prox_t, mask = _random_batch(seed)
    drift = behavior_log_ratio(old, prox, prox_t, mode="segment_wise", drift_clip=math.inf)
    decoupled = behavior_log_ratio(old, prox, mode="decoupled")
    assert torch.equal(drift, decoupled)
    w_drift, _ = importance_weights(drift, mask, level=level, cap=5.0)
    w_dec, _ = importance_weights(decoupled, mask, level=level, cap=5.0)
    assert torch.equal(w_drift, w_dec)


@given(
    st.floats(-5, 0), st.floats(-5, 0), st.floats(-5, 0), st.floats(1.0, 10.0, allow_nan=False)
)
def test_weight_lies_between_the_segment_wise_weight_times_the_bounds(old, prox_t, prox, kappa):
    # w / w_seg is the clipped drift factor: always in [1/κ, κ], and equal to d when d is inside.
    o, pt, p = (torch.tensor([[x]], dtype=torch.float64) for x in (old, prox_t, prox))
    lr = behavior_log_ratio(o, p, pt, mode="segment_wise", drift_clip=kappa)
    factor = float(lr - (pt - o))
    assert -math.log(kappa) - 1e-12 <= factor <= math.log(kappa) + 1e-12
    if abs(prox - prox_t) <= math.log(kappa):
        assert float(lr) == pytest.approx(prox - old, abs=1e-12)


def test_no_gradient_flows_through_the_weight():
    old, prox, prox_t, _ = _random_batch(0)
    prox = prox.clone().requires_grad_(True)
    prox_t = prox_t.clone().requires_grad_(True)
    lr = behavior_log_ratio(old, prox, prox_t, mode="segment_wise", drift_clip=2.0)
    assert not lr.requires_grad
    log_d, _ = drift_log_factor(prox, prox_t, 2.0)
    assert not log_d.requires_grad


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"mode": "decoupled", "drift_clip": 2.0}, "drift_clip applies to mode='segment_wise' only"),
        ({"mode": "segment_wise", "drift_clip": 0.5}, "drift_clip must be >= 1"),
        ({"mode": "segment_wise", "drift_clip": float("nan")}, "drift_clip must be a number"),
    ],
)
def test_bad_drift_clip_is_refused(kwargs, message):
    old, prox, prox_t, _ = _random_batch(1)
    with pytest.raises(ValueError, match=message):
        behavior_log_ratio(old, prox, prox_t, **kwargs)


def test_drift_clip_needs_proximal_logprobs():
    old, _, prox_t, _ = _random_batch(2)
    with pytest.raises(ValueError, match="proximal_logprobs is required for drift_clip"):
        behavior_log_ratio(old, None, prox_t, mode="segment_wise", drift_clip=2.0)
