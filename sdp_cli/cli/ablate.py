"""`sdp ablate`: run a staleness × mode sweep (or re-aggregate one) and print its tables."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import typer

from sdp_cli.errors import UserError

if TYPE_CHECKING:
    from sdp_cli.ablate.report import Report
    from sdp_cli.ablate.study import Study
    from sdp_cli.ablate.sweep import SweepPlan

#: this module's command; sdp_cli.cli.main adds it to the root app
app = typer.Typer()

ABLATE_HELP = """Sweep staleness η × correction mode × seeds and measure what each correction buys.

Every job is one `sdp train` run with the shadow recompute pass on, so both behavioural weights (decoupled π_prox/π_behav and segment-wise π_{v+1}/π_behav) are measured on the same tokens whatever the mode trains. Sweeps live in sdp_cli/conf/ablate/ (default, harsh, smoke; the studies s1-s5 of docs/results.md); any axis or config key can be overridden (a comma list or range(...) makes an axis), and the launcher is a Hydra override (hydra/launcher=basic|joblib|submitit_slurm|ray). Re-running the same command resumes: finished runs are skipped, interrupted ones continue from their checkpoint (finished runs keep their results but not their checkpoints, unless --keep-checkpoints).

Before the first run, the sweep's study (sdp_cli/conf/ablate/study/<sweep>.yaml, or --study FILE: the metric, the fixed baseline, the one primary contrast, the equivalence margin) is checked against the plan and written to DIR/study.json. The report pairs runs by seed, tests the primary contrast alone and Holm-adjusts the others, and gives each a verdict: better, worse, equivalent within the margin, or inconclusive with its minimum detectable effect. Writes DIR/summary.md, DIR/summary.csv, DIR/study.csv, DIR/runs.csv and DIR/plots/*.png; see docs/ablate.md.

[bold]Examples[/bold]

  sdp ablate                                   # the default sweep (125 runs, ~2 h on 2 CPU cores)

  sdp ablate smoke                             # a tiny grid, about a minute

  sdp ablate default seed=0,1 rollout.max_head_offpolicyness=0,8 --dir runs/ablate/quick

  sdp ablate harsh hydra/launcher=basic        # one job at a time

  sdp ablate --report runs/ablate/default      # re-aggregate without running anything

  sdp ablate --report DIR/runs.csv --study S.yaml --out OUT   # from the run table alone
"""


@app.command(
    "ablate",
    help=ABLATE_HELP,
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
)
def ablate_command(
    ctx: typer.Context,
    sweep: str = typer.Argument("default", help="Sweep name (a file in sdp_cli/conf/ablate)."),
    directory: Path | None = typer.Option(
        None,
        "--dir",
        "-d",
        help="Sweep directory \\[default: runs/ablate/SWEEP].",
        show_default=False,
    ),
    jobs: int | None = typer.Option(
        None,
        "--jobs",
        "-j",
        min=1,
        help="Parallel jobs of the joblib launcher \\[default: one per core].",
        show_default=False,
    ),
    report: Path | None = typer.Option(
        None,
        "--report",
        help="Only aggregate: an existing sweep directory, or the runs.csv a report wrote (no training).",
        show_default=False,
    ),
    dry_run: bool = typer.Option(
        False, "--dry-run", help="Validate the sweep and its study, print the plan and exit."
    ),
    study: Path | None = typer.Option(
        None,
        "--study",
        help="A study file (YAML) to register instead of the sweep's own; with --report: test it "
        "instead of the registered study (reported as chosen after the runs).",
        show_default=False,
    ),
    no_study: bool = typer.Option(
        False,
        "--no-study",
        help="Run without registering a study (the report then uses the default: baseline decoupled, no primary).",
    ),
    out: Path | None = typer.Option(
        None,
        "--out",
        help="With --report: where to write the report \\[default: the sweep directory, or the runs.csv's].",
        show_default=False,
    ),
    against: str | None = typer.Option(None, "--against", hidden=True),
    no_plots: bool = typer.Option(
        False, "--no-plots", help="Write the table files but no PNG plots."
    ),
    keep_checkpoints: bool = typer.Option(
        False,
        "--keep-checkpoints",
        help="Keep the checkpoints of finished runs (by default deleted: only resuming uses them).",
    ),
    config_dir: Path | None = typer.Option(
        None,
        "--config-dir",
        "-cd",
        help="A directory of your YAML configs, as for sdp train (task=x, +preset=y from DIR/task, DIR/preset).",
        show_default=False,
    ),
    config_name: str | None = typer.Option(
        None,
        "--config-name",
        "-cn",
        help="A primary config in --config-dir to use instead of sdp's, as for sdp train.",
        show_default=False,
    ),
    mode: list[str] = typer.Option(
        None,
        "--mode",
        help="With --report: your own mode, path/to/file.py:function (as loss.mode takes it; repeatable), so "
        "its shadow weight gets columns. Run files never make sdp import code.",
    ),
) -> None:
    overrides = list(ctx.args)
    if "=" in sweep:  # `sdp ablate seed=0,1`: an override in the sweep's place
        overrides.insert(0, sweep)
        sweep = "default"
    if against is not None:
        raise UserError(
            "--against was removed: the report compares every mode with the study's fixed baseline, "
            "paired by seed; choose the baseline in a study file (--study FILE), see docs/ablate.md"
        )
    if report is not None:
        if overrides or directory is not None or jobs is not None or dry_run or keep_checkpoints or config_dir or config_name or no_study:
            raise UserError(
                "--report only aggregates an existing sweep; "
                "drop the sweep name, overrides and other options"
            )
        if mode:
            from sdp_cli.modes import resolve_mode

            for spec in mode:
                resolve_mode(spec)  # registers it: every registered mode's shadow gets columns
        from sdp_cli.ablate.sweep import check_sweep_dir

        check_sweep_dir(report)  # links and special files: before anything is written
        _print_report(report, plots=not no_plots, study_file=study, out=out)
        return
    if mode:
        raise UserError("--mode only applies to --report; a sweep's runs load their own loss.mode")
    if out is not None:
        raise UserError("--out only applies to --report; a sweep writes its report into its directory (--dir)")
    if study is not None and no_study:
        raise UserError("--study and --no-study contradict each other; pass one")

    from sdp_cli.ablate.study import (
        builtin_study_path,
        check_registration,
        check_study,
        read_study_file,
        register,
    )
    from sdp_cli.ablate.sweep import (
        check_sweep_dir,
        plan_sweep,
        prune_checkpoints,
        run_sweep,
        unfinished,
        write_plan,
    )
    from sdp_cli.config.compose import config_source

    if jobs is not None:
        overrides.append(f"hydra.launcher.n_jobs={jobs}")
    plan = plan_sweep(sweep, overrides, directory, source=config_source(config_dir, config_name))
    study_file = None if no_study else (study or builtin_study_path(sweep))
    registered = None
    if study_file is not None:  # checked before anything runs or is written
        registered = read_study_file(study_file)
        check_registration(plan.sweep_dir, registered)
        check_study(registered, plan.modes, plan.axes, f"study {study_file}")
    _print_plan(plan, registered, study_file, written=not dry_run)
    if dry_run:
        return
    from sdp_cli.dirlock import DirectoryLock

    plan.sweep_dir.mkdir(parents=True, exist_ok=True)
    # one sweep process per sweep directory: its jobs would otherwise train the same runs twice
    with DirectoryLock.acquire(plan.sweep_dir, "sweep directory"):
        check_sweep_dir(plan.sweep_dir)  # links and special files: before anything is written
        write_plan(plan)
        if registered is not None:
            register(plan.sweep_dir, registered, str(study_file))
        code = run_sweep(plan)
        pruned = 0 if keep_checkpoints else prune_checkpoints(plan)
    if pruned:
        typer.echo(
            f"deleted the checkpoints of {pruned} finished runs (--keep-checkpoints keeps them)"
        )
    left = unfinished(plan)
    if len(left) < len(plan.jobs):  # something to report
        _print_report(plan.sweep_dir, plots=not no_plots)
    if left:
        names = ", ".join(job.name for job in left[:3]) + (", ..." if len(left) > 3 else "")
        raise UserError(
            f"{len(left)} of {len(plan.jobs)} runs did not finish "
            f"({names}; sweep exit code {code}); "
            f"see the log above and {plan.sweep_dir}/hydra/, fix the cause and re-run the same "
            "command (finished runs are kept)"
        )


def _print_plan(plan: SweepPlan, study: Study | None, study_file: Path | None, *, written: bool) -> None:
    from rich.console import Console
    from rich.markup import escape

    axes = "; ".join(f"{key} ∈ {{{', '.join(values)}}}" for key, values in plan.axes.items())
    counts = ", ".join(
        f"{plan.count(s)} {s}" for s in ("finished", "resumable", "partial", "new") if plan.count(s)
    )
    # names, paths and overrides are escaped: "[", "[/]" or ":smile:" in them stay text
    console = Console(emoji=False)
    console.print(f"[bold]sweep[/bold] {escape(plan.sweep)} → {escape(str(plan.sweep_dir))}")
    runs = f"{len(plan.jobs)} run{'s' if len(plan.jobs) != 1 else ''}"
    console.print(f"  {runs} ({counts}); axes: {escape(axes or 'none')}")
    if study is None:
        console.print("  study: none registered (--no-study, or the sweep has none)", highlight=False)
        return
    primary = f"primary {study.primary.describe(study.baseline)}" if study.primary else "no primary"
    margin = f", margin ±{study.margin:g}" if study.margin is not None else ""
    where = "registered in study.json" if written else "checked, not written (--dry-run)"
    console.print(
        f"  study {escape(str(study_file))}: {study.metric}, {escape(primary)}{margin}; {where}", highlight=False
    )


def _print_report(directory: Path, *, plots: bool, study_file: Path | None = None, out: Path | None = None) -> Report:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from sdp_cli.ablate.report import TABLES, table_columns, table_rows, write_report
    from sdp_cli.ablate.study_tables import (
        primary_lines,
        secondary_columns,
        secondary_note,
        secondary_rows,
        secondary_title,
        study_lines,
    )

    result = write_report(directory, plots=plots, study_file=study_file, out=out)
    # paths, run names and cells are escaped: "[", "[/]" or ":smile:" in them stay text
    console = Console(emoji=False)
    if not console.is_terminal:
        console = Console(width=200, emoji=False)  # logs keep whole table lines
    console.print(f"[bold]sdp ablate[/bold] {escape(str(directory))}: mean ± std over seeds", highlight=False)
    if result.table.common:
        console.print(
            f"overrides shared by every run: {' '.join(result.table.common)}",
            highlight=False,
            markup=False,
        )
    for name, title in TABLES.items():
        columns = [escape(c) for c in table_columns(result.groups, name)]
        table = Table(*columns, title=title, title_justify="left")
        for cells in table_rows(result.groups, name):
            table.add_row(*(escape(c) for c in cells))
        console.print(table)
    console.print("[bold]Study[/bold]")
    for line in study_lines(result.study, result.provenance):
        console.print(line, highlight=False, markup=False)
    if result.secondary:
        columns = [escape(c) for c in secondary_columns(result.secondary, result.study)]
        # no borders: the table fits 80 columns with the longest mode labels
        table = Table(
            *columns, title=secondary_title(result.secondary, result.study), title_justify="left", box=None
        )
        for cells in secondary_rows(result.secondary, result.study):
            table.add_row(*(escape(c) for c in cells))
        console.print(table)
        console.print(secondary_note(result.secondary, result.study), style="dim", markup=False)
    for line in primary_lines(result.primary, result.study):
        console.print(line, highlight=False, markup=False)
    if result.unfinished:
        console.print(
            f"{len(result.unfinished)} unfinished runs left out: " + escape(", ".join(result.unfinished))
        )
    for path in [*result.written, *result.plots]:
        console.print(f"wrote {escape(str(path))}")
    return result
