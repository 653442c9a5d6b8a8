"""`sdp inspect-weights`: the behavioural importance weights of saved batches, mode by mode.

Parse → read the batches → ``sdp_cli.analysis.inspect.analyse_batches`` → render (rich tables or
JSON) and write the optional figure and weight dump. The math lives in ``sdp_cli.core``; the
analysis in ``sdp_cli.analysis``; docs/inspect-weights.md explains every column.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from sdp_cli.choices import RECOMMENDED_DRIFT_CLIP, REJECTION_LEVELS, REJECTION_METRICS, WEIGHT_ACTIONS
from sdp_cli.errors import UserError

if TYPE_CHECKING:
    from sdp_cli.analysis.inspect import WeightReport

#: this module's command; sdp_cli.cli.main adds it to the root app
app = typer.Typer()

EXAMPLE_BATCH = Path(__file__).resolve().parents[1] / "data" / "example_batch.safetensors"

HELP = """Compare the behavioural importance weights of saved batches under every correction mode.

For bypass (w = 1, the reference), decoupled (w = π_prox/π_behav), segment_wise (w = π_prox_t/π_behav), segment_wise_drift (the segment-wise weight times the drift factor π_prox/π_prox_t clipped into [1/κ, κ], --drift-clip) any mode registered in sdp_cli/modes.py and your own (--mode FILE:FUNCTION), at token, sequence and geometric aggregation: mean, std, min, max and ESS of the weights, the share truncated or masked by --cap/--floor, kl, k3_kl, chi2_token and chi2_seq against π_behav, and a breakdown by staleness (lag = trainer version − token version) with the factor segment-wise drops, π_c/π_{v+1}. Batches come from `sdp train train.save_batches=true` (in runs/<run>/batches/); a directory stands for every *.safetensors file in it, a run directory for its batches/, and several files are analysed together. See docs/inspect-weights.md.

[bold]Examples[/bold]

  sdp inspect-weights --example

  sdp inspect-weights runs/my-run/batches --cap 5 --floor 0.2

  sdp inspect-weights runs/my-run/batches/step-000012.safetensors --json

  sdp inspect-weights runs/my-run/batches --per-file --plot weights.png --dump-weights weights.safetensors

  sdp inspect-weights runs/my-run/batches --mode examples/own_mode/tempered.py:tempered_decoupled

  sdp inspect-weights runs/my-run/batches --m2-threshold 0.04 --opsm-delta 0.5 --rejection-level geometric --rejection-metric k3 --rejection-upper 0.01
"""


@app.command("inspect-weights", help=HELP)
def inspect_weights_command(
    files: list[Path] = typer.Argument(
        None,
        help="Batch files, directories of them, or run directories (their batches/; written by train.save_batches=true).",
        show_default=False,
    ),
    example: bool = typer.Option(
        False, "--example", help="Analyse the small example batch shipped with sdp."
    ),
    cap: float = typer.Option(
        None, "--cap", help="Upper bound of the weights (loss.weight_cap); default none."
    ),
    floor: float = typer.Option(
        None, "--floor", help="Lower bound of the weights (loss.weight_floor); default none."
    ),
    action: str = typer.Option(
        "truncate", "--action", help="truncate (clamp into \\[floor, cap]) or mask (weight 0 outside)."
    ),
    batch_normalize: bool = typer.Option(
        False, "--batch-normalize", help="Divide the bounded weights by their mean (loss.batch_normalize)."
    ),
    drift_clip: float = typer.Option(
        RECOMMENDED_DRIFT_CLIP,
        "--drift-clip",
        help="κ of the segment_wise_drift row: the segment-wise weight times π_prox/π_prox_t clipped "
        "into \\[1/κ, κ] (loss.drift_clip; 1 = segment_wise, inf = decoupled).",
    ),
    per_file: bool = typer.Option(False, "--per-file", help="Also analyse every file on its own."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON document instead of tables."),
    plot: Path = typer.Option(
        None, "--plot", help="Write weight histograms per mode to this PNG file."
    ),
    dump_weights: Path = typer.Option(
        None,
        "--dump-weights",
        help="Write the per-token weights of every mode and aggregation (safetensors).",
    ),
    force: bool = typer.Option(
        False, "--force", help="Replace existing --plot / --dump-weights files (never an input batch)."
    ),
    mode: list[str] = typer.Option(
        None,
        "--mode",
        help="Add a row for your own mode, path/to/file.py:function or package.module:function (as "
        "loss.mode takes it; repeatable). A batch file never makes sdp import code.",
    ),
    rejection_level: str = typer.Option(
        None,
        "--rejection-level",
        help="Measure rejection sampling per mode: token, sequence, geometric or max (loss.rejection.level).",
    ),
    rejection_metric: str = typer.Option(
        "ratio", "--rejection-metric", help="ratio, k2 or k3: what rejection bounds (loss.rejection.metric)."
    ),
    rejection_upper: float = typer.Option(
        2.0, "--rejection-upper", help="Keep where the ratio (or divergence) <= this (loss.rejection.upper)."
    ),
    rejection_lower: float = typer.Option(
        None, "--rejection-lower", help="Keep where the ratio >= this; default 1/upper (loss.rejection.lower)."
    ),
    m2_threshold: float = typer.Option(
        None, "--m2-threshold", help="Measure M2PO's token mask per mode at this τ (loss.m2_threshold)."
    ),
    opsm_delta: float = typer.Option(
        None,
        "--opsm-delta",
        help="Measure OPSM's mask at this δ with π_θ = π_prox, the batch's first optimizer step (loss.opsm_delta).",
    ),
) -> None:
    _check_options(cap, floor, action, drift_clip)
    _check_masks(rejection_level, rejection_metric, rejection_upper, rejection_lower, m2_threshold, opsm_delta)
    if mode:
        from sdp_cli.modes import resolve_mode

        for spec in mode:
            resolve_mode(spec)  # registers it: every registered mode gets a row
    paths = _batch_paths(files or [], example)
    from sdp_cli.fileio import OutputPlan

    plan = OutputPlan(force=force, inputs=paths)
    plot_out = None if plot is None else plan.add(plot, "--plot")
    dump_out = None if dump_weights is None else plan.add(dump_weights, "--dump-weights")

    from sdp_cli.analysis.inspect import MaskOptions, WeightOptions, analyse_batches
    from sdp_cli.rollout.batch_file import read_batch

    batches = [read_batch(p) for p in paths]
    sources = [str(p) for p in paths]
    options = WeightOptions(
        cap=cap, floor=floor, action=action, batch_normalize=batch_normalize, drift_clip=drift_clip
    )
    masks = MaskOptions(
        rejection_level=rejection_level,
        rejection_metric=rejection_metric,
        rejection_upper=rejection_upper,
        rejection_lower=rejection_lower,
        m2_threshold=m2_threshold,
        opsm_delta=opsm_delta,
    )
    report = analyse_batches(batches, sources, options, masks)
    per_file_reports = (
        [analyse_batches([b], [src], options, masks) for b, src in zip(batches, sources)] if per_file else []
    )

    contents: dict[Any, bytes] = {}
    if plot_out is not None:
        from sdp_cli.analysis.plots import weight_histograms

        title = f"{_title(report)}\n{_bounds(report)}"
        contents[plot_out] = weight_histograms(report, title)
    if dump_out is not None:
        from safetensors.torch import save

        from sdp_cli.analysis.inspect import dump_tensors

        tensors, metadata = dump_tensors(report)
        contents[dump_out] = save(tensors, metadata=metadata)
    plan.commit(contents)
    wrote = [
        (out.path, what)
        for out, what in ((plot_out, "weight histograms"), (dump_out, "per-token weights"))
        if out is not None
    ]

    if as_json:
        from sdp_cli.fileio import json_document

        doc = report.to_dict()
        if per_file:
            doc["per_file"] = [r.to_dict() for r in per_file_reports]
        typer.echo(json_document(doc))
        for path, what in wrote:
            typer.echo(f"wrote {what} to {path}", err=True)
        return

    from rich.console import Console
    from rich.markup import escape

    # paths are escaped where they are printed; emoji codes (":thumbs_up:") in them stay text
    console = Console(highlight=False, emoji=False)
    if not console.is_terminal:
        # Piped or captured output has no width to fit; 80 columns would truncate the tables.
        console.width = max(console.width, 120)
    _render(console, report)
    for r in per_file_reports:
        console.rule(f"[bold]{escape(r.sources[0])}")
        _render(console, r)
    for path, what in wrote:
        console.print(f"wrote {what} to {escape(str(path))}")


# ------------------------------------------------------------------ parsing
def _check_options(cap: float | None, floor: float | None, action: str, drift_clip: float) -> None:
    if math.isnan(drift_clip) or drift_clip < 1:
        raise UserError(f"--drift-clip {drift_clip} must be >= 1 (1 = segment_wise, inf = decoupled); pass e.g. --drift-clip 2")
    if action not in WEIGHT_ACTIONS:
        raise UserError(f"--action {action!r} is not one of {', '.join(WEIGHT_ACTIONS)}; pick one of them")
    if cap is not None and not (math.isfinite(cap) and cap > 0):
        raise UserError(f"--cap {cap} must be a finite number > 0; pass e.g. --cap 5")
    if floor is not None and not (math.isfinite(floor) and floor >= 0):
        raise UserError(f"--floor {floor} must be a finite number >= 0; pass e.g. --floor 0.2")
    if cap is not None and floor is not None and floor > cap:
        raise UserError(f"--floor {floor} is above --cap {cap}; pass a floor <= cap")


def _check_masks(
    level: str | None, metric: str, upper: float, lower: float | None, m2_threshold: float | None, opsm_delta: float | None
) -> None:
    """The mask options, checked as the config checks loss.rejection, loss.m2_threshold and loss.opsm_delta."""
    if metric not in REJECTION_METRICS:
        raise UserError(f"--rejection-metric {metric!r} is not one of {', '.join(REJECTION_METRICS)}; pick one of them")
    if level is None:
        if metric != "ratio" or lower is not None:
            raise UserError("--rejection-metric and --rejection-lower need --rejection-level; pass e.g. --rejection-level token")
    else:
        if level not in REJECTION_LEVELS:
            raise UserError(f"--rejection-level {level!r} is not one of {', '.join(REJECTION_LEVELS)}; pick one of them")
        if not (math.isfinite(upper) and upper > 0):
            raise UserError(f"--rejection-upper {upper} must be a finite number > 0; pass e.g. --rejection-upper 2")
        if metric == "ratio" and level == "max":
            raise UserError("--rejection-level max takes a sequence's largest divergence; pass --rejection-metric k2 or k3")
        if metric != "ratio" and lower is not None:
            raise UserError(f"--rejection-lower bounds a ratio, but --rejection-metric {metric} is a divergence; drop it")
        if lower is not None and not (math.isfinite(lower) and 0 <= lower <= upper):
            raise UserError(f"--rejection-lower {lower} must be a finite number in [0, --rejection-upper]")
    if m2_threshold is not None and not (math.isfinite(m2_threshold) and m2_threshold > 0):
        raise UserError(f"--m2-threshold {m2_threshold} must be a finite number > 0; pass e.g. --m2-threshold 0.04")
    if opsm_delta is not None and not (math.isfinite(opsm_delta) and opsm_delta >= 0):
        raise UserError(f"--opsm-delta {opsm_delta} must be a finite number >= 0; pass e.g. --opsm-delta 0.5")


def _batch_paths(files: list[Path], example: bool) -> list[Path]:
    """The files to analyse (``expand_batch_paths``: directories and runs expanded, one file
    twice refused), plus the example."""
    from sdp_cli.analysis.batch_files import expand_batch_paths

    if example and not EXAMPLE_BATCH.is_file():
        raise UserError(f"{EXAMPLE_BATCH}: the example batch is missing from this installation; reinstall sdp")
    paths = expand_batch_paths([*files, *([EXAMPLE_BATCH] if example else [])])
    if not paths:
        raise UserError("no batch file given; pass batch files (or a directory of them), or --example")
    return paths


# ---------------------------------------------------------------- rendering
def _fmt(value: float | None) -> str:
    """A statistic, or n/a where it is not defined (no tokens, no π_prox)."""
    return "n/a" if value is None else f"{value:.4g}"


#: runs of consecutive versions shown one by one; more become "first–last (n versions, with gaps)"
MAX_VERSION_RUNS = 3


def version_ranges(versions: list[int]) -> str:
    """``11–60`` for 50 consecutive versions, ``11–13, 20–21`` for a few runs of them, and
    ``11–109 (50 versions, with gaps)`` when there are more than ``MAX_VERSION_RUNS`` runs."""
    unique = sorted(set(versions))
    runs: list[list[int]] = []
    for v in unique:
        if runs and v == runs[-1][1] + 1:
            runs[-1][1] = v
        else:
            runs.append([v, v])
    if len(runs) > MAX_VERSION_RUNS:
        return f"{unique[0]}–{unique[-1]} ({len(unique)} versions, with gaps)"
    return ", ".join(str(a) if a == b else f"{a}–{b}" for a, b in runs)


def _title(report: WeightReport) -> str:
    lags = [row.lag for row in report.lags]
    n = len(report.sources)
    several = len(set(report.trainer_versions)) > 1
    text = (
        f"{n} batch{'es' if n > 1 else ''}: {report.sequences} sequences, {report.tokens} response tokens, "
        f"trainer version{'s' if several else ''} {version_ranges(report.trainer_versions)}"
    )
    return text + (f", lag {min(lags)}–{max(lags)}" if lags else "")


def _bounds(report: WeightReport) -> str:
    o = report.options
    if o.cap is None and o.floor is None:
        text = "bounds: none (raw weights)"
    else:
        low = "0" if o.floor is None else _fmt(o.floor)
        high = "∞" if o.cap is None else _fmt(o.cap)
        text = f"bounds: [{low}, {high}], {o.action}"
    return text + ("; batch-normalised to mean 1" if o.batch_normalize else "")


@dataclass
class _Table:
    """A table printed at the console's width, no header or cell cut: when the whole does not
    fit, the ``spill`` label column (if any) becomes a legend line under the table, then the
    ``groups`` of number columns (each kept together) are split over as many parts as it takes,
    each part repeating the other ``labels``. The last ``number_labels`` labels are numbers
    (right-aligned, as every group column)."""

    title: str
    labels: list[str]
    groups: list[list[str]]
    number_labels: int = 0
    spill: int | None = None
    rows: list[tuple[list[str], bool]] = field(default_factory=list)

    def add_row(self, *cells: str, end_section: bool = False) -> None:
        self.rows.append((list(cells), end_section))

    def _build(self, title: str, labels: list[int], groups: list[int]) -> Any:
        from rich import box
        from rich.table import Table

        table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD)
        starts = [len(self.labels)]
        for group in self.groups:
            starts.append(starts[-1] + len(group))
        columns = labels + [c for g in groups for c in range(starts[g], starts[g + 1])]
        names = self.labels + [name for group in self.groups for name in group]
        for c in columns:
            left = c < len(self.labels) - self.number_labels
            table.add_column(names[c], justify="left" if left else "right", no_wrap=True)
        for cells, end_section in self.rows:
            table.add_row(*(cells[c] for c in columns), end_section=end_section)
        return table

    def print(self, console: Any) -> None:
        from rich.markup import escape
        from rich.measure import Measurement

        def width(labels: list[int], groups: list[int]) -> int:
            table = self._build("", labels, groups)
            return Measurement.get(console, console.options.update_width(1 << 20), table).maximum

        labels, every = list(range(len(self.labels))), list(range(len(self.groups)))
        spilled = self.spill is not None and width(labels, every) > console.width
        if spilled:
            labels.remove(self.spill)
        parts: list[list[int]] = [[]]
        for g in every:
            if parts[-1] and width(labels, [*parts[-1], g]) > console.width:
                parts.append([])
            parts[-1].append(g)
        for i, groups in enumerate(parts, start=1):
            title = self.title if len(parts) == 1 else f"{self.title} ({i} of {len(parts)})"
            console.print(self._build(title, labels, groups))
        if spilled:
            pairs = [f"{cells[0]} = {cells[self.spill]}" for cells, _ in self.rows if cells[0]]
            console.print(escape(f"{self.labels[self.spill]}: {'; '.join(pairs)}"), style="dim")


def _render(console: Any, report: WeightReport) -> None:
    """The three tables: weights per mode × aggregation, divergences per mode, lags."""
    from rich.markup import escape

    from sdp_cli.analysis.inspect import DIVERGENCES, target

    o = report.options
    bounded = o.cap is not None or o.floor is not None
    console.print(f"[bold]{escape(_title(report))}[/bold] — {escape(_bounds(report))}")

    stats = ("mean", "std", "min", "max", "ess")
    share_col = ["masked" if o.action == "mask" else "truncated"] if bounded else []
    weights = _Table(
        "Behavioural importance weights w",
        ["mode", "agg", "tokens"],
        [["mean"], ["std"], ["min"], ["max"], ["ESS"], *([share_col] if share_col else [])],
        number_labels=1,
    )
    notes = []
    for name, m in report.modes.items():
        if not m.available:
            weights.add_row(name, "–", "unavailable", *[""] * (len(stats) + len(share_col)))
            notes.append(f"[yellow]{name}: {escape(m.reason or '')}[/yellow]")
            continue
        # a mode without a weight (bypass) is w ≡ 1 at every aggregation: one row says it.
        levels = ["token"] if m.reference else list(m.weights)
        for i, level in enumerate(levels):
            s = m.weights[level]
            high, low = s.get("frac_high"), s.get("frac_low")
            share = s.get("masked") if o.action == "mask" else None if high is None or low is None else high + low
            weights.add_row(
                name if i == 0 else "",
                "any (w ≡ 1)" if m.reference else level,
                str(m.tokens) if i == 0 else "",
                *(_fmt(s[k]) for k in stats),
                *(["n/a" if share is None else f"{share:.1%}"] if bounded else []),
                end_section=i == len(levels) - 1,
            )
    weights.print(console)
    if report.uncorrectable:
        notes.append(
            f"segment_wise: {report.uncorrectable} stale tokens have no π_{{v+1}} (their window closed); "
            "they are left out of segment_wise"
        )
    for note in notes:
        console.print(note)

    if report.mask_options.any:
        _render_masks(console, report)

    div = _Table(
        "Divergence from π_behav (training policy = the mode's target)",
        ["mode", "target"],
        [[d] for d in DIVERGENCES],
        spill=1,
    )
    for name, m in report.modes.items():
        values = [_fmt(m.divergence[k]) for k in DIVERGENCES] if m.available else ["unavailable", "", "", ""]
        div.add_row(name, target(name), *values)
    div.print(console)

    show_unc = any(row.uncorrectable for row in report.lags)
    lags = _Table(
        "By staleness, lag = trainer version − token version (raw token weights)",
        ["lag", "tokens"],
        [
            ["w_dec mean", "std", "ESS"],
            ["w_seg mean", "std", "ESS"],
            ["π_c/π_{v+1} mean", "std", "κ-clipped"],
            *([["no π_{v+1}"]] if show_unc else []),
        ],
        number_labels=2,
    )
    for row in report.lags:
        dec, seg, dropped = row.w_dec or {}, row.w_segment_wise or {}, row.dropped or {}
        lags.add_row(
            str(row.lag),
            str(row.tokens),
            *(_fmt(dec.get(k)) for k in ("mean", "std", "ess")),
            *(_fmt(seg.get(k)) for k in ("mean", "std", "ess")),
            *(_fmt(dropped.get(k)) for k in ("mean", "std")),
            "n/a" if row.drift_clipped is None else f"{row.drift_clipped:.1%}",
            *([str(row.uncorrectable)] if show_unc else []),
        )
    lags.print(console)
    console.print(
        "w_seg = π_prox_t/π_behav, the segment-wise weight. π_c/π_{v+1} = w_dec / w_seg is the factor segment-wise drops: 1 at lag ≤ 1 (at lag 0 up to the "
        "engine–trainer mismatch); at lag ≥ 2 it is the bias segment-wise accepts for its lower variance. "
        f"κ-clipped: the share of it outside [1/κ, κ], κ = {_fmt(report.options.drift_clip)} "
        "(segment_wise_drift keeps the rest of it).",
        style="dim",
    )


def _render_masks(console: Any, report: WeightReport) -> None:
    """Share of each mode's tokens that every configured mask drops (docs/inspect-weights.md)."""
    from sdp_cli.analysis.inspect import MASKS

    configured = [name for name in MASKS if any(name in m.masks for m in report.modes.values() if m.available)]
    table = _Table("Masked tokens (share of the mode's tokens)", ["mode", "tokens"], [[c] for c in configured], number_labels=1)
    for name, m in report.modes.items():
        if not m.available:
            continue
        values = [m.masks.get(mask) for mask in configured]
        table.add_row(name, str(m.tokens), *("n/a" if v is None else f"{v:.1%}" for v in values))
    table.print(console)
