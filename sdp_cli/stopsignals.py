"""SIGINT, SIGTERM and SIGHUP as requests to stop at a safe point (docs/reliability.md, "Signals").

Python's default turns SIGINT into a ``KeyboardInterrupt`` raised wherever the main thread is,
which can cut a training step in half, and SIGTERM and SIGHUP (a closed terminal, an ended SSH
session) kill the process outright. Inside :func:`handling`, all three only call a handler;
:class:`StopRequest` is the training policy: the first signal asks for a stop at the next step
boundary, a later SIGINT (a second Ctrl-C) raises :class:`Abort` at once. A second SIGTERM or
SIGHUP is ignored: preemption systems often deliver SIGTERM by several routes (to the process
and to its group) and follow it with SIGKILL after a grace period, and a hangup reaches every
process of the terminal, so a repeat is not a request to hurry. Torch-free.
"""

from __future__ import annotations

import os
import signal
import stat
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def signal_name(signum: int) -> str:
    """``2`` → ``"SIGINT"``."""
    return signal.Signals(signum).name


class Abort(KeyboardInterrupt):
    """A second Ctrl-C: stop now, without finishing the step (the last complete checkpoint
    stays the resume point)."""

    def __init__(self, signum: int):
        super().__init__(signal_name(signum))
        self.signum = signum


class StopRequest:
    """The handler of a run: remembers the first signal, aborts on a later SIGINT.

    ``abortable=False`` (ranks other than 0 of a multi-process run) only remembers: rank 0
    decides where the run stops and the others follow it.
    """

    def __init__(self, *, abortable: bool = True):
        self.abortable = abortable
        #: the first signal received, or None
        self.signum: int | None = None

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str:
        assert self.signum is not None, "no stop was requested"
        return signal_name(self.signum)

    def __call__(self, signum: int) -> None:
        if signum == signal.SIGHUP:
            drop_terminal_output()
        if self.signum is None:
            self.signum = signum
        elif signum == signal.SIGINT and self.abortable:
            raise Abort(signum)


def drop_terminal_output() -> None:
    """After a hangup the terminal is gone and every write to it fails (EIO), which would turn
    a stop into a crash (a progress line, the last line, the flush at exit): stdout and stderr
    that are a terminal (a character device) write to /dev/null from now on; a pipe or a file
    stays as it is."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        for fd in (1, 2):
            try:
                if stat.S_ISCHR(os.fstat(fd).st_mode):
                    os.dup2(devnull, fd)
            except OSError:  # closed
                continue
    finally:
        os.close(devnull)


@contextmanager
def handling(handler: Callable[[int], None], *, restore: bool = True) -> Iterator[bool]:
    """Inside the block SIGINT, SIGTERM and SIGHUP call ``handler(signum)`` instead of their default
    action; the previous handlers come back at the end unless ``restore`` is false (the handler
    then stays until the process exits). Yields whether the handler is installed: Python runs
    signal handlers in the main thread only, so elsewhere this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield False
        return
    previous = {signum: signal.getsignal(signum) for signum in SIGNALS}
    for signum in SIGNALS:
        signal.signal(signum, lambda received, _frame: handler(received))
    try:
        yield True
    finally:
        for signum, old in previous.items() if restore else ():
            signal.signal(signum, old)
