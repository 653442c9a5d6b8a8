"""Offline recompute of π_prox_t, π_prox and the exact multi-step chain from per-version
checkpoints (DESIGN.md §1, §2, §5; docs/recompute.md). Computes and writes; never prints.

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
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from sdp_cli import __version__
from sdp_cli.errors import UserError
from sdp_cli.fileio import Output, OutputPlan
from sdp_cli.analysis.scorers import Scorer
from sdp_cli.rollout.batch_file import SavedBatch, read_batch, serialize_batch
from sdp_cli.rollout.recompute import token_packs

#: a version checkpoint directory as ``sdp train`` names it (``v000012``)
VERSION_DIR = re.compile(r"^v(\d+)$")
KEEP_VERSIONS_FIX = "keep every version with `sdp train train.keep_version_checkpoints=true`"


# ----------------------------------------------------------------------------- checkpoints
def checkpoint_root(path: str | os.PathLike[str]) -> Path:
    """The directory holding the version directories: a run directory's ``versions/``, or
    ``path`` itself."""
    root = Path(path).expanduser()
    try:
        is_dir = root.is_dir()
    except OSError as err:  # e.g. a name too long for the file system
        raise UserError(f"checkpoint directory {root}: {err.strerror}; pass a run directory or its versions/") from None
    if not is_dir:
        raise UserError(
            f"checkpoint directory {root} does not exist; pass a run directory or its versions/ directory"
        )
    return root / "versions" if (root / "versions").is_dir() else root


def find_checkpoints(path: str | os.PathLike[str]) -> dict[int, Path]:
    """Version → checkpoint directory, from a run directory (its ``versions/``) or from a
    directory holding ``v000012``-style directories."""
    root = checkpoint_root(path)
    found: dict[int, Path] = {}
    for child in sorted(root.iterdir()):
        match = VERSION_DIR.match(child.name)
        if not (match and child.is_dir()):
            continue
        version = int(match.group(1))
        if version in found:
            raise UserError(
                f"{root} has two directories for version {version} ({found[version].name}, {child.name}); "
                "remove one"
            )
        found[version] = child
    return found


def format_versions(versions: Iterable[int]) -> str:
    """``[1, 2, 3, 5]`` → ``"1–3, 5"``."""
    values = sorted(set(versions))
    parts: list[str] = []
    i = 0
    while i < len(values):
        j = i
        while j + 1 < len(values) and values[j + 1] == values[j] + 1:
            j += 1
        parts.append(str(values[i]) if i == j else f"{values[i]}–{values[j]}")
        i = j + 1
    return ", ".join(parts)


class MissingCheckpoints(UserError):
    """Some version a batch needs has no checkpoint directory."""


# --------------------------------------------------------------------------------- options
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


@dataclass(frozen=True)
class RecomputeOptions:
    """What to compute besides π_prox_t (which is always recomputed).

    Attributes:
        proximal: compute π_prox under this checkpoint choice (None: keep the stored π_prox).
        exact: score the full chain v + 1 … c of every lagged token; implies π_prox under the
            trainer version c.
        max_tokens_per_call: prefill tokens per scoring call (a longer sequence goes alone).
    """

    proximal: ProximalChoice | None = None
    exact: bool = False
    max_tokens_per_call: int = 16384

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
        return ProximalChoice() if self.exact else self.proximal


# ------------------------------------------------------------------------------- planning
def output_mask(batch: SavedBatch) -> torch.Tensor:
    """[N] bool, True on output (non-prompt) tokens."""
    seq_idx, pos = batch.token_layout()
    return pos >= batch.prompt_lens[seq_idx]


def token_requests(batch: SavedBatch, proximal_version: int | None, exact: bool) -> dict[int, torch.Tensor]:
    """Version k → [N] bool mask of the tokens that need log π_k(token).

    π_prox_t: output tokens of version v < c need k = v + 1. π_prox: every output token needs
    ``proximal_version``. Exact chain: output tokens of version v < c need every k in v+1 … c.
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
    if exact:
        for k in range(1, c + 1):
            add(k, lagged & (v < k))
    return requests


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
    missing: dict[int, list[str]] = {}
    for i, (path, batch) in enumerate(batches):
        prox = None if choice is None else choice.resolve(batch.trainer_version, available)
        requests = token_requests(batch, prox, options.exact)
        plan.requests.append(requests)
        plan.proximal_versions.append(prox)
        for k in requests:
            if k not in available:
                missing.setdefault(k, []).append(path.name)
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
        names = sorted({n for ns in missing.values() for n in ns})
        where = f" in {checkpoint_root}" if checkpoint_root is not None else ""
        have = f" (it has {format_versions(available)})" if available else " (it has none)"
        raise MissingCheckpoints(
            f"checkpoints of version(s) {format_versions(missing)} are missing{where}{have}, needed by "
            f"{names[0]}{f' and {len(names) - 1} more batch(es)' if len(names) > 1 else ''}; "
            f"{KEEP_VERSIONS_FIX}"
        )
    return plan


# -------------------------------------------------------------------------------- running
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


# ------------------------------------------------------------------------------- applying
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
    """

    source: Path
    batch: SavedBatch
    proximal_t: DeltaStats
    proximal_t_on_policy: DeltaStats
    retagged: int
    proximal_version: int | None
    proximal: DeltaStats | None
    target: Path | None = None


def apply_scores(
    path: Path, batch: SavedBatch, scores: dict[int, torch.Tensor], proximal_version: int | None
) -> BatchOutcome:
    """The batch with π_prox_t (and π_prox) replaced by the scored values (DESIGN.md §2)."""
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


# ------------------------------------------------------------------------ exact decomposition
@dataclass
class Moments:
    """Mean, standard deviation (population), mean |x| and max |x| of a set of values."""

    mean: float
    std: float
    mean_abs: float
    max_abs: float

    @classmethod
    def of(cls, x: torch.Tensor) -> Moments:
        x = x.double()
        return cls(
            float(x.mean()),
            float(x.std(correction=0)),
            float(x.abs().mean()),
            float(x.abs().max()),
        )


@dataclass
class LagDecomposition:
    """The exact chain over the loss-mask tokens of one lag ℓ = c − v ≥ 1, all batches together.

    log π_c/π_behav = Σ_{j=0}^{ℓ−1} log π_{v+j+1}/π_{v+j} with π_v := π_behav (the sampled
    logprob). Segment-wise keeps j = 0 and drops the rest, log π_c/π_{v+1}.

    Attributes:
        lag: ℓ.
        tokens: loss-mask output tokens with this lag.
        segment_wise: log π_{v+1}/π_behav, the segment-wise log weight.
        decoupled: log π_c/π_behav, the full (decoupled) log weight.
        dropped: log π_c/π_{v+1}, the factor segment-wise drops (0 for ℓ = 1).
        dropped_ratio_mean: mean of π_c/π_{v+1} = exp(dropped) over the tokens.
        step_means: ℓ entries, mean of log π_{v+j+1}/π_{v+j} for j = 0 … ℓ−1; they sum to
            ``decoupled.mean`` and entries 1 … ℓ−1 to ``dropped.mean``.
    """

    lag: int
    tokens: int
    segment_wise: Moments
    decoupled: Moments
    dropped: Moments
    dropped_ratio_mean: float
    step_means: list[float] = field(default_factory=list)


def exact_decomposition(
    batches: Sequence[SavedBatch], scores: Sequence[dict[int, torch.Tensor]]
) -> list[LagDecomposition]:
    """Per lag, the chain of one-step log ratios of the loss-mask tokens (needs the scores of
    every version v+1 … c for each token, as planned with ``exact``)."""
    # per lag: rows of [log π_behav, log π_{v+1}, …, log π_c], one row per token
    chains: dict[int, list[torch.Tensor]] = {}
    for batch, batch_scores in zip(batches, scores, strict=True):
        c = batch.trainer_version
        keep = output_mask(batch) & batch.effective_loss_mask().bool() & (batch.versions < c)
        for v in sorted(set(batch.versions[keep].tolist())):
            mask = keep & (batch.versions == v)
            columns = [batch.old_logprobs[mask]] + [batch_scores[k][mask] for k in range(v + 1, c + 1)]
            chain = torch.stack(columns, dim=1).double()
            assert not bool(chain.isnan().any()), f"the chain of version {v} tokens was scored fully"
            chains.setdefault(c - v, []).append(chain)
    result = []
    for lag in sorted(chains):
        chain = torch.cat(chains[lag])
        steps = chain[:, 1:] - chain[:, :-1]
        dropped = chain[:, -1] - chain[:, 1]
        result.append(
            LagDecomposition(
                lag=lag,
                tokens=int(chain.shape[0]),
                segment_wise=Moments.of(chain[:, 1] - chain[:, 0]),
                decoupled=Moments.of(chain[:, -1] - chain[:, 0]),
                dropped=Moments.of(dropped),
                dropped_ratio_mean=float(dropped.exp().mean()),
                step_means=[float(x) for x in steps.mean(dim=0)],
            )
        )
    return result


# ------------------------------------------------------------------------------ top level
@dataclass
class RecomputeResult:
    """Everything one ``sdp recompute`` computed (nothing written yet)."""

    outcomes: list[BatchOutcome]
    work: list[VersionWork]
    lags: list[LagDecomposition] | None
    scorer: str
    checkpoint_root: Path
    seconds: float
    options: RecomputeOptions
    outputs: OutputPlan = field(default_factory=OutputPlan)
    written: list[Path] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready summary (``--json``)."""

        def delta(d: DeltaStats | None) -> dict[str, Any] | None:
            return None if d is None else dataclasses.asdict(d)

        choice = self.options.proximal_choice
        return {
            "scorer": self.scorer,
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
                    "proximal_version": o.proximal_version,
                    "proximal": delta(o.proximal),
                }
                for o in self.outcomes
            ],
            "lags": None if self.lags is None else [dataclasses.asdict(d) for d in self.lags],
            "written": [str(p) for p in self.written],
        }


def expand_batch_paths(paths: Sequence[str | os.PathLike[str]]) -> list[Path]:
    """Batch files, with a directory standing for its ``*.safetensors`` files (sorted)."""
    files: list[Path] = []
    for raw in paths:
        path = Path(raw).expanduser()
        if os.path.isdir(path):  # False for a name too long: the reader then names the problem
            found = sorted(p for p in path.glob("*.safetensors") if p.is_file())
            if not found:
                raise UserError(f"{path} holds no *.safetensors batch files; pass batch files or a batches/ directory")
            files.extend(found)
        else:
            files.append(path)
    seen: set[Path] = set()
    for path in files:
        key = path.resolve()
        if key in seen:
            raise UserError(f"{path} is given twice; pass each batch once")
        seen.add(key)
    return files


def resolve_targets(sources: Sequence[Path], output: str | os.PathLike[str] | None) -> list[Path]:
    """Where each batch is written: in place, into the directory ``output``, or (one batch)
    to the file ``output``. A directory is recognised by existing or by a trailing slash."""
    if output is None:
        return list(sources)
    raw = os.fspath(output)
    out = Path(raw).expanduser()
    as_dir = os.path.isdir(out) or raw.endswith(("/", os.sep)) or len(sources) > 1
    if not as_dir:
        return [out]
    if os.path.lexists(out) and not os.path.isdir(out):
        raise UserError(f"--output {out} is a file but {len(sources)} batches were given; pass a directory")
    targets = [out / s.name for s in sources]
    names = [t.name for t in targets]
    clash = next((n for n in names if names.count(n) > 1), None)
    if clash is not None:
        raise UserError(
            f"two batches are named {clash} and would both be written to {out}; recompute them in separate calls"
        )
    return targets


def recompute(
    paths: Sequence[str | os.PathLike[str]],
    checkpoints: str | os.PathLike[str],
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
    work; ``on_plan`` sees the plan first (to size a progress bar).
    """
    options = options or RecomputeOptions()
    started = time.perf_counter()
    sources = expand_batch_paths(paths)
    targets = resolve_targets(sources, output)
    outputs = OutputPlan(force=force, make_dirs=True)
    planned = [outputs.add(t, "--output", replace=force or output is None) for t in targets]
    batches = [(p, read_batch(p)) for p in sources]
    root = checkpoint_root(checkpoints)
    store = find_checkpoints(root)
    plan = make_plan(batches, options, store, root)
    if on_plan is not None:
        on_plan(plan)
    scorer_name = "none (nothing to score)"
    if plan.jobs:
        with scorer_factory([b for _, b in batches]) as scorer:
            scorer_name = scorer.description
            scores, work = run_plan(plan, batches, store, scorer, options, progress)
    else:
        scores, work = [{} for _ in batches], []
    outcomes = [
        apply_scores(path, batch, scores[i], plan.proximal_versions[i])
        for i, (path, batch) in enumerate(batches)
    ]
    for outcome, out in zip(outcomes, planned, strict=True):
        outcome.target = out.path
    lags = exact_decomposition([b for _, b in batches], scores) if options.exact else None
    return RecomputeResult(
        outcomes=outcomes,
        work=work,
        lags=lags,
        scorer=scorer_name,
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
