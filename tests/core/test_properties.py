"""Hypothesis properties of the correction kernels (docs/math.md §0, §2, §5).

Each example draws shapes, options and a seed; tensors come from a seeded generator so that
shrinking stays meaningful and examples stay fast.
"""

import math

import torch
from hypothesis import given
from hypothesis import strategies as st

from sdp_cli.core.loss import policy_loss
from sdp_cli.core.metrics import offpolicy_metrics
from sdp_cli.core.weights import importance_weights, rejection_mask

LEVELS = st.sampled_from(["token", "sequence", "geometric"])
DTYPES = st.sampled_from([torch.float32, torch.float64])
AGGS = st.sampled_from(
    ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
)
GARBAGE = [float("nan"), float("inf"), -float("inf"), 1e30, -1e30]


@st.composite
def batches(draw, scale=None):
    rows, length = draw(st.integers(1, 5)), draw(st.integers(1, 7))
    dtype = draw(DTYPES)
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    scale = draw(st.sampled_from([0.01, 1.0, 10.0, 1e4])) if scale is None else scale

    def randn():
        return torch.randn(rows, length, generator=gen, dtype=dtype) * scale

    mask = torch.rand(rows, length, generator=gen) < draw(st.sampled_from([0.0, 0.5, 0.9, 1.0]))
    garbage = torch.tensor(GARBAGE, dtype=dtype)[
        torch.randint(0, len(GARBAGE), (rows, length), generator=gen)
    ]
    return {"a": randn(), "b": randn(), "adv": randn() / scale, "mask": mask, "garbage": garbage}


def dirty(values, b):
    """``values`` with garbage written at every padded position."""
    return torch.where(b["mask"], values, b["garbage"])


bounds = st.tuples(st.sampled_from([None, 0.0, 0.5, 0.9]), st.sampled_from([None, 1.1, 2.0, 10.0]))


@given(batches(), LEVELS, bounds, st.sampled_from(["truncate", "mask"]), st.booleans())
def test_weights_are_finite_nonnegative_and_ignore_padding(b, level, bound, action, normalize):
    floor, cap = bound
    kwargs = {
        "level": level,
        "cap": cap,
        "floor": floor,
        "action": action,
        "batch_normalize": normalize,
    }
    weights, metrics = importance_weights(b["a"], b["mask"], **kwargs)
    assert weights.dtype == b["a"].dtype
    assert torch.isfinite(weights).all() and (weights >= 0).all()
    assert (weights[~b["mask"]] == 0).all()
    assert all(isinstance(v, float) and math.isfinite(v) for v in metrics.values())
    assert 0.0 <= metrics["rollout_is_eff_sample_size"] <= 1.0 + 1e-6
    if not normalize and action == "truncate" and b["mask"].any():
        # the bounds as the tensor dtype stores them (1.1 in float32 is 1.10000002), with an
        # ulp of slack: padding is filled with the rounded mean (``sdp_cli.core._masked.extremes``)
        dtype = b["a"].dtype
        low = torch.nextafter(torch.tensor(floor or 0.0, dtype=dtype), torch.tensor(-math.inf, dtype=dtype))
        high = torch.nextafter(torch.tensor(cap or math.inf, dtype=dtype), torch.tensor(math.inf, dtype=dtype))
        assert low.item() <= metrics["rollout_is_min"] and metrics["rollout_is_max"] <= high.item()
    again, metrics_again = importance_weights(dirty(b["a"], b), b["mask"], **kwargs)
    assert torch.equal(weights, again) and metrics == metrics_again


@given(batches(), LEVELS, st.sampled_from([1.05, 2.0, 50.0]), st.sampled_from([None, 1e-3, 0.5]))
def test_rejection_mask_is_a_sub_mask_and_ignores_padding(b, level, upper, veto):
    new, metrics = rejection_mask(b["a"], b["mask"], level=level, upper=upper, veto=veto)
    assert new.dtype == torch.bool and not (new & ~b["mask"]).any()
    if level != "token":
        # a sequence is kept or dropped whole
        kept = new.any(-1)
        assert torch.equal(new, b["mask"] & kept[:, None])
    assert all(isinstance(v, float) and math.isfinite(v) for v in metrics.values())
    again, metrics_again = rejection_mask(
        dirty(b["a"], b), b["mask"], level=level, upper=upper, veto=veto
    )
    assert torch.equal(new, again) and metrics == metrics_again


@given(batches(scale=8.0), st.sampled_from([1e-4, 1e-2, 0.5]))
def test_veto_alone_is_verls_formula(b, veto):
    # verl (Gen A): mask · ¬any_t(valid_t ∧ lr_t < log veto), written out directly
    lr, mask = b["a"], b["mask"]
    catastrophic = (lr < math.log(veto)) & mask
    expected = mask & ~catastrophic.any(-1, keepdim=True)
    new, _ = rejection_mask(lr, mask, veto=veto)
    assert torch.equal(new, expected)
    assert torch.equal(rejection_mask(dirty(lr, b), mask, veto=veto)[0], expected)


@given(batches(scale=1.0))
def test_offpolicy_metrics_ignore_padding(b):
    metrics = offpolicy_metrics(b["a"] - 3, b["b"] - 3, b["mask"])
    assert all(math.isfinite(v) for v in metrics.values())
    assert metrics == offpolicy_metrics(dirty(b["a"] - 3, b), dirty(b["b"] - 3, b), b["mask"])


#: the constant denominator of seq-mean-token-sum-norm in these tests
NORM = 7.0


def closed_form(lp, prox, adv, mask, w, clip, clip_high, dual_clip, agg, loss_type):
    """The loss written directly with autograd ops, no fusion (reference for gradients)."""
    if loss_type == "reinforce":
        loss = -adv * lp
    else:
        ratio = torch.exp(torch.clamp(lp - prox, -20, 20))
        loss = torch.maximum(
            -adv * ratio, -adv * torch.clamp(ratio, 1 - clip, 1 + (clip_high or clip))
        )
        if dual_clip is not None:
            loss = torch.where(adv < 0, torch.minimum(loss, -dual_clip * adv), loss)
    loss = torch.where(mask, loss * w, torch.zeros_like(loss))
    m = mask.to(lp.dtype)
    rows = m.sum(-1)
    n_seq = (rows > 0).sum().clamp_min(1)
    if agg == "token-mean":
        return loss.sum() / m.sum().clamp_min(1)
    if agg == "seq-mean-token-sum":
        return loss.sum(-1).sum() / n_seq
    if agg == "seq-mean-token-mean":
        return (loss.sum(-1) / rows.clamp_min(1)).sum() / n_seq
    return loss.sum() / NORM


@given(
    batches(scale=0.5),
    AGGS,
    st.sampled_from(["ppo_clip", "reinforce"]),
    st.sampled_from([0.1, 0.2]),
    st.sampled_from([None, 0.28]),
    st.sampled_from([None, 1.5, 3.0]),
)
def test_policy_loss_gradient_matches_closed_form_in_float64(
    b, agg, loss_type, clip, clip_high, dual_clip
):
    lp, prox = b["a"].double(), b["b"].double()
    adv, mask = b["adv"].double(), b["mask"]
    w = torch.rand(lp.shape, dtype=torch.float64) * 2
    ours = lp.clone().requires_grad_(True)
    ref = lp.clone().requires_grad_(True)
    kwargs = {
        "clip": clip,
        "clip_high": clip_high,
        "dual_clip": dual_clip,
        "agg": agg,
        "loss_type": loss_type,
        "denominator": NORM if agg == "seq-mean-token-sum-norm" else None,
    }
    loss, _ = policy_loss(ours, prox, adv, mask, weights=w, **kwargs)
    expected = closed_form(ref, prox, adv, mask, w, clip, clip_high, dual_clip, agg, loss_type)
    loss.backward()
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ours.grad, ref.grad, rtol=1e-12, atol=1e-12)


@given(batches(), AGGS, st.sampled_from(["ppo_clip", "reinforce"]), st.sampled_from([None, 2.0]))
def test_masked_and_zero_weight_tokens_get_exactly_zero_gradient(b, agg, loss_type, dual_clip):
    # weights from the mask action: tokens out of [0.8, 1.25] carry weight exactly 0
    weights, _ = importance_weights(b["b"] * 0.3, b["mask"], cap=1.25, floor=0.8, action="mask")
    clean = b["a"].clone().requires_grad_(True)
    loss, metrics = policy_loss(
        clean,
        b["b"],
        b["adv"],
        b["mask"],
        weights=weights,
        agg=agg,
        loss_type=loss_type,
        dual_clip=dual_clip,
        denominator=NORM if agg == "seq-mean-token-sum-norm" else None,
    )
    loss.backward()
    assert loss.dtype == b["a"].dtype and clean.grad.dtype == b["a"].dtype
    assert torch.isfinite(clean.grad).all()
    assert (clean.grad[weights == 0] == 0).all()  # padding and masked-out weights
    # garbage at padding (in every input) changes neither the loss nor any gradient
    noisy = dirty(b["a"], b).requires_grad_(True)
    loss2, metrics2 = policy_loss(
        noisy,
        dirty(b["b"], b),
        dirty(b["adv"], b),
        b["mask"],
        weights=dirty(weights, b),
        agg=agg,
        loss_type=loss_type,
        dual_clip=dual_clip,
        denominator=NORM if agg == "seq-mean-token-sum-norm" else None,
    )
    loss2.backward()
    assert torch.equal(loss, loss2) and metrics == metrics2
    assert torch.equal(clean.grad, noisy.grad)


def test_half_precision_inputs_count_in_float32():
    # 300 valid tokens: a bfloat16 sum would round the count (bf16 has 8 mantissa bits)
    lr = torch.full((1, 300), 0.0, dtype=torch.bfloat16)
    mask = torch.ones(1, 300, dtype=torch.bool)
    weights, metrics = importance_weights(lr, mask, cap=2.0, batch_normalize=True)
    assert weights.dtype == torch.bfloat16 and torch.equal(weights, torch.ones_like(weights))
    assert metrics["rollout_is_mean"] == 1.0 and metrics["rollout_is_seq_mean"] == 1.0
    lp = torch.zeros(1, 300, dtype=torch.bfloat16, requires_grad=True)
    loss, _ = policy_loss(lp, lp.detach(), torch.ones_like(lr), mask, weights=weights)
    loss.backward()
    # ℓ = −A·r·w = −1 per token; token-mean −1; the loss is reduced in float32
    assert loss.dtype == torch.float32 and loss.item() == -1.0
    assert lp.grad.dtype == torch.bfloat16
