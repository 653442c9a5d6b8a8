"""Thread-safe containers between the rollout producers and the trainer (docs/design.md §3).

``RolloutQueue`` holds finished rollouts in arrival order (producers put, the loop moves them to
the cache); ``RolloutCache`` holds rollouts waiting to be taken as a training batch. Both may be
inspected without being consumed (``snapshot`` / ``get_all``) so that the recompute pass of
docs/design.md §2 can patch every sample the system holds while generation is paused. A
``Doorbell`` tells a thread that also waits on sockets that something it watches has changed.

Items are opaque to both containers: a ``RolloutSample`` or a ``RolloutGroup`` (one rollout).
"""

from __future__ import annotations

import queue
import select
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class RolloutQueue(Generic[T]):
    """A FIFO queue with ``queue.Queue`` semantics plus non-destructive inspection.

    ``put``/``get`` block up to ``timeout`` seconds (forever when ``None``) and raise
    ``queue.Full``/``queue.Empty`` on expiry; the ``*_nowait`` variants never block.
    ``maxsize <= 0`` means unbounded.
    """

    def __init__(self, maxsize: int = 0, *, on_put: Callable[[], None] | None = None):
        self.maxsize = maxsize
        self._items: deque[T] = deque()
        self._lock = threading.Lock()
        self._not_empty = threading.Condition(self._lock)
        self._not_full = threading.Condition(self._lock)
        self._on_put = on_put  # called after each put, outside the lock

    def _full(self) -> bool:
        return 0 < self.maxsize <= len(self._items)

    def put(self, item: T, timeout: float | None = None) -> None:
        """Append ``item``, waiting for room if the queue is bounded and full."""
        with self._not_full:
            if not self._wait(self._not_full, lambda: not self._full(), timeout):
                raise queue.Full
            self._items.append(item)
            self._not_empty.notify()
        if self._on_put is not None:
            self._on_put()

    def get(self, timeout: float | None = None) -> T:
        """Remove and return the oldest item, waiting for one if the queue is empty."""
        with self._not_empty:
            if not self._wait(self._not_empty, lambda: bool(self._items), timeout):
                raise queue.Empty
            item = self._items.popleft()
            self._not_full.notify()
            return item

    def put_nowait(self, item: T) -> None:
        self.put(item, timeout=0)

    def get_nowait(self) -> T:
        return self.get(timeout=0)

    @staticmethod
    def _wait(cond: threading.Condition, ready: Callable[[], bool], timeout: float | None) -> bool:
        """Wait on ``cond`` (lock held) until ``ready()``; False if ``timeout`` expires first."""
        if timeout is None:
            cond.wait_for(ready)
            return True
        if timeout < 0:
            raise ValueError(f"timeout must be >= 0 or None, got {timeout}")
        deadline = time.monotonic() + timeout
        while not ready():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            cond.wait(remaining)
        return True

    def qsize(self) -> int:
        with self._lock:
            return len(self._items)

    def empty(self) -> bool:
        with self._lock:
            return not self._items

    def snapshot(self) -> list[T]:
        """A copy of the items, oldest first, without removing them."""
        with self._lock:
            return list(self._items)

    def drain(self) -> list[T]:
        """Remove and return every item, oldest first."""
        with self._lock:
            items = list(self._items)
            self._items.clear()
            self._not_full.notify_all()
            return items

    def filter_inplace(self, predicate: Callable[[T], bool]) -> int:
        """Keep the items for which ``predicate`` is true (in order); return how many were removed.

        Atomic: producers never see a half-filtered queue and the order of kept items is
        preserved (draining and re-putting would interleave them with new arrivals).
        ``predicate`` runs under the queue's lock, so it must not touch the queue.
        """
        with self._lock:
            before = len(self._items)
            self._items = deque(item for item in self._items if predicate(item))
            removed = before - len(self._items)
            if removed:
                self._not_full.notify_all()
            return removed


class RolloutCache(Generic[T]):
    """An ordered, thread-safe list of rollouts waiting to be consumed as a batch."""

    def __init__(self) -> None:
        self._items: list[T] = []
        self._lock = threading.Lock()

    def add(self, item: T) -> None:
        with self._lock:
            self._items.append(item)

    def get_all(self) -> list[T]:
        """A copy of the items, oldest first (the items themselves are shared, not copied)."""
        with self._lock:
            return list(self._items)

    def take_first_n(self, n: int) -> list[T]:
        """Remove and return the ``n`` oldest items (all of them if fewer are held)."""
        if n < 0:
            raise ValueError(f"take_first_n needs n >= 0, got {n}")
        with self._lock:
            taken = self._items[:n]
            del self._items[:n]
            return taken

    def put_back(self, items: list[T]) -> None:
        """Return ``items``, taken with ``take_first_n``, to the head of the cache, in their order."""
        with self._lock:
            self._items[:0] = items

    def size(self) -> int:
        with self._lock:
            return len(self._items)

    def clear(self) -> None:
        with self._lock:
            self._items.clear()

    def filter_inplace(self, predicate: Callable[[T], bool]) -> int:
        """Keep the items for which ``predicate`` is true; return how many were removed.

        ``predicate`` runs under the cache's lock, so it must not touch the cache.
        """
        with self._lock:
            before = len(self._items)
            self._items = [item for item in self._items if predicate(item)]
            return before - len(self._items)


class Doorbell:
    """A wake-up for a thread that waits on sockets too: ``ring`` from any thread, and ``wait``
    returns at the first ring since the last ``clear``, or when one of its sockets turns readable.

    A timed wait on a condition costs ~150 µs of CPU per wake-up on the 2-core VM of
    docs/benchmarks.md; a thread that must also watch a socket would poll both every few ms. A
    rung socket pair lets one ``select`` wait for all of them, and idle waiting costs nothing.
    """

    def __init__(self) -> None:
        self._inbox, self._bell = socket.socketpair()
        self._inbox.setblocking(False)
        self._bell.setblocking(False)

    def ring(self) -> None:
        """Wake the waiter (a ring already pending is enough; a closed bell ignores it)."""
        try:
            self._bell.send(b"\0")
        except OSError:  # full: rung already; closed: nobody waits any more
            pass

    def clear(self) -> None:
        """Forget the rings so far: call it before looking at what they announce."""
        try:
            while self._inbox.recv(4096):
                pass
        except OSError:  # drained (BlockingIOError)
            pass

    def wait(self, sockets: list[int], timeout: float) -> None:
        """Return at a ring since the last ``clear``, when one of ``sockets`` (file descriptors)
        is readable, or after ``timeout`` seconds."""
        select.select([self._inbox, *sockets], [], [], timeout)

    def close(self) -> None:
        self._inbox.close()
        self._bell.close()
