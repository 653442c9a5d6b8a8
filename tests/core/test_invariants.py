"""Configurations that must agree exactly (TRL-style invariant tests, docs/math.md §1)."""

import itertools

import pytest
import torch

from sdp_cli.core.loss import policy_loss
from sdp_cli.core.weights import behavior_log_ratio, importance_weights, rejection_mask

LEVELS = ("token", "sequence", "geometric")


def batch(seed, rows=4, length=6, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(rows, length, generator=gen, dtype=dtype) * 3
    prox = old + 0.3 * torch.randn(rows, length, generator=gen, dtype=dtype)
    logprobs = prox + 0.3 * torch.randn(rows, length, generator=gen, dtype=dtype)
    adv = torch.randn(rows, 1, generator=gen, dtype=dtype).expand(rows, length).contiguous()
    lengths = torch.randint(0, length + 1, (rows,), generator=gen)
    mask = torch.arange(length) < lengths[:, None]
    return old, prox, logprobs, adv, mask


def correction(log_ratio, mask, level, action):
    weights, w_metrics = importance_weights(
        log_ratio, mask, level=level, cap=1.5, floor=0.7, action=action
    )
    rs_mask, rs_metrics = rejection_mask(log_ratio, mask, level=level, upper=1.6, veto=0.3)
    return weights, rs_mask, {**w_metrics, **rs_metrics}


@pytest.mark.parametrize(("level", "action"), list(itertools.product(LEVELS, ("truncate", "mask"))))
def test_segment_wise_equals_decoupled_when_prox_t_is_prox(level, action):
    for seed in range(5):
        old, prox, logprobs, adv, mask = batch(seed)
        dec = behavior_log_ratio(old, prox, mode="decoupled")
        seg = behavior_log_ratio(
            old, torch.full_like(prox, float("nan")), prox.clone(), mode="segment_wise"
        )
        w_dec, m_dec, metrics_dec = correction(dec, mask, level, action)
        w_seg, m_seg, metrics_seg = correction(seg, mask, level, action)
        assert (
            torch.equal(w_dec, w_seg) and torch.equal(m_dec, m_seg) and metrics_dec == metrics_seg
        )
        lp_dec, lp_seg = (
            logprobs.clone().requires_grad_(True),
            logprobs.clone().requires_grad_(True),
        )
        loss_dec, _ = policy_loss(lp_dec, prox, adv, m_dec, weights=w_dec, dual_clip=3.0)
        loss_seg, _ = policy_loss(lp_seg, prox, adv, m_seg, weights=w_seg, dual_clip=3.0)
        loss_dec.backward()
        loss_seg.backward()
        assert torch.equal(loss_dec, loss_seg) and torch.equal(lp_dec.grad, lp_seg.grad)


@pytest.mark.parametrize(("level", "action"), list(itertools.product(LEVELS, ("truncate", "mask"))))
@pytest.mark.parametrize("loss_type", ["ppo_clip", "reinforce"])
def test_every_mode_equals_bypass_when_all_logprobs_agree(level, action, loss_type):
    for seed in range(5):
        old, _, logprobs, adv, mask = batch(seed)
        # π_behav = π_prox = π_prox_t: every behavioural weight is exactly 1
        bypass_lp = logprobs.clone().requires_grad_(True)
        bypass, bypass_metrics = policy_loss(
            bypass_lp, old, adv, mask, loss_type=loss_type, dual_clip=2.0
        )
        bypass.backward()
        for mode in ("decoupled", "segment_wise"):
            lr = behavior_log_ratio(old, old.clone(), old.clone(), mode=mode)
            weights, rs_mask, _ = correction(lr, mask, level, action)
            assert torch.equal(rs_mask, mask)
            assert torch.equal(weights, mask.to(weights.dtype))
            lp = logprobs.clone().requires_grad_(True)
            loss, metrics = policy_loss(
                lp, old, adv, rs_mask, weights=weights, loss_type=loss_type, dual_clip=2.0
            )
            loss.backward()
            assert torch.equal(loss, bypass) and metrics == bypass_metrics
            assert torch.equal(lp.grad, bypass_lp.grad)


@pytest.mark.parametrize("action", ["truncate", "mask"])
def test_levels_agree_on_one_token_sequences(action):
    for seed in range(5):
        old, prox, _, _, _ = batch(seed, rows=8, length=5)
        # exactly one valid token per non-empty row, at varying positions
        gen = torch.Generator().manual_seed(seed)
        position = torch.randint(0, 5, (8,), generator=gen)
        mask = torch.nn.functional.one_hot(position, 5).bool()
        mask[0] = False
        lr = behavior_log_ratio(old, prox, mode="decoupled")
        results = [correction(lr, mask, level, action) for level in LEVELS]
        token_w, token_mask, token_metrics = results[0]
        for w, m, metrics in results[1:]:
            assert torch.allclose(w, token_w, rtol=1e-12, atol=0) and torch.equal(m, token_mask)
            for name in (
                "rollout_is_mean",
                "rollout_is_ratio_fraction_high",
                "rollout_is_ratio_fraction_low",
                "rollout_rs_masked_fraction",
            ):
                assert metrics[name] == pytest.approx(token_metrics[name], rel=1e-12, abs=1e-15), (
                    name
                )


@pytest.mark.parametrize("level", LEVELS)
def test_truncate_and_mask_agree_inside_the_bounds(level):
    for seed in range(5):
        old, prox, _, _, mask = batch(seed)
        lr = behavior_log_ratio(old, prox, mode="decoupled") * 0.01  # every ratio within [0.5, 2]
        kwargs = {"level": level, "cap": 2.0, "floor": 0.5, "batch_normalize": seed % 2 == 1}
        w_trunc, m_trunc = importance_weights(lr, mask, action="truncate", **kwargs)
        w_mask, m_mask = importance_weights(lr, mask, action="mask", **kwargs)
        assert torch.equal(w_trunc, w_mask)
        assert m_mask.pop("rollout_is_masked_fraction") == 0.0
        assert m_trunc == m_mask


def test_token_batch_normalisation_gives_mean_one():
    for seed in range(5):
        old, prox, _, _, mask = batch(seed, rows=6, length=8)
        mask[0, 0] = True  # at least one valid token
        weights, metrics = importance_weights(
            behavior_log_ratio(old, prox, mode="decoupled"), mask, cap=1.3, batch_normalize=True
        )
        assert weights[mask].mean().item() == pytest.approx(1.0)
        assert metrics["rollout_is_mean"] == pytest.approx(1.0)
