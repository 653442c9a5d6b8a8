"""The recompute pass of docs/design.md §2 step 2: π_prox_t for the tokens whose window closes now.

With the engine paused at version c (weights c still loaded), every output token with
``versions[t] == c − 1`` whose ``proximal_t_versions[t] != c`` is scored under weights c, so it
gets π_{v+1} before those weights are replaced. Tokens of any other version are never touched:
older ones already had their window (or missed it for good), version-c tokens get theirs after
the next update. Scoring is a prefill of prompt + output up to the last target token, at the
engine's sampling temperature (``InferenceEngine.score``), packed many sequences per call.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from sdp_cli.errors import EngineError
from sdp_cli.rollout.buffers import RolloutCache, RolloutQueue
from sdp_cli.rollout.records import RolloutGroup, RolloutSample, samples_of
from sdp_cli.rollout.scoring import ScoringEngine

Item = RolloutSample | RolloutGroup


class _Prefill(Protocol):
    sequence: list[int]


PrefillT = TypeVar("PrefillT", bound=_Prefill)


def token_packs(jobs: Iterable[PrefillT], max_tokens: int) -> Iterator[list[PrefillT]]:
    """Consecutive groups of ``jobs`` (each a prefill of its ``sequence``) with at most
    ``max_tokens`` tokens in all, one ``score`` call each; a longer sequence goes alone (a
    prefill cannot be split)."""
    pack: list[PrefillT] = []
    tokens = 0
    for job in jobs:
        if pack and tokens + len(job.sequence) > max_tokens:
            yield pack
            pack, tokens = [], 0
        pack.append(job)
        tokens += len(job.sequence)
    if pack:
        yield pack


@dataclass
class RecomputeStats:
    """What one recompute pass did.

    Attributes:
        version: engine version c whose weights scored the tokens (targets had version c − 1).
        samples_seen: distinct samples inspected.
        samples_recomputed: samples with at least one token rescored.
        tokens_recomputed: tokens whose π_prox_t was written.
        score_calls: ``engine.score`` calls made.
        mean_abs_delta: mean |new − previous π_prox_t| over the rescored tokens (0 if none).
    """

    version: int
    samples_seen: int = 0
    samples_recomputed: int = 0
    tokens_recomputed: int = 0
    score_calls: int = 0
    mean_abs_delta: float = 0.0


@dataclass
class _Job:
    """One sequence to score: ``sequence[start:]`` is scored, ``targets`` are output indices.

    ``due(t)`` says whether target t still needs this version's score when the result is
    written (another pass may have written it meanwhile); ``sample`` is the record written, if any.
    """

    sequence: list[int]
    start: int
    prompt_len: int
    targets: list[int]
    previous: list[float]
    write: Callable[[int, float], None]
    due: Callable[[int], bool]
    sample: RolloutSample | None = None


@dataclass
class RecomputePlan:
    """What a pass will score under weights ``version``: made under the caller's lock, scored
    without it (:meth:`ProximalRecomputer.score`), written under it again (:meth:`~.write`)."""

    version: int
    jobs: list[_Job]
    samples_seen: int


def pass_targets(versions: Sequence[Any], prox_versions: Sequence[Any], current: int) -> list[int]:
    """Positions of the tokens a recompute pass under loaded weights ``current`` scores: of
    version current − 1, without π_prox_t from ``current`` yet."""
    if current - 1 not in versions:  # most held samples have no token of that version: C-speed scan
        return []
    return [
        t
        for t, (v, pv) in enumerate(zip(versions, prox_versions, strict=True))
        if int(v) == current - 1 and int(pv) != current
    ]


def _make_job(
    prompt: Sequence[int],
    output: Sequence[int],
    targets: list[int],
    previous: list[float],
    write: Callable[[int, float], None],
    due: Callable[[int], bool],
    sample: RolloutSample | None = None,
) -> _Job:
    prompt_len = len(prompt)
    start = prompt_len + targets[0]
    assert start >= 1, "cannot score output token 0 of a sample with an empty prompt"
    sequence = [*map(int, prompt), *map(int, output[: targets[-1] + 1])]
    return _Job(sequence, start, prompt_len, targets, previous, write, due, sample)


class ProximalRecomputer:
    """Writes π_prox_t = log π_c(token) for the version c − 1 tokens of every held sample."""

    def __init__(
        self,
        engine: ScoringEngine,
        *,
        max_tokens_per_call: int = 32768,
        on_write: Callable[[], None] | None = None,
    ):
        if max_tokens_per_call < 1:
            raise ValueError(f"max_tokens_per_call must be >= 1, got {max_tokens_per_call}")
        self.engine = engine
        self.max_tokens_per_call = max_tokens_per_call
        #: how many writes wrote at least one token: a reader that saw no change here since it
        #: last judged a held sample knows no pass changed that sample (writers hold their lock)
        self.writes = 0
        self._on_write = on_write  # called after each of those writes

    # ------------------------------------------------------------ production API
    def recompute_all(
        self,
        queue: RolloutQueue[Item] | None = None,
        cache: RolloutCache[Item] | None = None,
        inflight: Iterable[RolloutSample] | None = None,
    ) -> RecomputeStats:
        """Rescore the queued, cached and in-flight samples in one go (plan, score, write).

        ``inflight`` defaults to ``engine.inflight_samples()``. A sample reachable twice is
        scored once.
        """
        plan = self.plan(queue, cache, inflight)
        return self.write(plan, self.score(plan))

    def plan(
        self,
        queue: RolloutQueue[Item] | None = None,
        cache: RolloutCache[Item] | None = None,
        inflight: Iterable[RolloutSample] | None = None,
    ) -> RecomputePlan:
        """The version c − 1 tokens of the held samples that lack π_prox_t from the loaded
        version c. Reads the samples: call it where nobody else writes them."""
        current = self.engine.get_version()
        items: list[Item] = []
        if queue is not None:
            items.extend(queue.snapshot())
        if cache is not None:
            items.extend(cache.get_all())
        items.extend(self.engine.inflight_samples() if inflight is None else inflight)

        seen: set[int] = set()
        jobs: list[_Job] = []
        for item in items:
            for sample in samples_of(item):
                if id(sample) in seen:
                    continue
                seen.add(id(sample))
                targets = pass_targets(sample.versions, sample.proximal_t_versions, current)
                if not targets:
                    continue

                def write(t: int, logprob: float, sample: RolloutSample = sample) -> None:
                    sample.set_proximal_t(t, logprob, current)

                def due(t: int, sample: RolloutSample = sample) -> bool:
                    return int(sample.proximal_t_versions[t]) != current

                previous = [sample.proximal_logprobs_t[t] for t in targets]
                jobs.append(
                    _make_job(
                        sample.prompt_ids, sample.output_ids, targets, previous, write, due, sample
                    )
                )
        return RecomputePlan(current, jobs, len(seen))

    def score(self, plan: RecomputePlan) -> list[list[float]]:
        """Engine scores of every job of ``plan`` (packed into calls); writes nothing, so it may
        run while others use the samples. The loaded weights must stay those of ``plan.version``."""
        rows: list[list[float]] = []
        for pack in token_packs(plan.jobs, self.max_tokens_per_call):
            answer = self.engine.score([j.sequence for j in pack], [j.start for j in pack])
            if len(answer) != len(pack):
                raise EngineError(
                    f"engine.score returned {len(answer)} results for {len(pack)} sequences; "
                    "check the engine server version"
                )
            for job, row in zip(pack, answer):
                expected = len(job.sequence) - job.start
                if len(row) != expected:
                    raise EngineError(
                        f"engine.score returned {len(row)} logprobs for a sequence of "
                        f"{len(job.sequence)} tokens from {job.start}, expected {expected}"
                    )
                values = [float(row[job.prompt_len + t - job.start]) for t in job.targets]
                bad = next((v for v in values if not math.isfinite(v)), None)
                if bad is not None:
                    raise EngineError(f"engine.score returned a non-finite logprob ({bad})")
                rows.append(values)
        return rows

    def write(
        self,
        plan: RecomputePlan,
        scores: list[list[float]],
        *,
        keep: Callable[[RolloutSample], bool] | None = None,
    ) -> RecomputeStats:
        """Write the scores of ``plan`` into the samples ``keep`` accepts (all by default), for
        the targets still due. Call it where nobody else writes the samples."""
        assert len(scores) == len(plan.jobs), "one row of scores per job"
        stats = RecomputeStats(version=plan.version, samples_seen=plan.samples_seen)
        stats.score_calls = sum(1 for _ in token_packs(plan.jobs, self.max_tokens_per_call))
        abs_delta = 0.0
        for job, values in zip(plan.jobs, scores):
            if job.sample is not None and keep is not None and not keep(job.sample):
                continue
            written = 0
            for t, prev, logprob in zip(job.targets, job.previous, values):
                if job.due(t):
                    job.write(t, logprob)
                    abs_delta += abs(logprob - prev)
                    written += 1
            stats.tokens_recomputed += written
            stats.samples_recomputed += 1 if written else 0
        if stats.tokens_recomputed:
            stats.mean_abs_delta = abs_delta / stats.tokens_recomputed
            self.writes += 1
            if self._on_write is not None:
                self._on_write()
        return stats
