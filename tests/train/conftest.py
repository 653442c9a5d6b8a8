"""Small, fast end-to-end training configs on the embedded engine, and a registry left as found."""

import pytest

from sdp_cli.config.compose import compose_config
from sdp_cli.modes import MODES, unregister

from .. import fast_run

# The shared fast config, without checkpoints unless a test asks for them.
FAST = [*fast_run.FAST, "train.checkpoint_every=0"]


@pytest.fixture(autouse=True)
def _shared_warm_start_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("SDP_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "sdp-cache"))


@pytest.fixture
def forget_user_modes():
    """Modes of yours a test loads: the registry is process-wide, leave it as the test found it."""
    before = set(MODES)
    yield
    for name in set(MODES) - before:
        unregister(name)


@pytest.fixture
def fast_config(tmp_path):
    def make(*overrides: str):
        return compose_config([*FAST, f"run.root={tmp_path}/runs", *overrides])

    return make
