"""Who may run the local engine's model next: the pause switch and the model turn.

One model forward runs at a time. Decode steps of concurrent ``generate`` calls take turns in
FIFO order, one step per turn, so calls interleave at token granularity and none starves.
``pause`` closes the gate for decode steps and waits for the running one to end (docs/design.md §2
step 1). Exclusive work of the trainer thread (scoring, weight loading, version changes) does not
wait for ``resume``, because the recompute pass and the weight swap happen while paused, and it
goes before queued decode steps.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager

from sdp_cli.engine.base import EngineError


class StepGate:
    """Pause switch plus a model lock with round-robin decode turns and priority exclusive turns."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._paused = False
        self._busy = False
        self._closed = False
        # decode turns waiting, oldest first; a turn is granted only to the head
        self._queue: deque[object] = deque()
        self._exclusive_waiting = 0

    # ------------------------------------------------------------------ turns
    @contextmanager
    def decode_turn(self) -> Iterator[None]:
        """Hold the model for one decode step; blocks while paused or while others go first."""
        ticket = object()
        with self._cond:
            self._queue.append(ticket)
            try:
                while not self._closed and (
                    self._paused
                    or self._busy
                    or self._exclusive_waiting
                    or self._queue[0] is not ticket
                ):
                    self._cond.wait()
                if self._closed:
                    raise EngineError("the local engine was closed while generate() was running")
            finally:
                self._queue.remove(ticket)
                # the queue head changed: let the next one re-check its turn
                self._cond.notify_all()
            self._busy = True
        try:
            yield
        finally:
            self._release()

    @contextmanager
    def exclusive_turn(self) -> Iterator[None]:
        """Hold the model for trainer-side work: ignores the pause, goes before decode turns."""
        with self._cond:
            self._exclusive_waiting += 1
            try:
                while self._busy and not self._closed:
                    self._cond.wait()
                if self._closed:
                    raise EngineError("the local engine is closed")
            finally:
                self._exclusive_waiting -= 1
            self._busy = True
        try:
            yield
        finally:
            self._release()

    def _release(self) -> None:
        with self._cond:
            self._busy = False
            self._cond.notify_all()

    # ------------------------------------------------------------- pause switch
    def pause(self) -> None:
        """Close the gate for decode turns and return once no model work is running."""
        with self._cond:
            self._paused = True
            while self._busy:
                self._cond.wait()

    def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    def is_paused(self) -> bool:
        with self._cond:
            return self._paused

    def close(self) -> None:
        """Make every waiting and future turn fail with EngineError."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
