"""`sdp ablate`: run a staleness × mode sweep (or re-aggregate one) and print its tables."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import typer

from sdp_cli.errors import UserError

if TYPE_CHECKING:
    from sdp_cli.ablate.report import Report
    from sdp_cli.ablate.sweep import SweepPlan

#: this module's command; sdp_cli.cli.main adds it to the root app
app = typer.Typer()

ABLATE_HELP = """Sweep staleness η × correction mode × seeds and measure what each correction buys.

Every job is one `sdp train` run with the shadow recompute pass on, so both behavioural weights (decoupled π_prox/π_behav and segment-wise π_{v+1}/π_behav) are measured on the same tokens whatever the mode trains. Sweeps live in sdp_cli/conf/ablate/ (default, harsh, smoke); any axis or config key can be overridden (a comma list or range(...) makes an axis), and the launcher is a Hydra override (hydra/launcher=basic|joblib|submitit_slurm|ray). Re-running the same command resumes: finished runs are skipped, interrupted ones continue from their checkpoint (finished runs keep their results but not their checkpoints, unless --keep-checkpoints). Writes DIR/summary.csv, DIR/summary.md and DIR/plots/*.png; see docs/ablate.md.

[bold]Examples[/bold]

  sdp ablate                                   # the default sweep (125 runs, ~2 h on 2 CPU cores)

  sdp ablate smoke                             # a tiny grid, about a minute

  sdp ablate default seed=0,1 rollout.max_head_offpolicyness=0,8 --dir runs/ablate/quick

  sdp ablate harsh hydra/launcher=basic        # one job at a time

  sdp ablate --report runs/ablate/default      # re-aggregate without running anything
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
        help="Only aggregate this existing sweep directory (no training).",
        show_default=False,
    ),
    dry_run: bool = typer.Option(
        False, "--dry-run", help="Validate the sweep, print its plan and exit."
    ),
    against: str | None = typer.Option(
        None,
        "--against",
        help="Compare each mode's final reward with the better of these modes only "
        "(comma-separated report labels, e.g. decoupled,segment_wise) instead of the best other mode.",
        show_default=False,
    ),
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
) -> None:
    overrides = list(ctx.args)
    if "=" in sweep:  # `sdp ablate seed=0,1`: an override in the sweep's place
        overrides.insert(0, sweep)
        sweep = "default"
    if report is not None:
        if overrides or directory is not None or jobs is not None or dry_run or keep_checkpoints or config_dir or config_name:
            raise UserError(
                "--report only aggregates an existing sweep; "
                "drop the sweep name, overrides and other options"
            )
        from sdp_cli.ablate.sweep import check_sweep_dir

        check_sweep_dir(report)
        _print_report(report, plots=not no_plots, against=_modes(against))
        return

    from sdp_cli.ablate.comparison import check_against
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
    _print_plan(plan)
    check_against(plan.modes, _modes(against))  # before anything runs
    if dry_run:
        return
    from sdp_cli.dirlock import DirectoryLock

    plan.sweep_dir.mkdir(parents=True, exist_ok=True)
    # one sweep process per sweep directory: its jobs would otherwise train the same runs twice
    with DirectoryLock.acquire(plan.sweep_dir, "sweep directory"):
        check_sweep_dir(plan.sweep_dir)  # links and special files: before anything is written
        write_plan(plan)
        code = run_sweep(plan)
        pruned = 0 if keep_checkpoints else prune_checkpoints(plan)
    if pruned:
        typer.echo(
            f"deleted the checkpoints of {pruned} finished runs (--keep-checkpoints keeps them)"
        )
    left = unfinished(plan)
    if len(left) < len(plan.jobs):  # something to report
        _print_report(plan.sweep_dir, plots=not no_plots, against=_modes(against))
    if left:
        names = ", ".join(job.name for job in left[:3]) + (", ..." if len(left) > 3 else "")
        raise UserError(
            f"{len(left)} of {len(plan.jobs)} runs did not finish "
            f"({names}; sweep exit code {code}); "
            f"see the log above and {plan.sweep_dir}/hydra/, fix the cause and re-run the same "
            "command (finished runs are kept)"
        )


def _print_plan(plan: SweepPlan) -> None:
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


def _modes(against: str | None) -> tuple[str, ...]:
    return tuple(m.strip() for m in (against or "").split(",") if m.strip())


def _print_report(directory: Path, *, plots: bool, against: tuple[str, ...] = ()) -> Report:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from sdp_cli.ablate.comparison import (
        comparison_columns,
        comparison_note,
        comparison_rows,
        comparison_title,
    )
    from sdp_cli.ablate.report import TABLES, table_columns, table_rows, write_report

    result = write_report(directory, plots=plots, against=against)
    # paths, run names and cells are escaped: "[", "[/]" or ":smile:" in them stay text
    console = Console(emoji=False)
    if not console.is_terminal:
        console = Console(width=200, emoji=False)  # logs keep whole table lines
    console.print(f"[bold]sdp ablate[/bold] {escape(str(directory))}: mean ± std over seeds", highlight=False)
    if result.sweep.common:
        console.print(
            f"overrides shared by every run: {' '.join(result.sweep.common)}",
            highlight=False,
            markup=False,
        )
    for name, title in TABLES.items():
        columns = [escape(c) for c in table_columns(result.groups, name)]
        table = Table(*columns, title=title, title_justify="left")
        for cells in table_rows(result.groups, name):
            table.add_row(*(escape(c) for c in cells))
        console.print(table)
    if any(c.comparison is not None for c in result.comparisons):
        columns = [escape(c) for c in comparison_columns(result.comparisons)]
        table = Table(*columns, title=comparison_title(against), title_justify="left")
        for cells in comparison_rows(result.comparisons):
            table.add_row(*(escape(c) for c in cells))
        console.print(table)
        console.print(comparison_note(against), style="dim", markup=False)
    if result.unfinished:
        console.print(
            f"{len(result.unfinished)} unfinished runs left out: "
            + escape(", ".join(r.name for r in result.unfinished))
        )
    for path in [result.csv_path, result.markdown_path, *result.extra_paths, *result.plots]:
        console.print(f"wrote {escape(str(path))}")
    return result
