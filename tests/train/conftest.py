"""Small, fast end-to-end training configs on the embedded engine."""

import pytest

from sdp_cli.config.compose import compose_config

# A model small enough that a training step takes tens of milliseconds.
FAST = [
    "model.hidden_size=64",
    "model.num_layers=2",
    "model.num_heads=2",
    "model.intermediate_size=128",
    "model.warm_start_steps=10",
    "rollout.batch_groups=4",
    "rollout.group_size=4",
    "rollout.groups_per_request=4",
    "run.progress=false",
    "run.tensorboard=false",
    "train.eval_samples=0",
    "train.checkpoint_every=0",
]


@pytest.fixture(autouse=True)
def _shared_warm_start_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("SDP_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "sdp-cache"))


@pytest.fixture
def fast_config(tmp_path):
    def make(*overrides: str):
        return compose_config([*FAST, f"run.root={tmp_path}/runs", *overrides])

    return make
