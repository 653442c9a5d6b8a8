"""One rule for which tokens a weight covers (docs/math.md §1; core/token_status.covered_tokens): the
trainer's shadow metrics, the weight it trains with and `sdp inspect-weights` on the batch it
saved agree, also on stale tokens that never got π_{v+1} (issue: the shadow drift mean was 1.1428
where inspect-weights said 1.1403 for the weight trained)."""

from __future__ import annotations

import copy

import pytest
import torch

from sdp_cli.analysis.inspect import WeightOptions, analyse_batches
from sdp_cli.config.schema import LossConfig, OptimConfig
from sdp_cli.rollout.batch_file import read_batch
from sdp_cli.train.step.batch import assemble_batch
from sdp_cli.train.step.batch_io import write_train_batch
from sdp_cli.train.step.trainer import SHADOW_DRIFT_CLIP, Trainer

from .test_trainer import _groups, _model, _set_old_logprobs

#: binds on some tokens of this batch, so the drift-clipped weight differs from both others
KAPPA = 1.2


def _stale_groups_with_holes(model):
    """Tokens of version 2 trained at version 5 (lag 3): π_{v+1} = π_3 recorded for most of them
    (made-up but fixed values), missing for every third token (uncorrectable)."""
    groups = _groups(version=2, n_groups=3, group_size=4, seed=7)
    _set_old_logprobs(groups, model, 1.0)
    g = torch.Generator().manual_seed(1)
    for group in groups:  # π_behav differs from π_prox by a different amount at every token
        for s in group.samples:
            s.old_logprobs[:] = [x - 0.4 * float(torch.rand((), generator=g)) for x in s.old_logprobs]
            s.proximal_logprobs_t[:] = list(s.old_logprobs)
    holes = 0
    for group in groups:
        for s in group.samples:
            for t in range(s.output_len):
                if (t + s.group_id) % 3 == 2:
                    holes += 1  # π_prox_t stays π_behav of version 2: its window closed
                    continue
                s.set_proximal_t(t, s.old_logprobs[t] + float(torch.randn((), generator=g)) * 0.5, 3)
    assert holes > 0
    return groups


@pytest.mark.parametrize(
    "loss",
    [LossConfig(mode="segment_wise", drift_clip=KAPPA, weight_cap=None), LossConfig(mode="decoupled", weight_cap=None)],
    ids=["trains-drift-clipped", "trains-decoupled"],
)
def test_shadows_the_trained_weight_and_inspect_weights_cover_the_same_tokens(tmp_path, loss):
    model = _model()
    groups = _stale_groups_with_holes(model)
    trainer = Trainer(
        copy.deepcopy(model),
        loss=loss,
        optim=OptimConfig(lr=1e-2),
        temperature=1.0,
        track_proximal_t=True,
    )
    trainer.version = 5
    batch = assemble_batch(copy.deepcopy(groups), pad_token_id=0, trainer_version=5)
    out = trainer.step(batch)
    m = out.metrics
    assert m["segment_wise/uncorrectable_token_fraction"] > 0

    path = write_train_batch(tmp_path / "b.safetensors", batch, out, temperature=1.0, model="tiny", mode=loss.mode)
    # the drift shadow's κ: the run's, else the recommended one
    kappa = loss.drift_clip or SHADOW_DRIFT_CLIP
    report = analyse_batches([read_batch(path)], [str(path)], WeightOptions(drift_clip=kappa))
    for name in ("segment_wise", "segment_wise_drift", "decoupled"):
        row = report.modes[name].weights["token"]
        for stat in ("mean", "std", "max"):
            assert m[f"shadow/{name}/rollout_is_{stat}"] == pytest.approx(row[stat], rel=1e-5), (name, stat)
    # the three weights differ here, so agreeing is not a coincidence of equal numbers
    means = {name: m[f"shadow/{name}/rollout_is_mean"] for name in ("segment_wise", "segment_wise_drift", "decoupled")}
    assert len({round(v, 4) for v in means.values()}) == 3, means
    # the weight trained is one of them, unbounded here: its numbers again
    trained = "segment_wise_drift" if loss.drift_clip else "decoupled"
    assert m["weights/rollout_is_mean"] == pytest.approx(m[f"shadow/{trained}/rollout_is_mean"], rel=1e-6)
    # a weight that reads π_prox_t leaves the holes out; decoupled covers them unless the loss did
    covered = {name: report.modes[name].tokens for name in ("segment_wise", "decoupled")}
    assert covered["segment_wise"] < covered["decoupled"] if loss.mode == "decoupled" else covered["segment_wise"] == covered["decoupled"]
