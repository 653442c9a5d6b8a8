"""The runs of a sweep as read from disk, and the per-group rows the report computes.

A sweep directory is read from ``<sweep>/runs/*/`` only (``overrides.json``, ``config.yaml``,
``summary.json``, ``metrics.jsonl``), so it works the same for a sweep that ran on a cluster and
for the run directories of any earlier sdp version: the metric names it reads
(``shadow/<mode>/rollout_is_*``, ``staleness/*``, ``time/*``, ``throughput/*``) are those every
sdp train run has written. The report's own per-run table, ``runs.csv``, is read back by
``read_runs_csv``: the statistics need nothing else.
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sdp_cli.ablate.sweep import (
    MAX_HEAD_OFFPOLICYNESS_KEY,
    MODE_KEY,
    RUNS_SUBDIR,
    SEED_KEY,
    SWEEP_GROUP,
    mode_label,
    split_override,
)
from sdp_cli.choices import RECOMMENDED_DRIFT_CLIP
from sdp_cli.modes import drift_clipped_mode, shadow_weights
from sdp_cli.errors import UserError
from sdp_cli.rundir import RunDir



@dataclass(frozen=True)
class Shadow:
    """The columns of one shadow weight: ``w_<short>_{std,ess,max}``, aggregated from its
    ``shadow/<name>/rollout_is_*`` metrics; ``label`` names it in table headers and ``legend``
    in plots; ``weight`` (with its formula), ``ess`` and ``largest`` name it in the columns'
    explanations. A drift-clipped weight (``drift``) also has the share of tokens its clip
    changed, column ``clipped``, from ``shadow/<name>/drift_clipped_fraction``."""

    name: str
    short: str
    label: str
    legend: str
    weight: str
    ess: str
    largest: str
    drift: bool = False

    @property
    def clipped(self) -> str:
        return "drift_clipped" if self.short == "drift" else f"{self.short}_clipped"

    @classmethod
    def of(cls, name: str) -> Shadow:
        """The shadow weight ``name`` (a registered mode, or ``<mode>_drift``)."""
        if name in _BUILT_IN_SHADOWS:
            return _BUILT_IN_SHADOWS[name]
        mode = drift_clipped_mode(name)
        what = name if mode is None else f"drift-clipped {mode}"
        return cls(name, name, name, name, f"the {what} weight", f"the {what} weight", f"{what} weight", mode is not None)


#: the built-in shadow weights' column names (``dec``, ``segment_wise``, ``drift``) and texts;
#: ``drift`` is the drift-clipped segment-wise weight, κ = the run's loss.drift_clip, else
#: choices.RECOMMENDED_DRIFT_CLIP
_BUILT_IN_SHADOWS = {
    "decoupled": Shadow(
        "decoupled", "dec", "dec", "π_prox/π_behav",
        "the decoupled weight π_prox/π_behav", "the decoupled weight", "decoupled weight",
    ),
    "segment_wise": Shadow(
        "segment_wise", "segment_wise", "seg", "π_{v+1}/π_behav",
        "the segment-wise weight π_{v+1}/π_behav", "the segment-wise weight", "segment-wise weight",
    ),
    "segment_wise_drift": Shadow(
        "segment_wise_drift", "drift", "drift", "π_{v+1}/π_behav·clip(d)",
        "the drift-clipped weight (π_{v+1}/π_behav)·clip(π_prox/π_{v+1}, 1/κ, κ)",
        f"the drift-clipped weight (κ = the run's, else {RECOMMENDED_DRIFT_CLIP:g})",
        "drift-clipped weight",
        drift=True,
    ),
}


def shadows() -> tuple[Shadow, ...]:
    """The shadow weights of the report, one per weight the mode registry defines
    (``modes.shadow_weights``; built in: dec, segment_wise, drift)."""
    return tuple(Shadow.of(name) for name in shadow_weights())


#: a group: (mode, η = max_head_offpolicyness, the other swept values)
GroupKey = tuple[str, int, tuple[str, ...]]
#: per group: steps, mean reward per step over the seeds, its sample std
Curves = dict[GroupKey, tuple[list[int], list[float], list[float]]]


@dataclass
class RunRecord:
    """One run directory of a sweep, as read from disk."""

    name: str
    run_dir: Path
    mode: str
    max_head_offpolicyness: int
    seed: int
    extra: tuple[str, ...]
    summary: dict[str, Any] | None
    rows: list[dict[str, Any]]

    @property
    def finished(self) -> bool:
        return self.summary is not None

    @property
    def group(self) -> GroupKey:
        return (self.mode, self.max_head_offpolicyness, self.extra)


@dataclass(frozen=True)
class RunValues:
    """A finished run's per-run numbers (``report.run_metrics``): one row of ``runs.csv``."""

    mode: str
    max_head_offpolicyness: int
    extra: tuple[str, ...]
    seed: int
    name: str
    values: dict[str, float | None]

    @property
    def group(self) -> GroupKey:
        return (self.mode, self.max_head_offpolicyness, self.extra)


#: the columns of ``runs.csv`` before the per-run metrics
RUN_KEY_COLUMNS = ("mode", "eta", "other", "seed", "run")


def read_runs_csv(path: Path) -> list[RunValues]:
    """The rows of a ``runs.csv`` the report wrote: key columns, then one column per metric
    (blank: the run has no such value). Columns of metrics this sdp does not know are kept."""
    path = Path(path)
    try:
        with path.open(newline="") as fh:
            reader = csv.DictReader(fh)
            header = reader.fieldnames or []
            rows = list(reader)
    except (OSError, UnicodeDecodeError, csv.Error) as err:
        raise UserError(f"{path}: cannot read ({err}); pass a runs.csv written by sdp ablate --report") from None
    missing = [c for c in RUN_KEY_COLUMNS if c not in header]
    if missing:
        raise UserError(
            f"{path}: no column {missing[0]!r}; pass a runs.csv written by sdp ablate --report"
        )
    if not rows:
        raise UserError(f"{path}: no runs; pass a runs.csv written by sdp ablate --report")
    metrics = [c for c in header if c not in RUN_KEY_COLUMNS]
    out = []
    for number, row in enumerate(rows, 2):
        try:
            values = {c: _optional_float(row[c]) for c in metrics}
            eta, seed = int(row["eta"]), int(row["seed"])
        except (TypeError, ValueError):
            raise UserError(f"{path}:{number}: a value is not a number; restore the file sdp ablate wrote") from None
        extra = tuple(row["other"].split()) if row["other"] else ()
        out.append(RunValues(row["mode"], eta, extra, seed, row["run"], values))
    return out


def _optional_float(text: str | None) -> float | None:
    return None if text is None or text == "" else float(text)


@dataclass
class GroupRow:
    """Mean, sample std (None for n = 1) and count of every metric over the seeds of a group."""

    mode: str
    max_head_offpolicyness: int
    extra: tuple[str, ...]
    seeds: list[int]
    mean: dict[str, float | None] = field(default_factory=dict)
    std: dict[str, float | None] = field(default_factory=dict)
    count: dict[str, int] = field(default_factory=dict)

    @property
    def n(self) -> int:
        return len(self.seeds)

    @property
    def label(self) -> str:
        return " ".join([self.mode, *self.extra])


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise UserError(
            f"{path}: cannot read ({err}); re-run the sweep to rewrite this run"
        ) from None


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The per-step rows of ``metrics.jsonl`` (rows with a reward; eval-only rows skipped).

    A run killed mid-write leaves a torn last line, which is skipped (resuming rewrites it);
    a bad line anywhere else means the file is not what sdp train wrote.
    """
    rows = []
    if not path.is_file():
        return rows
    lines = [(n, line) for n, line in enumerate(path.read_text().splitlines(), 1) if line.strip()]
    for index, (number, line) in enumerate(lines):
        try:
            row = json.loads(line)
        except ValueError:
            if index == len(lines) - 1:
                break
            raise UserError(
                f"{path}:{number}: not JSON; not a metrics file of sdp train, "
                "delete the run and re-run the sweep"
            ) from None
        if row.get("reward/mean") is not None:
            rows.append(row)
    return rows


def read_run(run_dir: Path) -> RunRecord:
    """A run directory of a sweep (finished or not)."""
    layout = RunDir(run_dir)
    overrides = _read_json(layout.overrides)
    if not isinstance(overrides, list) or not all(isinstance(o, str) for o in overrides):
        raise UserError(
            f"{run_dir}/overrides.json: expected a list of strings; not a run of sdp ablate"
        )
    from sdp_cli.config.limits import load_yaml_file

    config = load_yaml_file(layout.config) if layout.config.is_file() else None
    if not isinstance(config, dict):
        raise UserError(f"{run_dir}: no readable config.yaml; not a run of sdp train")
    extra = []
    for override in overrides:
        key, value = split_override(override)
        if key in (MODE_KEY, MAX_HEAD_OFFPOLICYNESS_KEY, SEED_KEY) or key.lstrip("+~") in (
            SWEEP_GROUP,
            "run.dir",
            "resume",
        ):
            continue
        extra.append(f"{key.lstrip('+~')}={value}")
    return RunRecord(
        name=run_dir.name,
        run_dir=run_dir,
        mode=mode_label(config, overrides),
        max_head_offpolicyness=int(config["rollout"]["max_head_offpolicyness"]),
        seed=int(config["seed"]),
        extra=tuple(sorted(extra)),
        summary=_read_json(layout.summary) if layout.finished else None,
        rows=read_metrics(layout.metrics),
    )


@dataclass
class Sweep:
    """The runs of a sweep directory; ``common`` holds the overrides every run shares, which
    are removed from each run's ``extra`` (so ``extra`` is what tells groups apart)."""

    records: list[RunRecord]
    common: tuple[str, ...]


def load_sweep(sweep_dir: Path) -> Sweep:
    """Every run directory under ``<sweep_dir>/runs`` (sorted by mode, η, extra, seed)."""
    runs_dir = Path(sweep_dir) / RUNS_SUBDIR
    if not runs_dir.is_dir():
        raise UserError(
            f"{sweep_dir}: no {RUNS_SUBDIR}/ directory; pass the directory of an sdp ablate sweep"
        )
    records = [
        read_run(d)
        for d in sorted(runs_dir.iterdir())
        if d.is_dir() and RunDir(d).overrides.is_file()
    ]
    if not records:
        raise UserError(f"{runs_dir}: no runs yet; start the sweep with sdp ablate")
    common = set.intersection(*(set(r.extra) for r in records))
    for record in records:
        record.extra = tuple(e for e in record.extra if e not in common)
    return Sweep(
        sorted(records, key=lambda r: (r.mode, r.max_head_offpolicyness, r.extra, r.seed)), tuple(sorted(common))
    )
