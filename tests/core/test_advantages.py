"""Checks of sdp_cli.core.advantages.group_advantages (docs/math.md §7)."""

import math

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from sdp_cli.core.advantages import group_advantages


def test_grpo_hand_values():
    # group 7: rewards 1, 0, 1 → mean 2/3; unbiased std √(((1/3)²·2 + (2/3)²) / 2) = √(1/3)
    # group 3: rewards 5, 3 → mean 4; unbiased std √((1 + 1) / 1) = √2
    rewards = torch.tensor([1.0, 5.0, 0.0, 3.0, 1.0], dtype=torch.float64)
    groups = torch.tensor([7, 3, 7, 3, 7])
    adv = group_advantages(rewards, groups, eps=0.0)
    s = math.sqrt(1 / 3)
    expected = [(1 / 3) / s, 1 / math.sqrt(2), (-2 / 3) / s, -1 / math.sqrt(2), (1 / 3) / s]
    assert adv.tolist() == pytest.approx(expected)
    assert adv.dtype == torch.float64


def test_eps_is_added_to_the_std():
    # rewards 0, 2: mean 1, unbiased std √2; eps 0.1 → ±1 / (√2 + 0.1)
    adv = group_advantages(torch.tensor([0.0, 2.0]), torch.tensor([0, 0]), eps=0.1)
    assert adv.tolist() == pytest.approx([-1 / (math.sqrt(2) + 0.1), 1 / (math.sqrt(2) + 0.1)])


def test_dr_grpo_only_centres():
    adv = group_advantages(
        torch.tensor([1.0, 0.0, 1.0, 5.0, 3.0]), torch.tensor([0, 0, 0, 1, 1]), scale_by_std=False
    )
    assert adv.tolist() == pytest.approx([1 / 3, -2 / 3, 1 / 3, 1.0, -1.0])


@pytest.mark.parametrize("scale_by_std", [True, False])
def test_singletons_and_constant_groups_get_zero(scale_by_std):
    rewards = torch.tensor([4.0, 2.0, 2.0, 2.0])
    groups = torch.tensor([0, 1, 1, 1])  # group 0 is a singleton, group 1 is constant
    for eps in (0.0, 1e-6):
        adv = group_advantages(rewards, groups, scale_by_std=scale_by_std, eps=eps)
        assert adv.tolist() == [0.0, 0.0, 0.0, 0.0]


def test_equal_rewards_whose_mean_rounds_off_get_zero():
    # found by hypothesis: 3·x / 3 ≠ x in float64 for this x, so r − mean is ±1 ulp and the
    # std is tiny; dividing would turn rounding noise into advantages of ±0.8
    rewards = torch.full((3,), 5.9119861180206765, dtype=torch.float64)
    assert group_advantages(rewards, torch.zeros(3, dtype=torch.long), eps=0.0).tolist() == [
        0.0,
        0.0,
        0.0,
    ]


def test_empty_batch():
    assert group_advantages(torch.zeros(0), torch.zeros(0, dtype=torch.long)).shape == (0,)


def test_rewards_an_ulp_apart_are_centred_exactly():
    # found by hypothesis: the float mean of 10 and the float below it rounds to 10, so r − mean
    # was [0, −1 ulp] and the std's scaling made that [0, −1], a group that no longer sums to 0.
    # Centred on the group's least reward first, both deviations are exact: ±ulp/2, ±1/√2.
    below = math.nextafter(10.0, 0.0)
    rewards = torch.tensor([10.0, below], dtype=torch.float64)
    groups = torch.zeros(2, dtype=torch.long)
    half_ulp = (10.0 - below) / 2
    assert group_advantages(rewards, groups, scale_by_std=False).tolist() == [half_ulp, -half_ulp]
    assert group_advantages(rewards, groups, eps=0.0).tolist() == pytest.approx(
        [1 / math.sqrt(2), -1 / math.sqrt(2)], rel=1e-12
    )


@given(
    st.lists(
        st.tuples(st.integers(0, 4), st.floats(-10, 10, allow_nan=False)),
        min_size=1,
        max_size=30,
    )
)
@example([(0, 10.0), (0, 9.999999999999998)])
def test_each_group_is_centred_and_scaled(samples):
    groups = torch.tensor([g for g, _ in samples])
    rewards = torch.tensor([r for _, r in samples], dtype=torch.float64)
    adv = group_advantages(rewards, groups, eps=0.0)
    centred = group_advantages(rewards, groups, scale_by_std=False)
    for g in groups.unique():
        members = groups == g
        # every group sums to zero
        assert abs(adv[members].sum().item()) < 1e-9
        assert abs(centred[members].sum().item()) < 1e-9
        r = rewards[members]
        if members.sum() > 1 and r.std().item() > 1e-6:
            # with std scaling each group's advantages have unbiased std 1
            assert adv[members].std().item() == pytest.approx(1.0, rel=1e-6)
