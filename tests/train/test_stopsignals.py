"""sdp_cli/stopsignals.py: the start's handler (``exiting_on_signals``) ends the process at once
in one line, gives way to a run's (``handling``) and does not come back after it; a Ctrl-C behind
another error is recognised (docs/reliability.md "Signals")."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from sdp_cli.stopsignals import SIGNALS, exiting_on_signals, handling, interrupted_by_ctrl_c


def _handlers() -> dict[int, object]:
    return {signum: signal.getsignal(signum) for signum in SIGNALS}


def test_the_starts_handler_gives_way_to_a_runs_and_does_not_come_back():
    before = _handlers()
    with exiting_on_signals(lambda signum: "stopped"):
        start = _handlers()
        assert all(start[s] is not before[s] for s in SIGNALS)
        with handling(lambda signum: None):
            assert all(signal.getsignal(s) is not start[s] for s in SIGNALS)
        # the run had its handlers: a signal now is no longer one "before the run started"
        assert _handlers() == before
    assert _handlers() == before
    with exiting_on_signals(lambda signum: "stopped"):
        assert _handlers() != before  # no run inside: it holds to the end of the block
    assert _handlers() == before


def test_a_runs_handler_that_stays_is_left_as_it_is():
    """Several processes (torchrun): a run's handling stays installed after its block (rank 0
    ignores the SIGTERM torchrun sends once the run is over); the start's block leaves it."""
    before = _handlers()
    try:
        with exiting_on_signals(lambda signum: "stopped"):
            with handling(lambda signum: None, restore=False):
                run = _handlers()
        assert _handlers() == run
    finally:
        for signum, old in before.items():
            signal.signal(signum, old)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_a_signal_in_the_block_ends_the_process_at_once_in_one_line(signum):
    probe = (
        "import os, signal, time\n"
        "from sdp_cli.stopsignals import exiting_on_signals, signal_name\n"
        "with exiting_on_signals(lambda s: f'stopped before the run started ({signal_name(s)})'):\n"
        "    try:\n"
        f"        os.kill(os.getpid(), {int(signum)})\n"
        "        time.sleep(5)\n"
        "    finally:\n"
        "        print('a finally block ran')\n"  # no exception is raised into the code
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    name = signal.Signals(signum).name
    assert (done.returncode, done.stderr, done.stdout) == (128 + signum, f"stopped before the run started ({name})\n", "")


def test_only_an_error_raised_from_or_during_a_ctrl_c_counts_as_one():
    with pytest.raises(ModuleNotFoundError) as cut:
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt as interrupt:  # as transformers' lazy import re-raises it
            raise ModuleNotFoundError("Could not import module 'Qwen2ForCausalLM'") from interrupt
    assert interrupted_by_ctrl_c(cut.value)
    try:
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt:
            raise ValueError("raised while handling it") from None  # the context is dropped on purpose
    except ValueError as dropped:
        assert not interrupted_by_ctrl_c(dropped)
    try:
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt:
            raise ValueError("raised while handling it")
    except ValueError as during:
        assert interrupted_by_ctrl_c(during)
    assert not interrupted_by_ctrl_c(ModuleNotFoundError("no module named x"))
