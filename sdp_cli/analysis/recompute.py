"""Offline recompute of π_prox_t, π_prox and the exact multi-step chain from per-version
checkpoints (docs/design.md §1, §2, §5; docs/recompute.md). Computes and writes; never prints.

A run with ``train.keep_version_checkpoints=true`` keeps the weights of every version v in
``<run>/versions/v{v:06d}/``. With them, every quantity the engine could only compute while a
version was loaded can be computed again, for any saved batch (trainer version c):

- π_prox_t: an output token of version v < c is scored under the checkpoint of v + 1 and
  ``proximal_t_versions`` becomes v + 1; a token of version c keeps π_prox_t = π_behav.
- π_prox (``proximal``): every output token scored under one chosen checkpoint, by default
  the batch's trainer version c (what the trainer computed, now from the same scorer as π_prox_t).
- the exact chain (``exact``): every output token of version v < c scored under each of
  v + 1 … c, so that log π_c/π_v = Σ_{k=v}^{c−1} log π_{k+1}/π_k is known factor by factor and
  the factor segment-wise drops, log π_c − log π_{v+1}, can be reported per lag c − v.

Each checkpoint is loaded once and scores, in length-sorted calls of at most
``max_tokens_per_call`` tokens, every token of every batch that needs it (one group per batch
temperature). Nothing is written until every batch is computed; then all outputs are written
together through ``fileio.OutputPlan``: every target changes, or none.

Intact batches change by no more than the numeric noise of the run's dtype: the scorer runs in
the run's engine dtype, and every batch's π_prox_t and π_prox get a verdict (unchanged, dtype
noise, damaged) against noise floors measured on the batches' version-c tokens (``noise``).

The steps live in their own modules: ``checkpoints`` (the version directories, the run's
dtypes and π_prox_t source), ``recompute_plan`` (what to score, and scoring it), ``recompute_apply`` (the new
batches and their verdicts), ``noise`` (floors and verdicts), ``decomposition`` (the exact
chain) and ``batch_files`` (input paths and output targets).
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sdp_cli.analysis.batch_files import batches_run, expand_batch_paths, resolve_targets
from sdp_cli.analysis.checkpoints import RunNumerics, checkpoint_root, find_checkpoints, run_numerics
from sdp_cli.analysis.decomposition import LagDecomposition, exact_decomposition
from sdp_cli.analysis.noise import NoiseFloor, Verdict
from sdp_cli.analysis.recompute_apply import BatchOutcome, DeltaStats, apply_scores, judge_outcome, noise_floors
from sdp_cli.analysis.recompute_plan import (
    Plan,
    ProgressCallback,
    RecomputeOptions,
    VersionWork,
    make_plan,
    run_plan,
)
from sdp_cli.analysis.scorers import Scorer
from sdp_cli.fileio import Output, OutputPlan
from sdp_cli.rollout.batch_file import SavedBatch, read_batch, serialize_batch


@dataclass
class RecomputeResult:
    """Everything one ``sdp recompute`` computed (nothing written yet)."""

    outcomes: list[BatchOutcome]
    work: list[VersionWork]
    lags: list[LagDecomposition] | None
    scorer: str
    #: the run's dtypes and π_prox_t source (its config.yaml); None when the checkpoints are not a run's versions/
    numerics: RunNumerics | None
    #: "engine" and "trainer" noise floors (``analysis.noise``)
    floors: dict[str, NoiseFloor]
    checkpoint_root: Path
    seconds: float
    options: RecomputeOptions
    outputs: OutputPlan = field(default_factory=OutputPlan)
    written: list[Path] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready summary (``--json``)."""

        def delta(d: DeltaStats | None) -> dict[str, Any] | None:
            return None if d is None else dataclasses.asdict(d)

        def verdict(v: Verdict | None) -> dict[str, Any] | None:
            return None if v is None else dataclasses.asdict(v)

        choice = self.options.proximal_choice
        return {
            "scorer": self.scorer,
            "run": None if self.numerics is None else {
                **dataclasses.asdict(self.numerics), "source": str(self.numerics.source)
            },
            "noise_floor": {
                name: {**dataclasses.asdict(floor), "tolerance": floor.tolerance} for name, floor in self.floors.items()
            },
            "checkpoints": str(self.checkpoint_root),
            "proximal": None if choice is None else choice.describe(),
            "exact": self.options.exact,
            "seconds": self.seconds,
            "tokens_scored": sum(w.tokens for w in self.work),
            "versions": [dataclasses.asdict(w) for w in self.work],
            "batches": [
                {
                    "path": str(o.source),
                    "output": None if o.target is None else str(o.target),
                    "written": o.target is not None and o.target in self.written,
                    "trainer_version": o.batch.trainer_version,
                    "temperature": o.batch.temperature,
                    "proximal_t": delta(o.proximal_t),
                    "proximal_t_on_policy": delta(o.proximal_t_on_policy),
                    "retagged": o.retagged,
                    "proximal_t_verdict": verdict(o.proximal_t_verdict),
                    "proximal_version": o.proximal_version,
                    "proximal": delta(o.proximal),
                    "proximal_verdict": verdict(o.proximal_verdict),
                }
                for o in self.outcomes
            ],
            "lags": None if self.lags is None else [dataclasses.asdict(d) for d in self.lags],
            "written": [str(p) for p in self.written],
        }


def recompute(
    paths: Sequence[str | os.PathLike[str]],
    checkpoints: str | os.PathLike[str] | None,
    scorer_factory: Callable[[Sequence[SavedBatch]], Scorer],
    options: RecomputeOptions | None = None,
    *,
    output: str | os.PathLike[str] | None = None,
    force: bool = False,
    on_plan: Callable[[Plan], None] | None = None,
    progress: ProgressCallback | None = None,
) -> RecomputeResult:
    """Read, plan, score and apply; nothing is written (see :func:`commit`).

    Every batch is read and validated and every needed checkpoint located before any model is
    loaded, so a bad file or a missing version fails fast. ``scorer_factory`` receives the
    batches (so a server engine can pick their temperature) and is called only when there is
    work; ``on_plan`` sees the plan first (to size a progress bar). Without ``checkpoints``
    they are those of the run whose ``batches/`` holds the batches.
    """
    options = options or RecomputeOptions()
    started = time.perf_counter()
    sources = expand_batch_paths(paths)
    targets = resolve_targets(sources, output)
    outputs = OutputPlan(force=force, make_dirs=True)
    planned = [outputs.add(t, "--output", replace=force or output is None) for t in targets]
    batches = [(p, read_batch(p)) for p in sources]
    root = checkpoint_root(batches_run(sources) if checkpoints is None else checkpoints)
    store = find_checkpoints(root)
    numerics = run_numerics(root)
    plan = make_plan(batches, options, store, root)
    if on_plan is not None:
        on_plan(plan)
    scorer_name = "none (nothing to score)"
    if plan.jobs:
        with scorer_factory([b for _, b in batches]) as scorer:
            scores, work = run_plan(plan, batches, store, scorer, options, progress)
            scorer_name = scorer.description  # after loading: a local scorer names the dtype it ran
    else:
        scores, work = [{} for _ in batches], []
    outcomes = [
        apply_scores(path, batch, scores[i], plan.proximal_versions[i])
        for i, (path, batch) in enumerate(batches)
    ]
    for outcome, out in zip(outcomes, planned, strict=True):
        outcome.target = out.path
    floors = noise_floors([b for _, b in batches], scores)
    for (_, before), outcome in zip(batches, outcomes, strict=True):
        judge_outcome(before, outcome, floors, trainer_filled=numerics is not None and numerics.trainer_fills_proximal_t)
    lags = (
        exact_decomposition([b for _, b in batches], scores, options.drift_clips)
        if options.exact
        else None
    )
    return RecomputeResult(
        outcomes=outcomes,
        work=work,
        lags=lags,
        scorer=scorer_name,
        numerics=numerics,
        floors=floors,
        checkpoint_root=root,
        seconds=time.perf_counter() - started,
        options=options,
        outputs=outputs,
    )


def commit(result: RecomputeResult) -> list[Path]:
    """Write every outcome to its target, all or none (``fileio.OutputPlan.commit``)."""
    contents: dict[Output, bytes] = {
        out: serialize_batch(outcome.batch, str(out.path))
        for out, outcome in zip(result.outputs.outputs, result.outcomes, strict=True)
    }
    result.written = result.outputs.commit(contents)
    return result.written
