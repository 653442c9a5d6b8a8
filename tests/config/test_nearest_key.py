"""The nearest-key hint of an unknown key (issue 24, item 14): a key named in the wrong group is
found by its last part, wherever it lives; a typo inside the right group still finds its key."""

import pytest

from sdp_cli.config.compose import compose_config
from sdp_cli.config.overrides import nearest_key
from sdp_cli.errors import UserError


@pytest.mark.parametrize(
    ("key", "nearest"),
    [
        # docs/reliability.md said train.reward_workers; the hint was train.threads (same group)
        ("train.reward_workers", "task.reward_workers"),
        ("rollout.reward_pool", "task.reward_pool"),
        ("loss.lr", "optim.lr"),
        ("optim.steps", "train.steps"),
        ("engine.warm_start_steps", "model.warm_start_steps"),
        ("loss.upper", "loss.rejection.upper"),  # a leaf one level deeper
        # a typo of a leaf of another group: the leaf is still the closest thing there is
        ("train.reward_worker", "task.reward_workers"),
        # typos inside the right group keep their group
        ("train.stpes", "train.steps"),
        ("optim.lrr", "optim.lr"),
        ("rollout.group_sise", "rollout.group_size"),
    ],
)
def test_the_nearest_key_is_found_by_its_last_part_across_groups(key, nearest):
    assert nearest_key(key) == nearest


def test_a_leaf_in_two_groups_keeps_the_group_it_was_given_in():
    # dtype is train.dtype and engine.dtype; a typo'd group name decides between them by spelling
    assert nearest_key("trian.dtype") == "train.dtype"
    assert nearest_key("engin.dtype") == "engine.dtype"


def test_the_message_of_a_key_in_the_wrong_group_names_the_right_one():
    with pytest.raises(UserError) as info:
        compose_config(["+train.reward_workers=4"])
    assert "unknown config key 'train.reward_workers'; the nearest valid key is task.reward_workers" in str(info.value)
