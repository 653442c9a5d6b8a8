"""`sdp train`: compose the run config and hand it to the async training loop."""

from __future__ import annotations

import os
from pathlib import Path

import typer

from sdp_cli.errors import UserCodeError, UserError

#: this module's command; sdp_cli.cli.main adds it to the root app
app = typer.Typer()

TRAIN_HELP = """Train a policy with asynchronous RL (segment-wise decoupled PPO and friends).

Overrides use Hydra syntax: pick a group option (mode=segment_wise, is_agg=geometric, staleness=segment_wise, engine=vllm, model=hf, task=arith2), add a preset (+preset=segment_wise) or set any key (rollout.max_head_offpolicyness=8 optim.lr=3e-4). Unknown keys are refused. Your own data, reward function and configs: docs/tasks.md.

[bold]Examples[/bold]

  sdp train +preset=segment_wise

  sdp train +preset=decoupled rollout.max_head_offpolicyness=8 train.steps=200

  sdp train task=dataset task.path=data.jsonl task.reward=reward.py:score task.eval_fraction=0.1

  sdp train --config-dir conf task=my_task +preset=my_preset --show-prompts 3

  sdp train resume=runs/20261121-101500-segment_wise-arith1
"""


@app.command(
    "train",
    help=TRAIN_HELP,
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
)
def train_command(
    ctx: typer.Context,
    print_config: bool = typer.Option(
        False, "--print-config", "--cfg", help="Print the resolved config as YAML (and the first prompt of a data task) and exit."
    ),
    help_config: bool = typer.Option(
        False, "--help-config", help="List every config key with its default and meaning, then exit."
    ),
    config_dir: Path | None = typer.Option(
        None,
        "--config-dir",
        "-cd",
        help="A directory of your YAML configs; DIR/task/x.yaml, DIR/preset/y.yaml, ... become options (task=x, +preset=y).",
        show_default=False,
    ),
    config_name: str | None = typer.Option(
        None,
        "--config-name",
        "-cn",
        help="A primary config in --config-dir to use instead of sdp's; its defaults list starts with `- config`.",
        show_default=False,
    ),
    show_prompts: int | None = typer.Option(
        None,
        "--show-prompts",
        min=1,
        metavar="N",
        help="Print the first N training prompts exactly as the model sees them, with token counts, and exit (writes nothing).",
        show_default=False,
    ),
) -> None:
    overrides = list(ctx.args)
    if help_config:
        _print_config_help()
        raise typer.Exit()

    from sdp_cli.stopsignals import exiting_on_signals, signal_name

    # Until the run handles them (it stops at a step boundary), a signal ends sdp at once: nothing
    # is written before then, and the rollout process started ahead leaves when sdp has gone.
    with exiting_on_signals(lambda signum: f"stopped before the run started ({signal_name(signum)}); nothing was written"):
        _start(overrides, config_dir, config_name, print_config=print_config, show_prompts=show_prompts)


def _start(
    overrides: list[str], config_dir: Path | None, config_name: str | None, *, print_config: bool, show_prompts: int | None
) -> None:
    """Compose the config and train (or print the config or the prompts)."""
    from sdp_cli.config.compose import compose_config, config_source, to_yaml

    source = config_source(config_dir, config_name)
    # A resume composes the run's saved overrides with these (sdp_cli/train/session/start.py): alone they
    # may not validate (task.reward given again for a data task the saved overrides choose), so
    # here only `resume=` and the run.* keys, which steer this process, are composed.
    resuming = [o for o in overrides if o.startswith("resume=")]
    if resuming:
        overrides_now = [*resuming, *(o for o in overrides if o.lstrip("+~").startswith("run."))]
    else:
        overrides_now = overrides
    cfg, raw = compose_config(overrides_now, source=source)
    if print_config or show_prompts:
        from sdp_cli.train.session.task_setup import prompt_comment, show_prompts as render_prompts

        if print_config:
            typer.echo(to_yaml(raw), nl=False)
            typer.echo(prompt_comment(cfg), nl=False)
        if show_prompts:
            typer.echo(render_prompts(cfg, show_prompts))
        raise typer.Exit()

    from sdp_cli.train.session.rollout_process import RolloutProcessStart

    # started before the seconds of torch's and transformers' imports below, which it overlaps
    # with its engine's (docs/training.md "Three processes"); the run gives it its recipe
    rollout_process = RolloutProcessStart.early_start(cfg, os.environ)
    try:
        from sdp_cli.train.session.run import run_training

        # keep_lock: the run directory stays locked until the process ends
        run_training(cfg, raw, overrides=overrides, source=source, keep_lock=True, rollout_process=rollout_process)
    except UserError as err:
        if cfg.run.debug:
            typer.echo(_details(err), err=True)
        raise
    finally:
        if rollout_process is not None:
            rollout_process.cancel()  # a run that ended before its recipe (nothing once it has it)


def _details(err: BaseException) -> str:
    """The traceback behind a one-line error (``run.debug=true``): the user code's own for a
    reward function or a correction mode, else the first non-UserError cause's."""
    import traceback

    chain: list[BaseException] = []
    cur: BaseException | None = err
    while cur is not None and cur not in chain:
        chain.append(cur)
        cur = cur.__cause__
    for cause in chain:
        if isinstance(cause, UserCodeError) and cause.details:
            return cause.details.rstrip()
    bug = next((c for c in chain if not isinstance(c, UserError)), err)
    return "".join(traceback.format_exception(bug)).rstrip()


#: below this many columns for the meanings, each key's meaning goes under it instead of beside it
_MIN_MEANING_WIDTH = 32


def _print_config_help() -> None:
    """Every config key with its default and meaning. A table where the terminal leaves the
    meanings room, else each key and its default on one line and the meaning indented below. A key
    and its default always share a line (``| grep KEY`` finds both); nothing is cut short: a word
    longer than its column is folded, never ended with an ellipsis."""
    from rich.console import Console
    from rich.padding import Padding
    from rich.table import Table
    from rich.text import Text

    from sdp_cli.config.schema import field_docs
    from sdp_cli.config.scopes import KEY_SCOPES

    rows = list(field_docs())
    console = Console()
    key_width = max(len(key) for key, _, _ in rows)
    # a default wraps between its words (the LoRA modules' list), so the column fits the longest word
    default_width = max(len(word) for _, default, _ in rows for word in default.split())
    if console.width - key_width - default_width - 6 >= _MIN_MEANING_WIDTH:  # 6: each cell's padding
        table = Table(box=None, show_header=True)
        table.add_column("key", no_wrap=True, min_width=key_width)  # a key is copied onto the command line whole
        table.add_column("default", width=default_width, overflow="fold")
        table.add_column("meaning", overflow="fold")
        for key, default, doc in rows:
            table.add_row(key, Text(default), Text(doc))
        console.print(table)
    else:
        console.print(Text("key  default", style="bold"), Padding(Text("meaning", style="bold"), (0, 0, 0, 4)))
        for key, default, doc in rows:
            console.print(Text(f"{key}  {default}", overflow="fold"))
            console.print(Padding(Text(doc, overflow="fold"), (0, 0, 0, 4)))
    labels = ", ".join(f"{label}:" for label in KEY_SCOPES)
    console.print(Text(
        f"A meaning that opens with {labels} names the runs that read the key; set on the command line "
        "for another run, the key is refused.", overflow="fold",
    ))
