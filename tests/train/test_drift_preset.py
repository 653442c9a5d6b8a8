"""CI smoke test of `+preset=segment_wise_drift`: a few real asynchronous steps on the embedded
engine train with the drift-clipped weight (κ from the preset), and the trained weight's
metrics are the drift-clipped shadow's — the preset changes what is trained, not only a label."""

from __future__ import annotations

import json

import pytest
import yaml

from sdp_cli.choices import RECOMMENDED_DRIFT_CLIP

from ..fast_run import FAST, train_run


def test_the_drift_preset_trains_with_the_clipped_weight(tmp_path):
    run_dir = train_run(
        tmp_path,
        [*FAST, "+preset=segment_wise_drift", "rollout.max_head_offpolicyness=2", "train.steps=4"],
    )
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert config["loss"]["mode"] == "segment_wise"
    assert config["loss"]["drift_clip"] == RECOMMENDED_DRIFT_CLIP == 4.0  # docs/results.md

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert max(r["staleness/lag_max"] for r in rows) >= 1  # stale tokens were there to weigh
    for r in rows:
        assert r["shadow/segment_wise_drift/kappa"] == RECOMMENDED_DRIFT_CLIP
        assert 0.0 <= r["weights/drift_clipped_fraction"] <= 1.0
        # the weight the loss used is the drift-clipped one (decoupled and plain segment-wise
        # remain shadows): its statistics coincide with the drift shadow's
        for stat in ("rollout_is_mean", "rollout_is_max", "rollout_is_eff_sample_size"):
            assert r[f"weights/{stat}"] == pytest.approx(r[f"shadow/segment_wise_drift/{stat}"], rel=1e-6)
        assert r["weights/drift_clipped_fraction"] == r["shadow/segment_wise_drift/drift_clipped_fraction"]
