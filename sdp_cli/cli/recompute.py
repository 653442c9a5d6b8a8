"""`sdp recompute`: recompute π_prox_t (and optionally π_prox and the exact chain) of saved
batches from per-version checkpoints. Parsing and reporting only; the work is in
``sdp_cli.analysis.recompute``."""

from __future__ import annotations

import math

from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from sdp_cli.choices import ENGINE_KINDS, STUDIED_DRIFT_CLIPS
from sdp_cli.errors import UserError

if TYPE_CHECKING:
    from sdp_cli.analysis.recompute import RecomputeResult

#: this module's command; sdp_cli.cli.main adds it to the root app
app = typer.Typer()

RECOMPUTE_HELP = """Recompute π_prox_t of saved batches from the run's per-version checkpoints.

Every output token of version v < c (c: the batch's trainer version) is scored under the checkpoint of version v + 1, in the run's engine dtype; tokens of version c keep π_prox_t = π_behav. Each batch gets a verdict (unchanged, dtype noise, DAMAGED) against a noise floor measured on its version-c tokens. Needs a run trained with train.save_batches=true train.keep_version_checkpoints=true. A run directory stands for its batches/, whose run is where the checkpoints are unless --checkpoints says otherwise. Files are replaced atomically; see docs/recompute.md.

[bold]Examples[/bold]

  sdp recompute runs/my-run --dry-run

  sdp recompute runs/my-run/batches --checkpoints runs/my-run

  sdp recompute runs/my-run/batches/step-000040.safetensors --checkpoints runs/my-run --exact -o fixed.safetensors

  sdp recompute runs/my-run/batches --checkpoints runs/my-run --proximal trainer --dry-run --json
"""


@app.command("recompute", help=RECOMPUTE_HELP)
def recompute_command(
    batches: list[Path] = typer.Argument(
        ...,
        metavar="BATCH",
        help="Batch files, directories of them (e.g. <run>/batches), or run directories.",
        show_default=False,
    ),
    checkpoints: Path | None = typer.Option(
        None,
        "--checkpoints",
        "-c",
        metavar="DIR",
        help="A run directory (its versions/ is used) or a directory of v000012/ checkpoints; "
        "by default the run whose batches/ holds the batches.",
        show_default=False,
    ),
    proximal: str | None = typer.Option(
        None,
        "--proximal",
        metavar="VERSION",
        help="Also compute π_prox under a checkpoint: 'trainer' (each batch's trainer version c, "
        "as the trainer did), 'latest', or a version number.",
    ),
    exact: bool = typer.Option(
        False,
        "--exact",
        help="Score every lagged token under each version v+1 … c: π_prox from version c and a "
        "per-lag report of the factor π_c/π_{v+1} that segment-wise drops.",
    ),
    mode: list[str] | None = typer.Option(
        None,
        "--mode",
        metavar="MODE",
        help="Fill what this mode's weight reads (repeatable; any mode registered in "
        "sdp_cli/core/weights.py, or <mode>_drift for its drift-clipped weight): π_prox_t always, "
        "and π_prox (under --proximal, by default each batch's trainer version) when it reads it, "
        "e.g. --mode decoupled or --mode segment_wise_drift.",
    ),
    drift_clip: list[float] | None = typer.Option(
        None,
        "--drift-clip",
        metavar="KAPPA",
        help="With --exact: report what a drift clip κ keeps of the dropped factor (repeatable; "
        "default 1.5, 2, 3 and 4).",
    ),
    # a str, not a Path: Path() drops the trailing slash that makes "-o new-dir/" a directory
    output: str | None = typer.Option(
        None,
        "--output",
        "-o",
        metavar="PATH",
        help="Write here instead of in place: a directory, or a file when one batch is given.",
    ),
    force: bool = typer.Option(
        False, "--force", help="Let --output replace existing files (in place needs no --force)."
    ),
    dry_run: bool = typer.Option(False, "--dry-run", help="Compute and report; write nothing."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
    engine: str = typer.Option(
        "local", "--engine", metavar="local|vllm|sglang", help="Scorer: local (in-process), or vllm / sglang with --server."
    ),
    server: list[str] | None = typer.Option(
        None,
        "--server",
        metavar="URL",
        help="URL of a running vLLM/SGLang server (repeatable). Its weights are replaced by each "
        "checkpoint in turn: use a server dedicated to this.",
    ),
    device: str = typer.Option(
        "auto", "--device", metavar="DEVICE", help="Device of the local engine: auto (cuda if available), cpu, cuda, cuda:1 …"
    ),
) -> None:
    from sdp_cli.analysis.recompute_plan import ProximalChoice, RecomputeOptions

    servers = list(server or [])
    if engine not in ENGINE_KINDS:
        raise UserError(f"--engine {engine!r} is unknown; choose local, vllm or sglang")
    if engine == "local" and servers:
        raise UserError("--server needs --engine vllm or --engine sglang")
    if engine != "local" and not servers:
        raise UserError(f"--engine {engine} needs the URL of a running server: --server http://host:port")
    from sdp_cli.analysis.scorers import check_server_url, resolve_device

    for url in servers:
        check_server_url(url)
    device = resolve_device(device)
    kappas = tuple(drift_clip or STUDIED_DRIFT_CLIPS)
    bad = next((k for k in kappas if math.isnan(k) or k < 1), None)
    if bad is not None:
        raise UserError(f"--drift-clip {bad} must be >= 1 (1 = segment-wise, inf = decoupled); pass e.g. --drift-clip 2")
    if drift_clip and not exact:
        raise UserError("--drift-clip reports on the exact decomposition; add --exact")
    from sdp_cli.modes import resolve_mode, weight_names
    from sdp_cli.user_code import is_code_spec

    # a mode of yours named on the command line is loaded (never one a batch file names)
    mode = [resolve_mode(m).name if is_code_spec(m) else m for m in mode or []]
    known = weight_names()
    unknown = next((m for m in mode if m not in known), None)
    if unknown is not None:
        raise UserError(
            f"--mode {unknown!r} is not a registered mode; choose one of {', '.join(known)}, or give your own "
            "as path/to/file.py:function"
        )
    options = RecomputeOptions(
        proximal=None if proximal is None else ProximalChoice.parse(proximal),
        exact=exact,
        drift_clips=kappas,
        modes=tuple(dict.fromkeys(mode)),
    )
    result = _run(batches, checkpoints, options, output, force, engine, servers, device, as_json)
    if not dry_run:
        from sdp_cli.analysis.recompute import commit

        commit(result)
    if as_json:
        from sdp_cli.fileio import json_document

        typer.echo(json_document({**result.to_dict(), "dry_run": dry_run}))
    else:
        _print_report(result, dry_run)


def _run(
    batches: list[Path],
    checkpoints: Path | None,
    options: Any,
    output: str | None,
    force: bool,
    engine: str,
    servers: list[str],
    device: str,
    quiet: bool,
) -> RecomputeResult:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from sdp_cli.analysis.recompute import recompute
    from sdp_cli.analysis.scorers import LocalScorer, connect_remote

    def make_scorer(saved: Any) -> Any:
        if engine == "local":
            return LocalScorer(device=device)
        return connect_remote(engine, servers, [b.temperature for b in saved])

    console = Console(stderr=True, emoji=False)
    bar = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("tokens"),
        TimeElapsedColumn(),
        console=console,
        transient=True,
        disable=quiet or not console.is_terminal,
    )
    task: list[Any] = []

    def on_plan(plan: Any) -> None:
        if plan.jobs:
            task.append(bar.add_task("scoring", total=plan.tokens()))

    def on_progress(version: int, tokens: int) -> None:
        bar.update(task[0], advance=tokens, description=f"scoring under v{version:06d}")

    with bar:
        return recompute(
            batches,
            checkpoints,
            make_scorer,
            options,
            output=output,
            force=force,
            on_plan=on_plan,
            progress=on_progress,
        )


def _fmt(value: float | None) -> str:
    return "–" if value is None else f"{value:.1e}"


def _pm(m: Any) -> str:
    return f"{m.mean:+.1e}±{m.std:.1e}"


def _verdict(v: Any) -> str:
    """A batch's verdict (sdp_cli/analysis/noise.py) in a few words; – when not judged."""
    if v is None:
        return "–"
    if v.kind == "damaged":
        parts = [f"{v.beyond} beyond the floor"] + ([f"{v.retagged} retagged"] if v.retagged else [])
        return f"DAMAGED ({', '.join(parts)})"
    if v.kind == "unverified":
        return f"unverified ({v.beyond} > 1e-5, no floor)"
    return v.kind


def _floor(name: str, floor: Any) -> str:
    if floor.tokens == 0:
        return f"{name}: not measured"
    return f"{name} mean {floor.mean_abs:.1e} max {floor.max_abs:.1e} over {floor.tokens} token(s), noise up to {floor.tolerance:.1e}"


def _numerics_lines(result: RecomputeResult) -> list[str]:
    """The run's dtypes and the noise floors the verdicts use (docs/recompute.md "Noise floor")."""
    run = result.numerics
    line = "the run: its engine's dtype is the checkpoints' (scored in it); no config.yaml (not a run's versions/)"
    if run is not None:
        source = "the trainer's π_prox for one-version-stale tokens" if run.trainer_fills_proximal_t else "the engine"
        line = (
            f"the run: its engine's dtype is the checkpoints' (scored in it); trainer {run.train_dtype}; "
            f"π_prox_t from {source} ({run.source})"
        )
    floors = result.floors
    return [
        line,
        "noise floor on version-c tokens, |Δ| against π_behav: "
        + _floor("scorer vs the run's engine (judges π_prox_t)", floors["engine"])
        + "; "
        + _floor("trainer vs engine (with the first, judges π_prox)", floors["trainer"]),
    ]


def _print_report(result: RecomputeResult, dry_run: bool) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    # paths and URLs are escaped where they are printed; emoji codes in them stay text
    console = Console(emoji=False)
    if not console.is_terminal:
        console = Console(width=160, emoji=False)  # a file or pipe gets whole columns, not truncated ones
    n_tokens = sum(o.proximal_t.tokens for o in result.outcomes)
    choice = result.options.proximal_choice
    what = "π_prox_t" if choice is None else f"π_prox_t and π_prox (from version: {choice.describe()})"
    console.print(
        f"recomputed {what} of {len(result.outcomes)} batch(es), {n_tokens} lagged token(s); "
        f"{sum(w.tokens for w in result.work)} token(s) scored under {len(result.work)} checkpoint(s) "
        f"by the {escape(result.scorer)} in {result.seconds:.1f} s"
    )
    for line in _numerics_lines(result):
        console.print(escape(line))
    if result.work:
        table = Table("version", "scored", "π_prox_t", "π_prox", "sequences", "load s", "score s", box=None)
        for w in result.work:
            table.add_row(
                f"v{w.version:06d}",
                str(w.tokens),
                str(w.proximal_t_tokens),
                str(w.proximal_tokens),
                str(w.sequences),
                f"{w.load_seconds:.2f}",
                f"{w.score_seconds:.2f}",
            )
        console.print(table)
    columns = ["batch", "c", "π_prox_t tokens", "mean |Δ|", "max |Δ|", "retagged", "π_prox_t"]
    if choice is not None:
        columns += ["π_prox mean |Δ|", "max |Δ|", "π_prox"]
    table = Table(*columns, box=None)
    table.columns[0].no_wrap = True
    for o in result.outcomes:
        row = [
            escape(o.source.name),
            str(o.batch.trainer_version),
            str(o.proximal_t.tokens),
            _fmt(o.proximal_t.mean_abs),
            _fmt(o.proximal_t.max_abs),
            str(o.retagged),
            _verdict(o.proximal_t_verdict),
        ]
        if choice is not None:
            prox = o.proximal
            row += [_fmt(prox and prox.mean_abs), _fmt(prox and prox.max_abs), _verdict(o.proximal_verdict)]
        table.add_row(*row)
    console.print(table)
    if result.lags:
        console.print(
            "exact decomposition (loss-mask tokens, lag = c − v): log π_c/π_behav = Σ_j log π_{v+j+1}/π_{v+j}, "
            "segment-wise keeps j = 0 and drops log π_c/π_{v+1}"
        )
        table = Table(
            "lag", "tokens", "seg-wise log w", "decoupled log w", "dropped", "max |dropped|", "E[π_c/π_{v+1}]",
            box=None,
        )
        for d in result.lags:
            table.add_row(
                str(d.lag),
                str(d.tokens),
                _pm(d.segment_wise),
                _pm(d.decoupled),
                _pm(d.dropped),
                f"{d.dropped.max_abs:.1e}",
                f"{d.dropped_ratio_mean:.4f}",
            )
        console.print(table)
        kappas = [k.kappa for k in result.lags[0].drift_kept]
        table = Table(
            "lag",
            *(f"π_c/π_{{v+1}} {name}" for name in ("p1", "p10", "p50", "p90", "p99")),
            *(f"κ={k:g} kept" for k in kappas),
            title="the dropped factor and what a drift clip κ keeps of it (tokens inside [1/κ, κ] / share of Σ|log|)",
            box=None,
        )
        for d in result.lags:
            table.add_row(
                str(d.lag),
                *(f"{v:.3g}" for v in d.dropped_quantiles.values()),
                *(f"{k.tokens_unclipped:.0%} / {k.log_kept:.0%}" for k in d.drift_kept),
            )
        console.print(table)
        longest = max(d.lag for d in result.lags)
        title = "mean log π_{v+j+1}/π_{v+j}"
        table = Table("lag", *(f"j={j}" for j in range(longest)), title=title, box=None)
        for d in result.lags:
            table.add_row(str(d.lag), *(f"{x:+.1e}" for x in d.step_means), *([""] * (longest - d.lag)))
        console.print(table)
    if dry_run:
        console.print("dry run: nothing written")
    else:
        in_place = all(o.target == o.source for o in result.outcomes)
        places = sorted({str(o.target.parent) for o in result.outcomes if o.target is not None})
        where = "in place" if in_place else "to " + ", ".join(places)
        console.print(f"wrote {len(result.written)} batch file(s) {escape(where)}")
