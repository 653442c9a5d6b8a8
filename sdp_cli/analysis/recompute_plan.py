"""What ``sdp recompute`` scores, and the scoring itself (docs/recompute.md "What is computed").

For a saved batch of trainer version c (docs/design.md §1, §2):

- π_prox_t: an output token of version v < c is scored under the checkpoint of v + 1;
- π_prox (``--proximal``, or ``--mode`` naming a weight that reads it, ``reads_proximal``):
  every output token under one chosen checkpoint, by default c;
- the exact chain (``--exact``): every output token of version v < c under each of v + 1 … c;
- the noise floor: output tokens of version c under c, when that checkpoint exists.

The work depends on the versions present (in the batch and among the checkpoints), never on
their magnitude: a chain is checked against the checkpoints as a span (``missing_spans``).

``make_plan`` turns the batches into prefill jobs grouped by (version, temperature) and refuses
a missing checkpoint before any model is loaded; ``run_plan`` loads each checkpoint once and
scores its jobs in length-sorted calls of at most ``max_tokens_per_call`` tokens.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from sdp_cli.analysis.checkpoints import KEEP_VERSIONS_FIX, MissingCheckpoints, format_versions
from sdp_cli.analysis.scorers import Scorer
from sdp_cli.choices import STUDIED_DRIFT_CLIPS
from sdp_cli.errors import UserError
from sdp_cli.modes import drift_clipped_mode, weight_mode, weight_names
from sdp_cli.rollout.batch_file import SavedBatch
from sdp_cli.rollout.recompute import token_packs


@dataclass(frozen=True)
class ProximalChoice:
    """Which checkpoint gives π_prox: each batch's trainer version (``version`` None, not
    ``latest``), the newest checkpoint (``latest``) or one fixed version."""

    version: int | None = None
    latest: bool = False

    @classmethod
    def parse(cls, text: str) -> ProximalChoice:
        """``trainer``, ``latest`` or a version number (``--proximal``)."""
        value = text.strip().lower()
        if value == "trainer":
            return cls()
        if value == "latest":
            return cls(latest=True)
        if value.isdigit():
            return cls(version=int(value))
        raise UserError(
            f"--proximal {text!r} is not a version; use trainer (each batch's trainer version), latest or a number"
        )

    def resolve(self, trainer_version: int, available: Iterable[int]) -> int:
        if self.latest:
            versions = list(available)
            if not versions:
                raise MissingCheckpoints(f"--proximal latest needs a version checkpoint; {KEEP_VERSIONS_FIX}")
            return max(versions)
        return trainer_version if self.version is None else self.version

    def describe(self) -> str:
        if self.latest:
            return "latest"
        return "trainer" if self.version is None else str(self.version)


def reads_proximal(weight: str) -> bool:
    """Whether the weight ``weight`` reads π_prox: a registered mode whose ``needs`` name it
    (``sdp_cli.modes``), or a drift-clipped weight ``<mode>_drift``, whose drift factor is
    π_prox/π_prox_t (``modes.weight_names`` lists both kinds)."""
    assert weight in weight_names(), f"unknown weight {weight!r}"
    return drift_clipped_mode(weight) is not None or weight_mode(weight).reads_proximal


@dataclass(frozen=True)
class RecomputeOptions:
    """What to compute besides π_prox_t (which is always recomputed).

    Attributes:
        proximal: compute π_prox under this checkpoint choice (None: keep the stored π_prox).
        exact: score the full chain v + 1 … c of every lagged token; implies π_prox under the
            trainer version c.
        max_tokens_per_call: prefill tokens per scoring call (a longer sequence goes alone).
        drift_clips: with ``exact``, the κ values whose effect on the dropped factor is reported.
        modes: weights (``modes.weight_names``) whose inputs must be filled: when one
            reads π_prox (``reads_proximal``), π_prox is computed (under ``proximal``, by
            default each batch's trainer version).
    """

    proximal: ProximalChoice | None = None
    exact: bool = False
    max_tokens_per_call: int = 16384
    drift_clips: tuple[float, ...] = STUDIED_DRIFT_CLIPS
    modes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.exact and self.proximal not in (None, ProximalChoice()):
            raise UserError(
                f"--exact computes π_prox under each batch's trainer version, not --proximal "
                f"{self.proximal.describe()}; drop --proximal or --exact"
            )
        if self.max_tokens_per_call < 1:
            raise ValueError("max_tokens_per_call must be >= 1")

    @property
    def proximal_choice(self) -> ProximalChoice | None:
        if self.exact or (self.proximal is None and any(reads_proximal(m) for m in self.modes)):
            return ProximalChoice()
        return self.proximal


def output_mask(batch: SavedBatch) -> torch.Tensor:
    """[N] bool, True on output (non-prompt) tokens."""
    seq_idx, pos = batch.token_layout()
    return pos >= batch.prompt_lens[seq_idx]


def chain_versions(batch: SavedBatch) -> range:
    """The checkpoints the exact chain of ``batch`` needs: v + 1 … c for its oldest lagged
    output token v (empty when no output token lags). A range, so that its size never costs
    anything: a chain over 2⁵³ versions is refused by its gaps, not enumerated."""
    out = output_mask(batch)
    lagged = out & (batch.versions < batch.trainer_version)
    if not bool(lagged.any()):
        return range(0)
    return range(int(batch.versions[lagged].min()) + 1, batch.trainer_version + 1)


def missing_spans(needed: range, available: Iterable[int]) -> list[tuple[int, int]]:
    """The gaps of ``needed`` that ``available`` leaves, as inclusive (first, last) pairs; the
    work is O(|available|), whatever the size of ``needed``."""
    spans: list[tuple[int, int]] = []
    start = needed.start
    for k in sorted(k for k in set(available) if k in needed):
        if k > start:
            spans.append((start, k - 1))
        start = k + 1
    if start < needed.stop:
        spans.append((start, needed.stop - 1))
    return spans


def token_requests(
    batch: SavedBatch, proximal_version: int | None, chain: Iterable[int] = (), *, calibrate: bool = False
) -> dict[int, torch.Tensor]:
    """Version k → [N] bool mask of the tokens that need log π_k(token).

    π_prox_t: output tokens of version v < c need k = v + 1. π_prox: every output token needs
    ``proximal_version``. Exact chain: for each k of ``chain`` (the checkpoints of
    :func:`chain_versions`), the output tokens of version v < k ≤ c. ``calibrate``: output
    tokens of version c need c too, for the noise floor (``analysis.noise``).
    """
    out = output_mask(batch)
    v, c = batch.versions, batch.trainer_version
    lagged = out & (v < c)
    requests: dict[int, torch.Tensor] = {}

    def add(version: int, mask: torch.Tensor) -> None:
        if bool(mask.any()):
            requests[version] = requests.get(version, torch.zeros_like(mask)) | mask

    for k in sorted(set((v[lagged] + 1).tolist())):
        add(int(k), lagged & (v + 1 == k))
    if proximal_version is not None:
        add(proximal_version, out)
    for k in chain:
        add(k, lagged & (v < k))
    if calibrate:
        add(c, out & (v == c))
    return requests


def _format_spans(spans: Iterable[tuple[int, int]]) -> str:
    """Inclusive spans, merged: ``[(1, 2), (3, 3), (6, 9)]`` → ``"1–3, 6–9"``."""
    merged: list[list[int]] = []
    for first, last in sorted(spans):
        if merged and first <= merged[-1][1] + 1:
            merged[-1][1] = max(merged[-1][1], last)
        else:
            merged.append([first, last])
    return ", ".join(str(a) if a == b else f"{a}–{b}" for a, b in merged)


@dataclass
class _Job:
    """One prefill: ``sequence[start:]`` is scored; ``targets`` are absolute token indices of
    the batch, all at or after ``offset + start``."""

    batch: int
    sequence: list[int]
    start: int
    offset: int
    targets: torch.Tensor


@dataclass
class Plan:
    """Scoring work: (version, temperature) → jobs, plus what each batch asked for."""

    jobs: dict[tuple[int, float], list[_Job]]
    requests: list[dict[int, torch.Tensor]]
    proximal_versions: list[int | None]

    @property
    def versions(self) -> list[int]:
        return sorted({k for k, _ in self.jobs})

    def tokens(self, version: int | None = None) -> int:
        return sum(
            int(job.targets.numel())
            for (k, _), jobs in self.jobs.items()
            if version is None or k == version
            for job in jobs
        )


def make_plan(
    batches: Sequence[tuple[Path, SavedBatch]],
    options: RecomputeOptions,
    available: Iterable[int],
    checkpoint_root: Path | None = None,
) -> Plan:
    """Jobs for every batch; raises ``MissingCheckpoints`` naming every version that is needed
    but has no checkpoint."""
    available = set(available)
    choice = options.proximal_choice
    plan = Plan(jobs={}, requests=[], proximal_versions=[])
    missing: list[tuple[int, int, str]] = []  # (first, last, batch name): spans, never enumerated
    for i, (path, batch) in enumerate(batches):
        prox = None if choice is None else choice.resolve(batch.trainer_version, available)
        needed = chain_versions(batch) if options.exact else range(0)
        gaps = missing_spans(needed, available)
        missing += [(first, last, path.name) for first, last in gaps]
        chain = [] if gaps else [k for k in sorted(available) if k in needed]
        # the noise floor is measured where checkpoint c exists; it is never a reason to fail
        requests = token_requests(batch, prox, chain, calibrate=batch.trainer_version in available)
        plan.requests.append(requests)
        plan.proximal_versions.append(prox)
        missing += [(k, k, path.name) for k in requests if k not in available]
        if missing:  # the plan is refused: no jobs to build
            continue
        cu = batch.cu_seqlens.tolist()
        for k, mask in requests.items():
            key = (k, float(batch.temperature))
            for s in range(batch.num_sequences):
                lo, hi = cu[s], cu[s + 1]
                targets = mask[lo:hi].nonzero().squeeze(1) + lo
                if targets.numel() == 0:
                    continue
                last = int(targets[-1])
                plan.jobs.setdefault(key, []).append(
                    _Job(
                        batch=i,
                        sequence=batch.input_ids[lo : last + 1].tolist(),
                        start=int(targets[0]) - lo,
                        offset=lo,
                        targets=targets,
                    )
                )
    if missing:
        names = sorted({name for _, _, name in missing})
        where = f" in {checkpoint_root}" if checkpoint_root is not None else ""
        have = f" (it has {format_versions(available)})" if available else " (it has none)"
        raise MissingCheckpoints(
            f"checkpoints of version(s) {_format_spans((a, b) for a, b, _ in missing)} are missing{where}{have}, "
            f"needed by {names[0]}{f' and {len(names) - 1} more batch(es)' if len(names) > 1 else ''}; "
            f"{KEEP_VERSIONS_FIX}"
        )
    return plan

#: called after each scoring call with (version, tokens scored in it)
ProgressCallback = Callable[[int, int], None]


@dataclass
class VersionWork:
    """What one checkpoint did: tokens scored (all purposes), π_prox_t and π_prox tokens
    among them, sequences prefilled, seconds spent loading and scoring."""

    version: int
    tokens: int = 0
    proximal_t_tokens: int = 0
    proximal_tokens: int = 0
    sequences: int = 0
    load_seconds: float = 0.0
    score_seconds: float = 0.0


def run_plan(
    plan: Plan,
    batches: Sequence[tuple[Path, SavedBatch]],
    checkpoints: dict[int, Path],
    scorer: Scorer,
    options: RecomputeOptions,
    progress: ProgressCallback | None = None,
) -> tuple[list[dict[int, torch.Tensor]], list[VersionWork]]:
    """Score every job; returns per batch {version: [N] float32 logprobs, NaN where unscored}
    and the work per version. Each checkpoint is loaded once, versions in increasing order."""
    scores: list[dict[int, torch.Tensor]] = [
        {k: torch.full((b.num_tokens,), math.nan) for k in plan.requests[i]}
        for i, (_, b) in enumerate(batches)
    ]
    work: list[VersionWork] = []
    for version in plan.versions:
        stats = VersionWork(version)
        started = time.perf_counter()
        scorer.load(version, checkpoints[version])
        stats.load_seconds = time.perf_counter() - started
        started = time.perf_counter()
        for temperature in sorted(t for k, t in plan.jobs if k == version):
            jobs = plan.jobs[(version, temperature)]
            # length-sorted: a pack is padded to its longest sequence
            by_length = sorted(jobs, key=lambda j: len(j.sequence))
            for pack in token_packs(by_length, options.max_tokens_per_call):
                results = scorer.score(temperature, [j.sequence for j in pack], [j.start for j in pack])
                assert len(results) == len(pack), "the scorer returned one list per sequence"
                n_tokens = 0
                for job, values in zip(pack, results, strict=True):
                    assert len(values) == len(job.sequence) - job.start, "one logprob per scored token"
                    scored = torch.tensor(values, dtype=torch.float32)
                    first = job.offset + job.start
                    scores[job.batch][version][job.targets] = scored[job.targets - first]
                    n_tokens += int(job.targets.numel())
                stats.tokens += n_tokens
                stats.sequences += len(pack)
                if progress is not None:
                    progress(version, n_tokens)
        scorer.unload()
        stats.score_seconds = time.perf_counter() - started
        for i, (_, batch) in enumerate(batches):
            out = output_mask(batch)
            lagged = out & (batch.versions < batch.trainer_version)
            stats.proximal_t_tokens += int((lagged & (batch.versions + 1 == version)).sum())
            if plan.proximal_versions[i] == version:
                stats.proximal_tokens += int(out.sum())
        work.append(stats)
    return scores, work
