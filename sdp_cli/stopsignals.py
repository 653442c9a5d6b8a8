"""SIGINT, SIGTERM and SIGHUP as requests to stop at a safe point (docs/reliability.md, "Signals").

Python's default turns SIGINT into a ``KeyboardInterrupt`` raised wherever the main thread is,
which can cut a training step in half, and SIGTERM and SIGHUP (a closed terminal, an ended SSH
session) kill the process outright. Inside :func:`handling`, all three only call a handler;
:class:`StopRequest` is the training policy: the first signal asks for a stop at the next step
boundary, a later SIGINT (a second Ctrl-C) raises :class:`Abort` at once. A second SIGTERM or
SIGHUP is ignored: preemption systems often deliver SIGTERM by several routes (to the process
and to its group) and follow it with SIGKILL after a grace period, and a hangup reaches every
process of the terminal, so a repeat is not a request to hurry. Before its run handles them,
``sdp train`` ends at once on all three (:func:`exiting_on_signals`). Torch-free.
"""

from __future__ import annotations

import contextlib
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
            # the start's handler (exiting_on_signals) had its time: the one before it comes back
            signal.signal(signum, getattr(old, "replaced", {}).get(signum, old))


@contextmanager
def exiting_on_signals(line: Callable[[int], str]) -> Iterator[None]:
    """Inside the block SIGINT, SIGTERM and SIGHUP end the process at once: ``line(signum)`` on
    stderr and exit status 128 + the signal, with no exception raised into the code that was
    running (one raised inside an import leaves the module half-imported, and the next import of
    it fails with an error that names no signal: a ``KeyboardInterrupt`` in transformers' model
    code came out as ``ModuleNotFoundError``, in numpy's as ``RecursionError``). For a process
    that has written nothing yet and whose helpers leave on their own once it has gone: ``sdp
    train`` before its run handles signals. Once a run's :func:`handling` has taken over inside
    the block, this handler is done: that block ends with the handlers from before this one, as
    does this block where this one is still set. Main thread only (elsewhere it does nothing)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def exit_now(signum: int, _frame: object) -> None:
        if signum == signal.SIGHUP:
            drop_terminal_output()
        with contextlib.suppress(OSError):  # a terminal that has gone takes no line
            os.write(2, (line(signum) + "\n").encode())
        os._exit(128 + signum)

    previous = {signum: signal.getsignal(signum) for signum in SIGNALS}
    exit_now.replaced = previous  # type: ignore[attr-defined]  # read by handling() at its end
    for signum in SIGNALS:
        signal.signal(signum, exit_now)
    try:
        yield
    finally:
        for signum, old in previous.items():
            if signal.getsignal(signum) is exit_now:
                signal.signal(signum, old)


def interrupted_by_ctrl_c(err: BaseException) -> bool:
    """Whether ``err`` is a ``KeyboardInterrupt`` or was raised from or during one (an import
    cut off by Ctrl-C, re-raised by transformers as ``ModuleNotFoundError``)."""
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, KeyboardInterrupt):
            return True
        current = current.__cause__ or (None if current.__suppress_context__ else current.__context__)
    return False
