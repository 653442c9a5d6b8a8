"""What a resume may change, and the structural-config hash a checkpoint records
(sdp_cli/config/resume_keys.py, docs/reliability.md "What a resume checks")."""

from __future__ import annotations

from dataclasses import asdict

import pytest

from sdp_cli.config.overrides import schema_keys
from sdp_cli.config.resume_keys import ALLOWED_AT_RESUME, allowed_at_resume, changed_keys, config_hash, structural
from sdp_cli.config.schema import SdpConfig


def _config(**changes):
    """SdpConfig()'s plain data with dotted keys changed."""
    config = asdict(SdpConfig())
    for key, value in changes.items():
        *parents, leaf = key.split(".")
        node = config
        for part in parents:
            node = node[part]
        node[leaf] = value
    return config


def test_every_allowed_key_is_a_key_of_the_schema():
    keys = set(schema_keys())
    assert [a for a in ALLOWED_AT_RESUME if a not in keys] == []


def test_allowed_keys_cover_what_is_under_them_and_nothing_else():
    assert allowed_at_resume("run.trackers") and allowed_at_resume("engine.env.MY_VAR")
    assert allowed_at_resume("train.steps") and not allowed_at_resume("train.steps_extra")
    assert not allowed_at_resume("runner") and not allowed_at_resume("rollout.group_size")


def test_the_schema_defaults_have_no_structure():
    """Every leaf at its default counts as unset: a key sdp adds later with a default changes no
    older run's hash."""
    assert structural(asdict(SdpConfig())) == {}


@pytest.mark.parametrize(
    "key, value",
    [("train.steps", 9), ("run.dir", "/elsewhere"), ("engine.urls", ["http://127.0.0.1:8001"]), ("engine.request_timeout_s", 5.0), ("train.parallel", "fsdp")],
)
def test_allowed_changes_keep_the_hash(key, value):
    base = _config(**{"rollout.group_size": 4})
    assert changed_keys(base, _config(**{"rollout.group_size": 4, key: value})) == []
    assert config_hash(base) == config_hash(_config(**{"rollout.group_size": 4, key: value}))


@pytest.mark.parametrize(
    "key, value",
    [("rollout.group_size", 2), ("model.hidden_size", 32), ("task.name", "arith2"), ("loss.mode", "bypass"), ("seed", 3)],
)
def test_structural_changes_are_named_and_change_the_hash(key, value):
    base = _config()
    changed = _config(**{key: value})
    assert changed_keys(base, changed) == [key]
    assert config_hash(base) != config_hash(changed)
