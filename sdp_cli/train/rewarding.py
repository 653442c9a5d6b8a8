"""Reward scoring off the generation path (docs/tasks.md, "How rewards run").

The rollout producer decodes a finished group's completions, hands the group's reward calls
(``Task.reward_call``) to a pool and goes straight back to generating; when the pool has
scored the group, a callback hands it to the queue. ``task.reward_pool=thread`` (default) runs
the calls on ``task.reward_workers`` threads; ``process`` runs them in spawned worker processes,
which only pays off for reward functions that hold the GIL for long (pure-Python parsing):
arguments and results cross the process boundary as plain data.

``task.reward_workers=1`` scores groups in the order they were generated, so hand-over order is
as without a pool; more workers may hand groups over out of order.
"""

from __future__ import annotations

import multiprocessing
import signal
import threading
from concurrent.futures import CancelledError, Executor, Future, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Callable, Sequence

from sdp_cli.choices import REWARD_POOLS
from sdp_cli.errors import UserError
from sdp_cli.tasks.base import RewardValue
from sdp_cli.tasks.plugins import to_score

#: keys sdp itself logs under reward/ (a reward function's extras may not reuse them)
RESERVED = ("mean",)
EXTRAS = "reward_extras"


def _leave_signals_to_the_run() -> None:
    """In a reward worker process: a Ctrl-C reaches the whole process group, and SIGTERM may too
    (preemption); the run stops at a step boundary and shuts its workers down itself
    (docs/reliability.md, "Signals"), so a worker must not die of them mid-call."""
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)


def _run_calls(calls: Sequence[Callable[[], RewardValue]]) -> list[RewardValue]:
    return [call() for call in calls]


class RewardPool:
    """Runs groups of reward calls on worker threads or processes and reports each group's
    checked ``(score, extras)`` list, or the error, to a callback."""

    def __init__(self, *, workers: int = 1, kind: str = "thread", name: str = "reward"):
        assert workers >= 1, f"reward workers must be >= 1, got {workers}"
        assert kind in REWARD_POOLS, f"unknown reward pool {kind!r}"
        self.name = name
        self._executor: Executor
        if kind == "process":
            # spawn, not fork: the parent runs torch and several threads
            self._executor = ProcessPoolExecutor(
                workers, mp_context=multiprocessing.get_context("spawn"), initializer=_leave_signals_to_the_run
            )
        else:
            self._executor = ThreadPoolExecutor(workers, thread_name_prefix="sdp-reward")
        self._closed = False
        self._lock = threading.Lock()  # submit and close race when the loop stops

    def submit(
        self,
        calls: Sequence[Callable[[], RewardValue]],
        wheres: Sequence[str],
        done: Callable[[list[tuple[float, dict[str, float]]] | None, BaseException | None], None],
    ) -> None:
        """Score ``calls`` (one per sample) and call ``done(results, None)`` or ``done(None, error)``
        from a pool thread. After ``close`` nothing is scored or reported: the groups stay with
        the producer, like groups still being generated when the loop stops."""
        with self._lock:
            if self._closed:
                return
            future = self._executor.submit(_run_calls, list(calls))
        future.add_done_callback(lambda f: self._finish(f, list(wheres), done))

    def _finish(self, future: Future[Any], wheres: list[str], done: Callable[..., None]) -> None:
        if self._closed:
            return
        try:
            values = future.result()
            results = [self._check(value, where) for value, where in zip(values, wheres)]
        except CancelledError:
            return
        except BrokenProcessPool as err:
            done(None, UserError(
                f"a reward worker process died ({err}): a reward function crashed the interpreter, or a "
                "spawned worker could not import it; give task.reward as package.module:function or "
                "path/to/file.py:function, or use task.reward_pool=thread"
            ))
            return
        except BaseException as err:  # the loop stops the run and reports it
            done(None, err)
            return
        done(results, None)

    def _check(self, value: RewardValue, where: str) -> tuple[float, dict[str, float]]:
        score, extras = to_score(value, self.name, where)
        clash = sorted(set(extras) & set(RESERVED))
        if clash:
            raise UserError(
                f"reward function {self.name} returned the key {clash[0]!r}, which sdp logs itself as "
                f"reward/{clash[0]}; rename it"
            )
        return score, extras

    def close(self) -> None:
        """Stop reporting and drop queued work; a call already running finishes in the background."""
        with self._lock:
            self._closed = True
            self._executor.shutdown(wait=False, cancel_futures=True)


def extra_means(extras: Sequence[dict[str, float] | None]) -> dict[str, float]:
    """``reward/<key>``: the mean of each extra over the samples that report it."""
    sums: dict[str, list[float]] = {}
    for sample_extras in extras:
        for key, value in (sample_extras or {}).items():
            sums.setdefault(key, []).append(value)
    return {f"reward/{key}": sum(values) / len(values) for key, values in sorted(sums.items())}
