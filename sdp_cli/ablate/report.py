"""Aggregate a sweep: per-run numbers, per-group mean ± std, the study's paired contrasts; CSV,
Markdown, plots.

Runs are read by ``sdp_cli.ablate.records``, from a sweep directory or from the ``runs.csv`` a
report wrote. A run belongs to the group of its overrides minus the seed; groups are shown by
mode, η and any other swept key.

Per run (``run_metrics``), from ``metrics.jsonl`` rows that carry ``reward/mean``, for every
shadow weight the mode registry defines (``records.shadows``: built in ``dec``, ``segment_wise``
and ``drift``; a registered mode adds ``w_<mode>_*``):
- ``w_<shadow>_std``: the population std of the raw shadow weight over every response token of
  the run, pooled exactly from the per-step token count n_i, mean μ_i and std σ_i:
  σ² = Σ n_i (σ_i² + μ_i²) / N − μ², μ = Σ n_i μ_i / N.
- ``w_<shadow>_ess``: the per-step ESS fraction 1 / mean((w / mean w)²), averaged over steps
  (the probe's measure; std is dominated by a few huge ratios, ESS is not).
- ``w_<shadow>_max``: the largest raw weight of the run. ``drift`` is the
  drift-clipped weight with κ = the run's ``loss.drift_clip`` (choices.RECOMMENDED_DRIFT_CLIP
  where it trains without one);
  ``drift_clipped``: mean over steps of the share of tokens whose drift factor the clip changed.
- ``trained_ess``, ``trained_ess_raw``: mean over steps of ``weights/trained_ess`` and
  ``weights/trained_ess_raw``, the ESS fraction of the weight the run trained with at the level
  it trained with (per sequence for sequence-level runs), after and before truncation or
  masking; ``trained_token_ess``: mean of ``weights/rollout_is_eff_sample_size``, the token-level
  ESS of the weights the loss used. Blank for runs that did not log them.
- ``lag``: mean over steps of the mean token lag c − v; ``kl``: mean of ``offpolicy/kl``
  (π_behav vs π_prox); ``ppo_kl``: mean of ``loss/ppo_kl`` (how far each update moves).
- ``filtered``: groups dropped by the staleness strategy / groups generated.
- ``wall_s``: the training loop's time, Σ over steps of ``time/{wait,train,push}_s``;
  ``tokens_per_s`` = the last ``throughput/tokens_generated_total`` / ``wall_s``; ``steps_per_s``
  and ``recompute_share`` (Σ ``time/recompute_s`` + ``time/recompute_ahead_s`` / ``wall_s``)
  likewise. Summed per step rather than taken from summary.json, so a resumed run counts the time
  of both sessions.
- from ``summary.json``: final reward (mean of the last window), greedy accuracy at the end.

The study (``sdp_cli.ablate.study``: registered in the sweep directory, given with ``--study``,
or the default) decides the paired contrasts (``sdp_cli.ablate.contrasts``), written to
``study.csv`` and as the first section of ``summary.md`` (``sdp_cli.ablate.study_tables``).
"""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sdp_cli.ablate.contrasts import Contrast, study_contrasts
from sdp_cli.ablate.records import (
    Curves,
    GroupKey,
    GroupRow,
    RunRecord,
    RunValues,
    load_sweep,
    read_runs_csv,
    shadows,
)
from sdp_cli.ablate.study import Study, check_study, read_registration, read_study_file, study_path
from sdp_cli.ablate.sweep import MAX_HEAD_OFFPOLICYNESS_KEY, split_override
from sdp_cli.errors import UserError
from sdp_cli.fileio import atomic_write_text


@dataclass(frozen=True)
class Metric:
    """One aggregated column: key, short label, meaning, number format, and its table
    (``weights``: both behavioural weights on the same tokens; ``outcome``: training and cost)."""

    key: str
    label: str
    doc: str
    fmt: str
    table: str


#: the columns before the shadow weights' (``_shadow_metrics``) and after them
_LEADING: tuple[Metric, ...] = (
    Metric("lag", "lag", "mean token lag c − v (realised staleness)", ".2f", "weights"),
    Metric(
        "reward_last",
        "reward",
        "mean reward over the last window of steps (summary.json)",
        ".3f",
        "outcome",
    ),
    Metric("acc_end", "acc", "greedy accuracy after training", ".3f", "outcome"),
)
_TRAILING: tuple[Metric, ...] = (
    Metric(
        "trained_ess",
        "ESS trained",
        "mean per-step ESS fraction of the weight the run trained with, at its training level "
        "(per sequence for sequence-level runs), after truncation or masking",
        ".3f",
        "weights",
    ),
    Metric(
        "trained_ess_raw",
        "ESS trained raw",
        "the same before truncation or masking",
        ".3f",
        "weights",
    ),
    Metric(
        "trained_token_ess",
        "ESS trained tok",
        "mean per-step token-level ESS fraction of the weights the loss used",
        ".3f",
        "weights",
    ),
    Metric("kl", "kl", "mean offpolicy/kl between π_behav and π_prox", ".4f", "weights"),
    Metric("mismatch", "mismatch", "mean |log π_behav − log π_prox| on lag-0 tokens (engine vs trainer numerics)", ".4f", "weights"),
    Metric("clipfrac", "clipfrac", "mean loss/pg_clipfrac: share of tokens the PPO clip (or CISPO/DPPO band) held", ".3f", "weights"),
    Metric("rejected", "rejected", "mean share of tokens loss.rejection dropped", ".3f", "weights"),
    Metric("m2po", "m2po", "mean share of tokens M2PO's second-moment mask dropped", ".3f", "weights"),
    Metric("opsm", "opsm", "mean share of tokens OPSM zeroed", ".3f", "weights"),
    Metric("ppo_kl", "ppo kl", "mean loss/ppo_kl (policy movement per update)", ".4f", "outcome"),
    Metric(
        "filtered",
        "filtered",
        "fraction of generated groups dropped for staleness",
        ".3f",
        "outcome",
    ),
    Metric(
        "tokens_per_s",
        "tok/s",
        "generated tokens per second of the training loop",
        ".0f",
        "outcome",
    ),
    Metric("steps_per_s", "steps/s", "training steps per second", ".2f", "outcome"),
    Metric(
        "wall_s",
        "wall s",
        "seconds in the training loop (evaluation and setup excluded)",
        ".0f",
        "outcome",
    ),
    Metric(
        "recompute_share",
        "recompute",
        "share of wall time spent in the recompute pass",
        ".3f",
        "outcome",
    ),
)


def _shadow_metrics() -> list[Metric]:
    """std, ESS and max of every shadow weight (``records.shadows``, from the mode registry),
    then the κ-clipped share of each drift-clipped one."""
    weights = shadows()
    out = [Metric(f"w_{w.short}_std", f"std {w.label}", f"pooled std of {w.weight}", ".3f", "weights") for w in weights]
    out += [
        Metric(f"w_{w.short}_ess", f"ESS {w.label}", f"mean per-step ESS fraction of {w.ess}", ".3f", "weights")
        for w in weights
    ]
    out += [Metric(f"w_{w.short}_max", f"max {w.label}", f"largest {w.largest}", ".1f", "weights") for w in weights]
    out += [
        Metric(
            w.clipped,
            "κ-clipped" if w.short == "drift" else f"κ-clipped {w.label}",
            "mean per-step share of tokens whose drift factor π_prox/π_{v+1} the clip changed",
            ".3f",
            "weights",
        )
        for w in weights
        if w.drift
    ]
    return out


def metrics() -> tuple[Metric, ...]:
    """Every column of the report, in order: the shadow weights' are those the mode registry
    defines when the report is made (a mode registered later adds its columns)."""
    return (*_LEADING, *_shadow_metrics(), *_TRAILING)


# ------------------------------------------------------------------- maths
def _values(rows: Iterable[dict[str, Any]], key: str) -> list[float]:
    return [float(r[key]) for r in rows if r.get(key) is not None]


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def pooled_std(
    counts: Sequence[float], means: Sequence[float], stds: Sequence[float]
) -> float | None:
    """Population std of the union of groups of sizes n_i, means μ_i, population stds σ_i."""
    total = sum(counts)
    if total <= 0:
        return None
    mean = sum(n * m for n, m in zip(counts, means, strict=True)) / total
    second = sum(n * (s * s + m * m) for n, m, s in zip(counts, means, stds, strict=True)) / total
    return math.sqrt(max(second - mean * mean, 0.0))


def run_metrics(record: RunRecord) -> dict[str, float | None]:
    """Per-run scalars (see the module docstring); None where a run has no such data."""
    rows = record.rows
    out: dict[str, float | None] = {
        "lag": _mean(_values(rows, "staleness/lag_mean")),
        "kl": _mean(_values(rows, "offpolicy/kl")),
        "ppo_kl": _mean(_values(rows, "loss/ppo_kl")),
        "trained_ess": _mean(_values(rows, "weights/trained_ess")),
        "trained_ess_raw": _mean(_values(rows, "weights/trained_ess_raw")),
        "trained_token_ess": _mean(_values(rows, "weights/rollout_is_eff_sample_size")),
        # the field's corrections (docs/math.md §9): what each mask or clip held, where the run had it
        "mismatch": _mean(_values(rows, "mismatch/lag0_abs_mean")),
        "clipfrac": _mean(_values(rows, "loss/pg_clipfrac")),
        "rejected": _mean(_values(rows, "rejection/rollout_rs_masked_fraction")),
        "m2po": _mean(_values(rows, "m2po/masked_fraction")),
        "opsm": _mean(_values(rows, "opsm/masked_fraction")),
    }
    for shadow in shadows():
        short = shadow.short
        prefix = f"shadow/{shadow.name}/rollout_is_"
        usable = [
            r
            for r in rows
            if all(
                r.get(k) is not None
                for k in (f"{prefix}mean", f"{prefix}std", "batch/response_tokens")
            )
        ]
        out[f"w_{short}_std"] = pooled_std(
            _values(usable, "batch/response_tokens"),
            _values(usable, f"{prefix}mean"),
            _values(usable, f"{prefix}std"),
        )
        out[f"w_{short}_ess"] = _mean(_values(rows, f"{prefix}eff_sample_size"))
        maxima = _values(rows, f"{prefix}max")
        out[f"w_{short}_max"] = max(maxima) if maxima else None
        if shadow.drift:
            out[shadow.clipped] = _mean(_values(rows, f"shadow/{shadow.name}/drift_clipped_fraction"))
    wall = sum(
        _values(rows, "time/wait_s") + _values(rows, "time/train_s") + _values(rows, "time/push_s")
    )
    tokens = _values(rows, "throughput/tokens_generated_total")
    out["wall_s"] = wall if wall > 0 else None
    out["tokens_per_s"] = tokens[-1] / wall if wall > 0 and tokens else None
    out["steps_per_s"] = len(rows) / wall if wall > 0 else None
    spent = sum(_values(rows, "time/recompute_s")) + sum(_values(rows, "time/recompute_ahead_s"))
    out["recompute_share"] = spent / wall if wall > 0 else None
    summary = record.summary or {}
    generated = (summary.get("counters") or {}).get("groups_generated")
    filtered = summary.get("filtered_groups")
    out["filtered"] = filtered / generated if generated and filtered is not None else None
    out["reward_last"] = summary.get("reward_last")
    out["acc_end"] = summary.get("greedy_accuracy_end")
    return out


def _std(values: Sequence[float]) -> float | None:
    """Sample standard deviation (n − 1); None below two values."""
    if len(values) < 2:
        return None
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def run_values(records: Sequence[RunRecord]) -> list[RunValues]:
    """The per-run numbers of the finished runs (the rows of runs.csv)."""
    return [
        RunValues(r.mode, r.max_head_offpolicyness, r.extra, r.seed, r.name, run_metrics(r))
        for r in records
        if r.finished
    ]


def aggregate(runs: Sequence[RunValues]) -> list[GroupRow]:
    """One row per (mode, η, other swept values): mean, std and n over the runs."""
    groups: dict[GroupKey, list[RunValues]] = {}
    for run in runs:
        groups.setdefault(run.group, []).append(run)
    out = []
    columns = metrics()
    for (mode, bound, extra), members in sorted(groups.items()):
        row = GroupRow(mode, bound, extra, sorted(r.seed for r in members))
        for metric in columns:
            values = [float(v) for r in members if (v := r.values.get(metric.key)) is not None]
            row.mean[metric.key] = _mean(values)
            row.std[metric.key] = _std(values)
            row.count[metric.key] = len(values)
        out.append(row)
    return out


def reward_curves(records: Sequence[RunRecord]) -> Curves:
    """Per group: steps, mean reward over the seeds per step, its sample std (0 for one seed).

    Only steps every finished run of the group reached are kept."""
    by_group: dict[GroupKey, list[dict[int, float]]] = {}
    for record in records:
        if record.finished:
            curve = {int(r["step"]): float(r["reward/mean"]) for r in record.rows}
            by_group.setdefault(record.group, []).append(curve)
    out = {}
    for group, curves in sorted(by_group.items()):
        steps = sorted(set.intersection(*(set(c) for c in curves)))
        means, stds = [], []
        for step in steps:
            values = [c[step] for c in curves]
            means.append(sum(values) / len(values))
            stds.append(_std(values) or 0.0)
        out[group] = (steps, means, stds)
    return out


# ----------------------------------------------------------------- writing
TABLES = {
    "weights": "Behavioural weights, both measured on the same tokens in every run",
    "outcome": "Training outcome and cost",
}


def _cell(mean: float | None, std: float | None, fmt: str) -> str:
    if mean is None:
        return "n/a"
    return format(mean, fmt) if std is None else f"{mean:{fmt}} ± {std:{fmt}}"


def _metrics_of(table: str, groups: Sequence[GroupRow]) -> list[Metric]:
    """The table's metrics that some group has a value of (a column no run logged is left out
    of the human tables; the CSV keeps it)."""
    assert table in TABLES, f"unknown table {table!r}"
    return [m for m in metrics() if m.table == table and any(g.count.get(m.key) for g in groups)]


def table_columns(groups: Sequence[GroupRow], table: str) -> list[str]:
    """Header of a human table: group keys, n, then the table's metric labels."""
    extra = ["other"] if any(g.extra for g in groups) else []
    return ["mode", "η", *extra, "n", *(m.label for m in _metrics_of(table, groups))]


def table_rows(groups: Sequence[GroupRow], table: str) -> list[list[str]]:
    """Cells of a human table (``mean ± std``; a single seed shows the value alone)."""
    with_extra = any(g.extra for g in groups)
    rows = []
    for g in groups:
        cells = [g.mode, str(g.max_head_offpolicyness), *([" ".join(g.extra)] if with_extra else []), str(g.n)]
        cells += [_cell(g.mean[m.key], g.std[m.key], m.fmt) for m in _metrics_of(table, groups)]
        rows.append(cells)
    return rows


def to_markdown(groups: Sequence[GroupRow]) -> str:
    """Both tables in GitHub Markdown, each followed by what its columns mean."""
    parts = []
    for table, title in TABLES.items():
        header = table_columns(groups, table)
        lines = [f"### {title}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(cells) + " |" for cells in table_rows(groups, table)]
        lines += [""] + [f"- **{m.label}**: {m.doc}" for m in _metrics_of(table, groups)]
        parts.append("\n".join(lines))
    return "\n\n".join(parts) + "\n"


def runs_csv(runs: Sequence[RunValues]) -> str:
    """One row per finished run: its group, seed and every per-run metric (per-seed numbers)."""
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    columns = metrics()
    writer.writerow(["mode", "eta", "other", "seed", "run", *(m.key for m in columns)])
    for run in runs:
        writer.writerow(
            [
                run.mode,
                run.max_head_offpolicyness,
                " ".join(run.extra),
                run.seed,
                run.name,
                *(_num(run.values.get(m.key)) for m in columns),
            ]
        )
    return buf.getvalue()


def to_csv(groups: Sequence[GroupRow]) -> str:
    """Machine-readable table: group keys, seeds, n, then ``<metric>_mean``, ``_std``, ``_n``."""
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    columns = metrics()
    writer.writerow(
        [
            "mode",
            "eta",  # η = rollout.max_head_offpolicyness
            "other",
            "seeds",
            "n",
            *(f"{m.key}_{s}" for m in columns for s in ("mean", "std", "n")),
        ]
    )
    for g in groups:
        cells: list[Any] = [g.mode, g.max_head_offpolicyness, " ".join(g.extra), " ".join(map(str, g.seeds)), g.n]
        for m in columns:
            cells += [_num(g.mean[m.key]), _num(g.std[m.key]), g.count[m.key]]
        writer.writerow(cells)
    return buf.getvalue()


def _num(value: float | None) -> str:
    return "" if value is None else repr(float(value))


# ------------------------------------------------------------------ inputs
@dataclass
class RunTable:
    """What a report aggregates: the finished runs' numbers, the overrides every run shares, the
    names of unfinished runs, the reward curves (None when read from a runs.csv), the directory
    that may hold the sweep's study.json, and the runs.csv read (None for a sweep directory)."""

    runs: list[RunValues]
    common: tuple[str, ...]
    unfinished: list[str]
    curves: Curves | None
    directory: Path
    csv_path: Path | None = None

    @classmethod
    def load(cls, source: Path) -> RunTable:
        """A sweep directory, or the runs.csv of a report (then its directory holds study.json)."""
        source = Path(source)
        if source.suffix == ".csv" or source.is_file():
            if source.suffix != ".csv" or not source.is_file():
                raise UserError(f"--report {source}: no such sweep directory or runs.csv; pass one that a sweep or report wrote")
            return cls(read_runs_csv(source), (), [], None, source.parent, source)
        sweep = load_sweep(source)
        unfinished = [r.name for r in sweep.records if not r.finished]
        return cls(run_values(sweep.records), sweep.common, unfinished, reward_curves(sweep.records), source)


def _axes(runs: Sequence[RunValues]) -> dict[str, list[str]]:
    """The keys the runs vary (η always), with their values, for checking a study against them."""
    axes: dict[str, set[str]] = {MAX_HEAD_OFFPOLICYNESS_KEY: {str(r.max_head_offpolicyness) for r in runs}}
    for run in runs:
        for override in run.extra:
            key, value = split_override(override)
            axes.setdefault(key, set()).add(value)
    return {k: sorted(v) for k, v in axes.items()}


#: the study a report tests when none is registered and none is given
DEFAULT_STUDY = Study()


def resolve_study(table: RunTable, study_file: Path | None) -> tuple[Study, str]:
    """The study to test and where it comes from: ``--study FILE`` (checked against the runs;
    post hoc), else the sweep's registration (study.json), else ``DEFAULT_STUDY``."""
    registration = read_registration(table.directory)
    if study_file is not None:
        study = read_study_file(study_file)
        check_study(study, {r.mode for r in table.runs}, _axes(table.runs), f"--study {study_file}", "fix the study file")
        instead = f", instead of the registered {study_path(table.directory)}" if registration else ""
        return study, f"from {study_file}{instead}; chosen after the runs (post hoc)"
    if registration is not None:
        return registration.study, (
            f"registered in {study_path(table.directory)} at {registration.registered}, before the sweep ran "
            f"(from {registration.source})"
        )
    return DEFAULT_STUDY, (
        "none registered; the default: baseline decoupled, no primary contrast, no equivalence margin "
        "(give one with --study FILE)"
    )


# ----------------------------------------------------------------- reports
@dataclass
class Report:
    """What ``write_report`` computed and wrote."""

    groups: list[GroupRow]
    table: RunTable
    study: Study
    provenance: str
    primary: Contrast | None
    secondary: list[Contrast]
    written: list[Path]
    plots: list[Path]

    @property
    def unfinished(self) -> list[str]:
        return self.table.unfinished


def write_report(
    source: Path, *, plots: bool = True, study_file: Path | None = None, out: Path | None = None
) -> Report:
    """Aggregate a sweep directory or a runs.csv (``source``) and test its study (``resolve_study``);
    write ``summary.csv``, ``summary.md``, ``study.csv``, ``runs.csv`` (not from a runs.csv: that
    is the input) and ``plots/*.png`` into ``out`` (default: the sweep directory, or the
    directory of the runs.csv). Everything is checked before anything is written."""
    from sdp_cli.ablate.study_tables import study_csv, study_markdown

    table = RunTable.load(Path(source))
    study, provenance = resolve_study(table, study_file)
    groups = aggregate(table.runs)
    primary, secondary = study_contrasts(table.runs, study, table.common)
    directory = Path(out) if out is not None else table.directory
    if directory.exists() and not directory.is_dir():
        raise UserError(f"--out {directory}: not a directory; pass a directory for the report's files")
    directory.mkdir(parents=True, exist_ok=True)
    files = {
        "summary.csv": to_csv(groups),
        "study.csv": study_csv(primary, secondary, study),
    }
    if table.csv_path is None:
        files["runs.csv"] = runs_csv(table.runs)
    common = f"Overrides shared by every run: `{' '.join(table.common)}`.\n\n" if table.common else ""
    read_from = f"Read from `{table.csv_path}`.\n\n" if table.csv_path is not None else ""
    files["summary.md"] = (
        f"# sdp ablate: {table.directory.name}\n\n{read_from}{common}"
        f"{study_markdown(primary, secondary, study, provenance)}\n"
        "## Tables\n\nmean ± sample std over seeds (n runs per row).\n\n"
        f"{to_markdown(groups)}"
    )
    written = []
    for name, text in files.items():
        # a rename: never writes through a link (docs/reliability.md, "Links and special files in a run directory")
        atomic_write_text(directory / name, text)
        written.append(directory / name)
    made: list[Path] = []
    if plots and groups:
        from sdp_cli.ablate.plots import write_plots

        made = write_plots(groups, table.curves, directory / "plots", [*([primary] if primary else []), *secondary], study)
    return Report(groups, table, study, provenance, primary, secondary, written, made)
