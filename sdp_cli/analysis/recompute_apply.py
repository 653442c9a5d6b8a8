"""A batch with its recomputed π_prox_t (and π_prox), what changed, and whether that is dtype
noise or damage (docs/recompute.md).

Lagged output tokens (version v < c) take the score of version v + 1 and the tag v + 1;
version-c tokens take π_prox_t = π_behav and the tag c (docs/design.md §2, the invariant).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch

from sdp_cli import __version__
from sdp_cli.analysis.noise import NoiseFloor, Verdict, judge
from sdp_cli.analysis.recompute_plan import output_mask
from sdp_cli.rollout.batch_file import SavedBatch


@dataclass
class DeltaStats:
    """|new − previous| over the tokens a quantity was recomputed on (None: no previous)."""

    tokens: int = 0
    mean_abs: float | None = None
    max_abs: float | None = None

    @classmethod
    def of(cls, new: torch.Tensor, previous: torch.Tensor | None) -> DeltaStats:
        if previous is None or new.numel() == 0:
            return cls(int(new.numel()))
        delta = (new.double() - previous.double()).abs()
        return cls(int(new.numel()), float(delta.mean()), float(delta.max()))


@dataclass
class BatchOutcome:
    """One batch before and after: the new batch, where it goes, and what changed.

    Attributes:
        proximal_t: |Δ π_prox_t| over the output tokens of version < c (rescored).
        proximal_t_on_policy: |Δ π_prox_t| over the version-c tokens (reset to π_behav).
        retagged: output tokens whose ``proximal_t_versions`` changed.
        proximal: |Δ π_prox| over the output tokens when π_prox was computed (None otherwise);
            no mean/max when the batch had no π_prox before.
        proximal_t_verdict, proximal_verdict: ``judge_outcome``'s verdicts (None: not judged).
    """

    source: Path
    batch: SavedBatch
    proximal_t: DeltaStats
    proximal_t_on_policy: DeltaStats
    retagged: int
    proximal_version: int | None
    proximal: DeltaStats | None
    target: Path | None = None
    proximal_t_verdict: Verdict | None = None
    proximal_verdict: Verdict | None = None


def apply_scores(
    path: Path, batch: SavedBatch, scores: dict[int, torch.Tensor], proximal_version: int | None
) -> BatchOutcome:
    """The batch with π_prox_t (and π_prox) replaced by the scored values (docs/design.md §2)."""
    out = output_mask(batch)
    v, c = batch.versions, batch.trainer_version
    lagged = out & (v < c)
    on_policy = out & (v == c)
    prox_t = batch.proximal_logprobs_t.clone()
    tags = batch.proximal_t_versions.clone()
    for k in sorted(set((v[lagged] + 1).tolist())):
        mask = lagged & (v + 1 == k)
        prox_t[mask] = scores[int(k)][mask]
    tags[lagged] = v[lagged] + 1
    prox_t[on_policy] = batch.old_logprobs[on_policy]
    tags[on_policy] = v[on_policy]
    assert not bool(prox_t[lagged].isnan().any()), "every lagged token was scored"

    proximal = batch.proximal_logprobs
    proximal_delta = None
    if proximal_version is not None:
        proximal = torch.zeros(batch.num_tokens, dtype=torch.float32)
        proximal[out] = scores[proximal_version][out]
        assert not bool(proximal.isnan().any()), "every output token was scored for π_prox"
        previous = None if batch.proximal_logprobs is None else batch.proximal_logprobs[out]
        proximal_delta = DeltaStats.of(proximal[out], previous)
    new = dataclasses.replace(
        batch,
        proximal_logprobs_t=prox_t,
        proximal_t_versions=tags,
        proximal_logprobs=proximal,
        sdp_version=__version__,
    )
    return BatchOutcome(
        source=path,
        batch=new,
        proximal_t=DeltaStats.of(prox_t[lagged], batch.proximal_logprobs_t[lagged]),
        proximal_t_on_policy=DeltaStats.of(prox_t[on_policy], batch.proximal_logprobs_t[on_policy]),
        retagged=int((tags[out] != batch.proximal_t_versions[out]).sum()),
        proximal_version=proximal_version,
        proximal=proximal_delta,
    )


def noise_floors(batches: list[SavedBatch], scores: list[dict[int, torch.Tensor]]) -> dict[str, NoiseFloor]:
    """The ``engine`` and ``trainer`` floors of ``analysis.noise``, pooled over the batches'
    output tokens of version c: the scorer's log π_c (where it was scored) and the file's π_prox
    (where it has one), each against π_behav."""
    engine: list[torch.Tensor] = []
    trainer: list[torch.Tensor] = []
    for batch, scored in zip(batches, scores, strict=True):
        c = batch.trainer_version
        on_policy = output_mask(batch) & (batch.versions == c)
        if c in scored:
            known = on_policy & ~scored[c].isnan()
            engine.append(scored[c][known] - batch.old_logprobs[known])
        if batch.proximal_logprobs is not None:
            trainer.append(batch.proximal_logprobs[on_policy] - batch.old_logprobs[on_policy])
    return {
        "engine": NoiseFloor.of(torch.cat(engine) if engine else torch.zeros(0)),
        "trainer": NoiseFloor.of(torch.cat(trainer) if trainer else torch.zeros(0)),
    }


def judge_outcome(
    before: SavedBatch, outcome: BatchOutcome, floors: dict[str, NoiseFloor], *, trainer_filled: bool = False
) -> None:
    """Set the outcome's verdicts. π_prox_t against the ``engine`` floor (the run's engine computed
    it), with its tags and the exact π_prox_t = π_behav of version-c tokens; with ``trainer_filled``
    (``rollout.proximal_t_source=trainer``) tokens one version stale took the trainer's π_prox, so
    they are judged like π_prox. π_prox, when it was recomputed under the batch's own trainer
    version over a stored one, against the sum of both floors (scorer − trainer = (scorer −
    engine) + (engine − trainer))."""
    out = output_mask(before)
    v, c = before.versions, before.trainer_version
    after = outcome.batch
    engine = floors["engine"].tolerance
    trainer = floors["trainer"].tolerance
    both = None if engine is None or trainer is None else engine + trainer
    lagged = out & (v < c)
    tolerance: float | torch.Tensor | None = engine
    one_stale = v[lagged] == c - 1
    if trainer_filled and bool(one_stale.any()):
        tolerance = None if both is None else torch.where(one_stale, both, engine)
    delta_t = after.proximal_logprobs_t - before.proximal_logprobs_t
    outcome.proximal_t_verdict = judge(
        delta_t[lagged], tolerance, retagged=outcome.retagged, exact=delta_t[out & (v == c)]
    )
    if outcome.proximal_version != c or before.proximal_logprobs is None:
        return
    outcome.proximal_verdict = judge((after.proximal_logprobs - before.proximal_logprobs)[out], both)
