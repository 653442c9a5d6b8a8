"""The ``sdp`` command. Each sub-command lives in its own module and is registered here.

Heavy libraries (torch, transformers, httpx, matplotlib) are imported inside the command
functions, never at module level, so that ``sdp --help`` stays fast.
"""

from __future__ import annotations

import sys

import typer

from sdp_cli import __version__
from sdp_cli.errors import UserError

app = typer.Typer(
    name="sdp",
    help="Asynchronous RL for language models with segment-wise decoupled PPO.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
)


def _version_callback(value: bool) -> None:
    if value:
        typer.echo(f"sdp {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", help="Print the version and exit.", callback=_version_callback, is_eager=True
    ),
) -> None:
    """Asynchronous RL for language models with segment-wise decoupled PPO."""


def _register_commands() -> None:
    # Imported here so each command module can register itself on `app`.
    from sdp_cli.cli import commands  # noqa: F401


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point: Typer handles usage errors (exit 2); a UserError raised by a
    command becomes one line on stderr and exit code 2, never a traceback."""
    _register_commands()
    try:
        app(args=argv, prog_name="sdp")
    except UserError as err:
        typer.secho(f"error: {err}", err=True, fg=typer.colors.RED)
        sys.exit(err.exit_code)
