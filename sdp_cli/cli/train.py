"""`sdp train`: compose the run config and hand it to the async training loop."""

from __future__ import annotations

import typer

#: this module's command; sdp_cli.cli.main adds it to the root app
app = typer.Typer()

TRAIN_HELP = """Train a policy with asynchronous RL (segment-wise decoupled PPO and friends).

Overrides use Hydra syntax: pick a group option (mode=segment_wise, is_agg=geometric, staleness=segment_wise, engine=vllm, model=hf, task=arith2), add a preset (+preset=segment_wise) or set any key (rollout.max_head_offpolicyness=8 optim.lr=3e-4).

[bold]Examples[/bold]

  sdp train +preset=segment_wise

  sdp train +preset=decoupled rollout.max_head_offpolicyness=8 train.steps=200

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
        False, "--print-config", "--cfg", help="Print the resolved config as YAML and exit."
    ),
    help_config: bool = typer.Option(
        False, "--help-config", help="List every config key with its default and meaning, then exit."
    ),
) -> None:
    overrides = list(ctx.args)
    if help_config:
        from rich.console import Console
        from rich.markup import escape
        from rich.table import Table

        from sdp_cli.config.schema import field_docs

        table = Table(box=None, show_header=True)
        table.add_column("key", no_wrap=True)  # a key is copied onto the command line whole
        table.add_column("default", max_width=12)  # long defaults (lists) wrap, not the meaning
        table.add_column("meaning")
        for key, default, doc in field_docs():
            table.add_row(key, escape(default), escape(doc))
        Console().print(table)
        raise typer.Exit()

    from sdp_cli.config.compose import compose_config, to_yaml

    cfg, raw = compose_config(overrides)
    if print_config:
        typer.echo(to_yaml(raw), nl=False)
        raise typer.Exit()

    from sdp_cli.train.run import run_training

    run_training(cfg, raw, overrides=overrides)
