"""The ``sdp`` command. Each sub-command lives in its own module, which owns a Typer app with
that one command; the root app here adds them.

Heavy libraries (torch, transformers, httpx, matplotlib) are imported inside the command
functions, never at module level, so that ``sdp --help`` stays fast.
"""

from __future__ import annotations

import os
import sys
from typing import Callable, NoReturn

import typer

from sdp_cli import __version__
from sdp_cli.errors import Interrupted, UserError

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
    """Add every command module's Typer app to the root app, in the order ``sdp --help`` lists
    them (once: ``main`` may run many times in one process)."""
    if app.registered_groups:
        return
    from sdp_cli.cli import ablate, export, inspect_weights, recompute, train

    for module in (train, recompute, inspect_weights, ablate, export):
        app.add_typer(module.app)


def _fail(message: str, code: int) -> None:
    from sdp_cli.redact import redact_urls

    _say(lambda: typer.secho(f"error: {' '.join(redact_urls(message).split())}", err=True, fg=typer.colors.RED))
    _exit(code)


def _say(write: Callable[[], None]) -> None:
    """Write the last line; a terminal that went away (SIGHUP, EIO) must not turn the exit
    status a stop chose into a traceback."""
    try:
        write()
    except OSError:
        pass


def _must_leave_at_once() -> bool:
    """Whether the interpreter's teardown could wait on, or trip over, threads that sdp does not
    own: the gloo threads of a torchrun job's process group, which outlive
    ``destroy_process_group`` and which the teardown sometimes destroys while joinable
    ("terminate called without an active exception", SIGABRT, a run torchrun reports as failed
    although every output was written; ``Coordinator.end_follower`` leaves the same way), and a
    reward call still running in a worker thread (abandoned at ``task.reward_timeout_s``, or
    left behind by a stop: docs/reliability.md "Signals"), which may never return."""
    distributed = sys.modules.get("torch.distributed")
    if distributed is not None and distributed.is_available() and distributed.is_initialized():
        return True
    rewarding = sys.modules.get("sdp_cli.train.asyncloop.rewarding")
    return rewarding is not None and rewarding.user_code_running(grace_s=1.0)


def _exit(code: int) -> NoReturn:
    """``sys.exit(code)``, or, when the teardown could wait or crash (``_must_leave_at_once``),
    leave without it once stdout and stderr are flushed. Every log sdp writes is flushed line by
    line and closed before this, and the run lock is the kernel's, released as the process
    ends, so nothing is lost. Output that cannot be flushed (a closed terminal) is dropped
    rather than turning the status into 120."""
    if _must_leave_at_once():
        for stream in (sys.stdout, sys.stderr):
            _say(stream.flush)
        os._exit(code)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except OSError:  # the terminal is gone: what it did not take is lost either way
            os._exit(code)
    sys.exit(code)


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point. A usage error (unknown option, bad option value) and a
    UserError raised by a command each become one line on stderr and exit code 2, never a
    traceback or a boxed block."""
    _register_commands()
    # sdp prints its own progress; transformers' bars (loading weights, writing shards) only break
    # it up. transformers reads this when it is imported, which no command has done yet; a user's
    # own setting stands.
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    try:
        code = app(args=argv, prog_name="sdp", standalone_mode=False)
    except typer.TyperException as err:  # typer's click errors derive from it
        if type(err).__name__ == "NoArgsIsHelpError":  # `sdp` alone prints the help
            typer.echo(err.format_message())
            sys.exit(0)
        ctx = getattr(err, "ctx", None)
        _fail(f"{err.format_message()} (see `{ctx.command_path if ctx else 'sdp'} --help`)", 2)
    except typer.Abort:
        _fail("aborted", 130)
    except UserError as err:
        _fail(str(err), err.exit_code)
    except Interrupted as err:  # a run stopped on a signal: its line says where and how to go on
        from sdp_cli.redact import redact_urls

        _say(lambda: typer.echo(redact_urls(str(err)), err=True))
        _exit(err.exit_code)
    except Exception as err:  # a Ctrl-C that cut an import comes out as the import's own error
        from sdp_cli.stopsignals import interrupted_by_ctrl_c

        if not interrupted_by_ctrl_c(err):
            raise
        _fail("interrupted (SIGINT)", 130)
    _exit(code if isinstance(code, int) else 0)
