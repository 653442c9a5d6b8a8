"""The fused kernels of sdp_cli.core against the term-by-term reference (tests/core/reference.py):
weights, rejection, policy loss and off-policy metrics agree in value, metrics and gradient on
random batches (hypothesis)."""

import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from sdp_cli.core import behavior_log_ratio, importance_weights, offpolicy_metrics, policy_loss, rejection_mask

from .reference import CAP, CLIP, CLIP_HIGH, DUAL_CLIP, FLOOR, OURS, RS_UPPER, VETO, make_inputs, reference


def _ours(x, logprobs):
    log_ratio = behavior_log_ratio(x["old"], x["prox"], x["prox_t"], mode="segment_wise")
    weights, w_metrics = importance_weights(
        log_ratio, x["mask"], level="token", cap=CAP, floor=FLOOR, action="truncate", batch_normalize=True
    )
    mask, rs_metrics = rejection_mask(log_ratio, x["mask"], level="geometric", upper=RS_UPPER, veto=VETO)
    loss, loss_metrics = policy_loss(
        logprobs, x["prox"], x["adv"], mask, weights=weights, clip=CLIP, clip_high=CLIP_HIGH, dual_clip=DUAL_CLIP
    )
    metrics = {
        "weights": w_metrics,
        "rejection": rs_metrics,
        "loss": loss_metrics,
        "offpolicy": offpolicy_metrics(x["old"], x["prox"], x["mask"]),
    }
    return loss, mask, metrics


@settings(max_examples=60, deadline=None)
@given(batch=st.integers(1, 6), length=st.integers(1, 12), seed=st.integers(0, 2**31 - 1), spread=st.sampled_from([0.05, 0.5, 3.0]))
def test_fused_kernels_match_the_term_by_term_reference(batch, length, seed, spread):
    x = make_inputs(batch, length, seed)
    # spread the policies apart so that bounds, rejection, the veto and the clips all bind sometimes
    x["prox_t"] = x["old"] + (x["prox_t"] - x["old"]) * spread / 0.05
    x["logprobs"] = x["prox"] + (x["logprobs"] - x["prox"]) * spread / 0.05
    lp_ours = x["logprobs"].clone().requires_grad_(True)
    lp_ref = x["logprobs"].clone().requires_grad_(True)
    loss, mask, metrics = _ours(x, lp_ours)
    assume(bool(mask.sum() > 0))  # the reference's token-mean is undefined when every row is rejected
    ref_loss, ref_metrics = reference(x, lp_ref)
    loss.backward()
    ref_loss.backward()
    torch.testing.assert_close(loss.detach(), ref_loss.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lp_ours.grad, lp_ref.grad, rtol=1e-5, atol=1e-6)
    assert set(ref_metrics) == set(OURS)
    for name, value in ref_metrics.items():
        kernel, key = OURS[name]
        ours = metrics[kernel][key]
        assert abs(ours - value) <= 1e-6 + 1e-5 * abs(value), (name, kernel, key, ours, value)
