"""Noise floors and verdicts of `sdp recompute` (sdp_cli/analysis/noise.py, recompute_apply.py)
on hand-made values: what is unchanged, dtype noise, damaged or unverified."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from sdp_cli.analysis.noise import EXACT_TOLERANCE, NOISE_MARGIN, NoiseFloor, Verdict, judge
from sdp_cli.analysis.recompute_apply import apply_scores, judge_outcome, noise_floors

from .test_recompute_logic import SEQS, make_batch


def test_floor_statistics_and_tolerance():
    floor = NoiseFloor.of(torch.tensor([1e-3, -3e-3, 2e-3]))
    assert (floor.tokens, floor.mean_abs, floor.max_abs) == (3, pytest.approx(2e-3), pytest.approx(3e-3))
    assert floor.tolerance == pytest.approx(NOISE_MARGIN * 3e-3)
    # a floor below float32 noise still tolerates float32 noise; nothing measured: no tolerance
    assert NoiseFloor.of(torch.tensor([0.0, 1e-8])).tolerance == EXACT_TOLERANCE
    assert NoiseFloor.of(torch.zeros(0)) == NoiseFloor() and NoiseFloor().tolerance is None


@pytest.mark.parametrize(
    ("delta", "tolerance", "kwargs", "expected"),
    [
        ([0.0, 5e-6, -1e-5], 1e-2, {}, Verdict("unchanged")),  # |Δ| ≤ 1e-5 everywhere
        ([0.0, 5e-6], None, {}, Verdict("unchanged")),  # no floor needed to see no change
        ([2e-3, -9e-3], 1e-2, {}, Verdict("dtype noise")),
        ([2e-3, -0.5, 0.02], 1e-2, {}, Verdict("damaged", beyond=2)),  # 0.5 and 0.02 > 0.01
        ([2e-3, -9e-3], None, {}, Verdict("unverified", beyond=2)),  # both > 1e-5, no floor
        ([0.0], 1e-2, {"retagged": 3}, Verdict("damaged", beyond=0, retagged=3)),
        # a version-c token whose π_prox_t was not exactly π_behav
        ([1e-3], 1e-2, {"exact": torch.tensor([0.0, 1e-7])}, Verdict("damaged", beyond=1)),
        # one tolerance per token: the second token (tolerance 1e-3) is beyond
        ([5e-3, 5e-3], torch.tensor([1e-2, 1e-3]), {}, Verdict("damaged", beyond=1)),
    ],
)
def test_judge(delta, tolerance, kwargs, expected):
    assert judge(torch.tensor(delta), tolerance, **kwargs) == expected


def _floors(engine_max: float | None, trainer_max: float | None) -> dict[str, NoiseFloor]:
    def floor(m):
        return NoiseFloor() if m is None else NoiseFloor(1, m, m)

    return {"engine": floor(engine_max), "trainer": floor(trainer_max)}


def test_floors_pool_version_c_tokens():
    # SEQS at c = 3: version-3 output tokens are 6, 8, 9 (old logprob −0.1t − 0.05)
    batch = make_batch(3, SEQS)
    batch = dataclasses.replace(batch, proximal_logprobs=batch.old_logprobs + 0.01 * torch.arange(batch.num_tokens))
    scored = torch.full((batch.num_tokens,), float("nan"))
    scored[[6, 8]] = batch.old_logprobs[[6, 8]] + torch.tensor([1e-3, -4e-3])  # token 9 not scored
    floors = noise_floors([batch], [{3: scored}])
    # float32 sums of −0.65 + 1e-3 etc. are exact only to ~1e-8
    assert floors["engine"] == NoiseFloor(2, pytest.approx(2.5e-3, abs=1e-7), pytest.approx(4e-3, abs=1e-7))
    # the file's π_prox − π_behav at tokens 6, 8, 9: 0.06, 0.08, 0.09
    assert floors["trainer"].tokens == 3
    assert floors["trainer"].mean_abs == pytest.approx(0.23 / 3) and floors["trainer"].max_abs == pytest.approx(0.09)
    # no checkpoint c scored and no π_prox: nothing measured
    assert noise_floors([make_batch(3, SEQS)], [{}]) == {"engine": NoiseFloor(), "trainer": NoiseFloor()}


def _outcome(batch, new_prox_t, new_prox=None, proximal_version=None):
    """An outcome whose recomputed values are given directly: π_prox_t of lagged tokens from
    ``new_prox_t`` (apply_scores reads version v's from scores[v + 1]), π_prox from ``new_prox``
    under ``proximal_version`` (one checkpoint scores both, so its tensor holds π_prox_t on the
    tokens it scores for π_prox_t and π_prox elsewhere)."""
    scores = {k: new_prox_t.clone() for k in (1, 2, 3)}
    if proximal_version is not None:
        own = batch.versions == proximal_version - 1
        scores[proximal_version] = torch.where(own, new_prox_t, new_prox)
    return apply_scores(Path("b"), batch, scores, proximal_version)


def test_verdicts_of_an_outcome():
    batch = make_batch(3, SEQS)
    lagged = (batch.versions >= 0) & (batch.versions < 3)
    batch.proximal_t_versions[lagged] += 1  # as the trainer writes them: nothing to retag
    # recomputed π_prox_t moves by 2e-3 on every lagged token
    outcome = _outcome(batch, batch.proximal_logprobs_t + 2e-3)
    judge_outcome(batch, outcome, _floors(1e-3, None))
    assert outcome.retagged == 0 and outcome.proximal_t_verdict == Verdict("dtype noise")  # 2e-3 ≤ 8 × 1e-3
    assert outcome.proximal_verdict is None  # π_prox not recomputed
    judge_outcome(batch, outcome, _floors(1e-4, None))
    assert outcome.proximal_t_verdict == Verdict("damaged", beyond=6)  # 2e-3 > 8 × 1e-4


def test_trainer_filled_tokens_are_judged_like_proximal():
    """proximal_t_source=trainer: the tokens of version c − 1 = 2 (5 and 14) took the trainer's
    π_prox, so engine + trainer tolerances apply to them, the engine's to the rest."""
    batch = make_batch(3, SEQS)
    lagged = (batch.versions >= 0) & (batch.versions < 3)
    batch.proximal_t_versions[lagged] += 1
    new = batch.proximal_logprobs_t.clone()
    new[batch.versions == 2] += 0.03  # tokens 5 and 14 (version 2 = c − 1)
    outcome = _outcome(batch, new)
    floors = _floors(1e-3, 1e-2)  # tolerances 8e-3 and 8e-2
    judge_outcome(batch, outcome, floors)
    assert outcome.proximal_t_verdict == Verdict("damaged", beyond=2)
    judge_outcome(batch, outcome, floors, trainer_filled=True)
    assert outcome.proximal_t_verdict == Verdict("dtype noise")  # 0.03 ≤ 8e-3 + 8e-2
    judge_outcome(batch, outcome, _floors(1e-3, None), trainer_filled=True)
    assert outcome.proximal_t_verdict.kind == "unverified"


def test_proximal_is_judged_against_both_floors_only_under_version_c():
    batch = make_batch(3, SEQS)
    lagged = (batch.versions >= 0) & (batch.versions < 3)
    batch.proximal_t_versions[lagged] += 1
    batch = dataclasses.replace(batch, proximal_logprobs=batch.old_logprobs.clone())
    outcome = _outcome(batch, batch.proximal_logprobs_t, batch.old_logprobs + 0.03, proximal_version=3)
    judge_outcome(batch, outcome, _floors(1e-3, 1e-2))
    assert outcome.proximal_t_verdict == Verdict("unchanged")
    assert outcome.proximal_verdict == Verdict("dtype noise")  # 0.03 ≤ 8e-3 + 8e-2
    judge_outcome(batch, outcome, _floors(1e-3, 1e-3))
    # 0.03 > 8e-3 + 8e-3 on the 7 outputs whose checkpoint-3 score is π_prox (tokens 5 and 14, of
    # version 2, carry their π_prox_t there, old + 0: unchanged)
    assert outcome.proximal_verdict == Verdict("damaged", beyond=7)
    # π_prox under another version than c differs by policy change, not noise: not judged
    other = _outcome(batch, batch.proximal_logprobs_t, batch.old_logprobs + 0.03, proximal_version=1)
    judge_outcome(batch, other, _floors(1e-3, 1e-2))
    assert other.proximal_verdict is None
