"""A new correction mode is one registered function plus one YAML (docs/design.md §4, "Adding a
mode"): a toy mode registered here, with its config in a temporary --config-dir, trains two steps
on the embedded engine without any other file changing."""

import json
from pathlib import Path

import pytest

from sdp_cli.config.compose import compose_config, config_source
from sdp_cli.core.weights import MODE_WEIGHTS, register_mode
from sdp_cli.errors import UserError
from sdp_cli.train.run import run_training

from .conftest import FAST


@pytest.fixture
def half_decoupled():
    """The toy mode: half the decoupled log ratio, w = (π_prox/π_behav)^½, anchored at π_prox."""

    @register_mode("half_decoupled", needs=("proximal_logprobs",), anchor="proximal")
    def half(old, proximal, proximal_t):
        return 0.5 * (proximal - old)

    try:
        yield half
    finally:
        del MODE_WEIGHTS["half_decoupled"]  # the registry is process-wide: leave it as it was


def test_a_registered_mode_with_one_yaml_trains(tmp_path, half_decoupled):
    conf = tmp_path / "conf"
    (conf / "mode").mkdir(parents=True)
    (conf / "mode" / "half_decoupled.yaml").write_text("# @package _global_\nloss:\n  mode: half_decoupled\n")
    source = config_source(conf, None)
    overrides = [*FAST, "mode=half_decoupled", "train.steps=2", f"run.root={tmp_path}/runs"]
    cfg, raw = compose_config(overrides, source=source)
    assert cfg.loss.mode == "half_decoupled"
    summary = run_training(cfg, raw, overrides=overrides, source=source)
    rows = [json.loads(x) for x in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "loss/pg_loss" in r]
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        # the trained weight is the square root of the decoupled shadow's, token by token, so
        # its mean is at most the shadow's mean (Jensen; equal only when every weight is 1)
        assert row["weights/rollout_is_mean"] <= row["shadow/decoupled/rollout_is_mean"] + 1e-6
        assert "recompute/tokens" not in row  # it reads π_prox only: no recompute pass runs


def test_an_unregistered_mode_is_refused_in_one_line(tmp_path):
    conf = tmp_path / "conf"
    (conf / "mode").mkdir(parents=True)
    (conf / "mode" / "nowhere.yaml").write_text("# @package _global_\nloss:\n  mode: nowhere\n")
    with pytest.raises(UserError, match="loss.mode='nowhere' is not valid; choose one of bypass, decoupled, segment_wise"):
        compose_config(["mode=nowhere"], source=config_source(conf, None))
