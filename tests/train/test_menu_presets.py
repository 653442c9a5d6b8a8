"""The field's corrections as presets (`+preset=gspo|m2po|icepop`, docs/math.md): each trains a few
real asynchronous steps, and what it logs holds the relation its definition fixes."""

from __future__ import annotations

import json

import pytest

from ..fast_run import FAST, train_run

#: a warm start that leaves reward variance (the smoke sweep's), η = 2 and several optimizer steps
#: per batch: the policy moves, the weights leave 1 and the PPO ratio moves
ASYNC = ["model.warm_start_steps=60", "model.warm_start_lr=3e-3", "rollout.max_head_offpolicyness=2", "optim.ppo_epochs=2", "optim.minibatches=2", "optim.lr=3e-3", "train.steps=4"]


def _rows(run):
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "loss/pg_loss" in r]


def test_m2po_keeps_the_batch_second_moment_below_its_threshold(tmp_path):
    rows = _rows(train_run(tmp_path, [*FAST, "+preset=m2po", *ASYNC, "loss.m2_threshold=0.001"]))
    assert len(rows) == 4
    for row in rows:
        # what is kept has a mean lr² below τ, or a single token is left
        assert row["m2po/m2_after"] < 0.001 or row["m2po/masked_fraction"] > 0.9
        assert row["m2po/m2_after"] <= row["m2po/m2_before"]
    assert any(row["m2po/masked_fraction"] > 0 for row in rows)


def test_icepop_masks_token_weights_outside_its_band(tmp_path):
    rows = _rows(train_run(tmp_path, [*FAST, "+preset=icepop", *ASYNC, "loss.weight_floor=0.99", "loss.weight_cap=1.01"]))
    for row in rows:
        # every weight left is inside [0.99, 1.01] or 0 (masked)
        assert row["weights/rollout_is_max"] <= 1.01
        assert row["weights/rollout_is_min"] == 0.0 or row["weights/rollout_is_min"] >= 0.99
    assert any(row["weights/rollout_is_masked_fraction"] > 0 for row in rows)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_gspo_clips_whole_sequences(tmp_path, level):
    rows = _rows(train_run(tmp_path, [*FAST, "+preset=gspo", *ASYNC, f"loss.is_level={level}"]))
    # the paper's ε = 3e-4/4e-4 clips most sequences after a batch's first optimizer step
    assert any(row["loss/pg_clipfrac"] > 0 for row in rows)
    for row in rows:
        # the trained weight's ESS is reported at the level it trains with: at the sequence
        # level that is the per-sequence ESS, at the token level the token ESS
        key = "weights/rollout_is_eff_sample_size" if level == "token" else "weights/rollout_is_seq_eff_sample_size"
        assert row["weights/trained_ess"] == row[key]
        assert 0 < row["weights/trained_ess"] <= 1 and 0 < row["weights/trained_ess_raw"] <= 1
