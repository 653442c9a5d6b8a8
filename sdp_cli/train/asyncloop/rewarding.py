"""Reward scoring off the generation path (docs/tasks.md, "How rewards run").

The rollout producer decodes a finished group's completions, hands the group's reward calls
(``Task.reward_call``) to a pool and goes straight back to generating; when the pool has scored
the group, a callback hands it to the queue. The pool has ``task.reward_workers`` slots. A slot
is a dispatcher thread that runs its groups' calls, one at a time, on a *runner*: a worker
thread (``task.reward_pool=thread``, default) or a spawned worker process (``process``, which
only pays off for reward functions that hold the GIL for long; arguments and results cross the
process boundary as plain data). ``task.reward_workers=1`` scores groups in the order they were
generated; more workers may hand groups over out of order.

Reward functions are user code: they fail, exit, hang, crash their interpreter. The pool turns
each of these into a :class:`RewardError` that names it and applies ``RewardRules``:

- ``task.reward_errors=raise`` (default): the first failure stops the run. ``zero``: the sample
  scores 0, the failure is counted (``reward/errors``) and the first traceback of each distinct
  error is kept for ``events.jsonl`` (:meth:`RewardPool.take_errors`); the run stops only once
  more than ``task.reward_max_error_rate`` of the last ``task.reward_error_window`` calls failed.
- ``task.reward_timeout_s``: a call still running after it has failed. A thread cannot be
  killed: its runner is abandoned (the call runs on, its result is ignored) and the slot gets a
  new one. A worker process is killed, reaped and replaced.
- :meth:`RewardPool.close` waits for no user code: worker processes are killed and reaped,
  worker threads inside a call are left behind (daemon threads; :func:`user_code_running` tells
  the CLI to end the process without waiting for them, docs/reliability.md "Signals").
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import itertools
import multiprocessing
import os
import queue
import signal
import threading
import time
from collections import deque
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import Any, Callable, Iterator, Sequence, Union

from sdp_cli.choices import REWARD_ERRORS, REWARD_POOLS
from sdp_cli.errors import describe_exception
from sdp_cli.stopsignals import SIGNALS
from sdp_cli.tasks.base import RewardValue
from sdp_cli.tasks.plugins import RewardError, reward_failure, to_score

#: keys sdp itself logs under reward/ (a reward function's extras may not reuse them)
RESERVED = ("mean", "errors")
EXTRAS = "reward_extras"

#: what one call comes to: (score, extras), or the error that names what went wrong
Outcome = Union[tuple[float, dict[str, float]], RewardError]
#: what a runner sends back: its batch number and the outcomes of the batch's next calls
Answer = tuple[int, list[Outcome]]
Done = Callable[[Union[list[tuple[float, dict[str, float]]], None], Union[BaseException, None]], None]

# how often a dispatcher waiting on a call looks whether the pool was closed
_POLL_S = 0.5
# Linux prctl option: a signal for this process when the thread that started it ends
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class RewardRules:
    """How a pool treats reward calls that fail or hang (the ``task.reward_*`` keys)."""

    errors: str = "raise"
    timeout_s: float | None = None
    max_error_rate: float = 0.1
    error_window: int = 100

    def __post_init__(self) -> None:
        assert self.errors in REWARD_ERRORS, f"unknown task.reward_errors {self.errors!r}"
        assert self.timeout_s is None or self.timeout_s > 0, f"reward timeout must be > 0, got {self.timeout_s}"
        assert 0 <= self.max_error_rate <= 1 and self.error_window >= 1, (self.max_error_rate, self.error_window)

    @classmethod
    def of(cls, task: Any) -> RewardRules:
        """The rules a run's ``task`` config sets."""
        return cls(task.reward_errors, task.reward_timeout_s, task.reward_max_error_rate, task.reward_error_window)


class _Running:
    """How many reward calls are running in threads of this process, abandoned ones included."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._count = 0

    def add(self, n: int) -> None:
        with self._changed:
            self._count += n
            self._changed.notify_all()

    def none_within(self, seconds: float) -> bool:
        """Whether the count is (or within ``seconds`` falls to) zero."""
        with self._changed:
            return self._changed.wait_for(lambda: self._count == 0, timeout=seconds)


_RUNNING = _Running()


def user_code_running(grace_s: float = 0.0) -> bool:
    """Whether a reward call still runs in a thread of this process after ``grace_s`` seconds
    (abandoned at its timeout, or left behind by a stop): the process must then end without
    waiting for it. The grace lets a call that is about to return return."""
    return not _RUNNING.none_within(grace_s)


def _score(call: Callable[[], RewardValue], name: str, where: str) -> Outcome:
    """Run one call and check its result. In a worker thread or process a KeyboardInterrupt or
    SystemExit can only be the call's own (signals reach the main thread, and workers ignore
    them), so every exception is the call's failure."""
    try:
        value = call()
    except RewardError as err:
        return err
    except BaseException as err:
        return reward_failure(name, where, err)
    try:
        score, extras = to_score(value, name, where)
    except RewardError as err:
        return err
    clash = sorted(set(extras) & set(RESERVED))
    if clash:
        return RewardError(
            f"reward function {name} returned the key {clash[0]!r}, which sdp logs itself as reward/{clash[0]}; rename it",
            key=f"reserved key {clash[0]}",
        )
    return score, extras


# ------------------------------------------------------------------ runners
def _answers(batch: int, calls: list[Any], wheres: list[str], each: bool, name: str) -> Iterator[Answer]:
    """Score the calls of ``batch``; answer after ``each`` call (a timeout must know which call
    overstays), or once for the whole batch (one message instead of one per call)."""
    outcomes: list[Outcome] = []
    for call, where in zip(calls, wheres):
        outcomes.append(_score(call, name, where))
        if each:
            yield batch, outcomes
            outcomes = []
    if outcomes:
        yield batch, outcomes


class _ThreadRunner:
    """Runs calls on a daemon thread of its own. Dropped, it ends after the call it is in, which
    nobody waits for."""

    def __init__(self, name: str):
        self._name = name
        self._inbox: queue.SimpleQueue[tuple[int, list[Any], list[str], bool] | None] = queue.SimpleQueue()
        self._outbox: queue.SimpleQueue[Answer] = queue.SimpleQueue()
        self._dropped = threading.Event()
        threading.Thread(target=self._work, name="sdp-reward", daemon=True).start()

    def send(self, batch: int, calls: list[Any], wheres: list[str], each: bool) -> None:
        self._inbox.put((batch, calls, wheres, each))

    def receive(self, timeout: float) -> Answer | None:
        """The next answer, or None if none came within ``timeout`` seconds."""
        try:
            return self._outbox.get(timeout=timeout)
        except queue.Empty:
            return None

    def drop(self) -> None:
        self._dropped.set()
        self._inbox.put(None)

    def _work(self) -> None:
        while (job := self._inbox.get()) is not None:
            answers = _answers(*job, self._name)
            while not self._dropped.is_set():
                _RUNNING.add(1)
                try:
                    answer = next(answers, None)
                finally:
                    _RUNNING.add(-1)
                if answer is None:
                    break
                self._outbox.put(answer)


class _WorkerDied(Exception):
    """The worker process ended (or its pipe broke) before answering."""


#: ``_Slot._receive``'s answer when the worker process died
_DIED: list[Outcome] = []


class _ProcessRunner:
    """Runs calls in a spawned worker process (``_worker``). Dropped, it is killed and reaped."""

    #: the live workers of this process, killed at exit should a pool not have been closed
    live: set[_ProcessRunner] = set()
    _kill_at_exit = False

    def __init__(self, name: str):
        context = multiprocessing.get_context("spawn")  # not fork: the parent runs torch and threads
        self._conn, child = context.Pipe()
        self._drop_lock = threading.Lock()
        self._dropped = False
        self.process = context.Process(target=_worker, args=(child, os.getpid(), name), name="sdp-reward")
        self.process.start()
        child.close()
        if not _ProcessRunner._kill_at_exit:  # registered after multiprocessing's own, so it runs first
            _ProcessRunner._kill_at_exit = True
            atexit.register(_kill_live_workers)
        _ProcessRunner.live.add(self)

    def send(self, batch: int, calls: list[Any], wheres: list[str], each: bool) -> None:
        """Raises what pickling the calls raises (they are not plain data), or _WorkerDied."""
        payload = ForkingPickler.dumps((calls, wheres))
        try:
            self._conn.send((batch, len(calls), each))
            self._conn.send_bytes(payload)
        except OSError as err:
            raise _WorkerDied() from err

    def receive(self, timeout: float) -> Answer | None:
        try:
            if not self._conn.poll(timeout):
                return None
            return self._conn.recv()
        except Exception as err:  # EOF, a broken pipe, an answer that does not unpickle
            raise _WorkerDied() from err

    def exit_code(self) -> int | None:
        self.process.join(timeout=2)
        return self.process.exitcode

    def drop(self) -> None:
        # the pool's close and the slot that finds the worker dead may both drop it: once only
        # (a second close of the pipe is EBADF, or closes a descriptor reused meanwhile)
        with self._drop_lock:
            if self._dropped:
                return
            self._dropped = True
            self.process.kill()
            self.process.join(timeout=10)
            self._conn.close()
            _ProcessRunner.live.discard(self)


def _kill_live_workers() -> None:
    for runner in list(_ProcessRunner.live):
        runner.drop()


def _die_with_parent(parent: int) -> None:
    """Linux: the kernel kills this worker when the thread that started it ends, however its
    process ends (kill -9 included), so a worker inside a call that never returns is no orphan.
    Elsewhere the worker ends when it reads the end of its pipe."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:  # the parent ended before the death signal was armed
        os._exit(0)


def _worker(conn: Any, parent: int, name: str) -> None:
    """A reward worker process: score each batch of calls it is sent (``_answers``).

    A Ctrl-C reaches the whole process group, and SIGTERM or SIGHUP may too (preemption, a
    closed terminal); the run stops at a step boundary and ends its workers itself
    (docs/reliability.md, "Signals"), so a worker must not die of them mid-call."""
    for signum in SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    _die_with_parent(parent)
    while True:
        try:
            batch, n, each = conn.recv()
            payload = conn.recv_bytes()
        except (EOFError, OSError):
            return
        try:
            calls, wheres = ForkingPickler.loads(payload)
        except BaseException as err:  # e.g. the reward function's module does not import here
            problem = RewardError(
                f"a reward worker process could not load the reward calls ({describe_exception(err)}); give "
                "task.reward as package.module:function or path/to/file.py:function, or use task.reward_pool=thread",
                key="worker import",
            )
            conn.send((batch, [problem] * n))
            continue
        for answer in _answers(batch, calls, wheres, each, name):
            conn.send(answer)  # plain data: floats, str-keyed floats, RewardErrors


# ------------------------------------------------------------------ the pool
@dataclass
class _Group:
    calls: list[Callable[[], RewardValue]]
    wheres: list[str]
    done: Done


def _split_results(
    sizes: list[int], dones: list[Done], results: list[tuple[float, dict[str, float]]] | None, error: BaseException | None
) -> None:
    """The done callback of a job of several groups (``RewardPool.submit_groups``)."""
    start = 0
    for size, done in zip(sizes, dones, strict=True):
        done(None if results is None else results[start : start + size], error)
        start += size


class _Slot:
    """One worker of a pool: a dispatcher thread that runs its groups on its runner and replaces
    the runner when a call overstays its timeout or the worker process dies."""

    def __init__(self, pool: RewardPool):
        self.pool = pool
        #: the current runner; guarded by the pool's lock (``close`` drops it)
        self.runner: _ThreadRunner | _ProcessRunner | None = None
        self.thread = threading.Thread(target=self._serve, name="sdp-reward-slot", daemon=True)

    def _serve(self) -> None:
        while (group := self.pool._groups.get()) is not None:
            try:
                result = self._run(group)
            except Exception as err:  # e.g. no worker process could be started: the run stops on it
                result = err
            if result is not None:
                self.pool._report(group, result)

    def _current(self) -> _ThreadRunner | _ProcessRunner | None:
        with self.pool._lock:
            if self.pool._closed.is_set():
                return None
            if self.runner is None:
                self.runner = self.pool._new_runner()
            return self.runner

    def _drop(self, runner: _ThreadRunner | _ProcessRunner) -> None:
        with self.pool._lock:
            if self.runner is runner:
                self.runner = None
        runner.drop()

    def _run(self, group: _Group) -> list[tuple[float, dict[str, float]]] | RewardError | None:
        """The group's results, or the error that stops the run; None once the pool is closed.

        Without a timeout a runner answers once per group; a worker process that dies meanwhile
        is not yet pinned on one call, so the rest of the group goes again, one answer per call."""
        results: list[tuple[float, dict[str, float]]] = []
        n = len(group.calls)
        each = self.pool.rules.timeout_s is not None
        while len(results) < n:
            runner = self._current()
            if runner is None:
                return None
            batch = next(self.pool._batches)
            start = len(results)
            try:
                runner.send(batch, group.calls[start:], group.wheres[start:], each)
            except _WorkerDied:
                pass  # _receive finds it dead
            except Exception as err:  # the calls do not pickle
                return RewardError(
                    f"the reward calls of task {self.pool.name} cannot be sent to a worker process "
                    f"({describe_exception(err)}); use task.reward_pool=thread",
                    key="calls do not pickle",
                )
            while len(results) < n and self.runner is runner:
                where = group.wheres[len(results)]
                outcomes = self._receive(runner, batch, where)
                if outcomes is None:
                    return None
                if outcomes is _DIED:
                    if each:
                        outcomes = [self._died(runner, where)]
                    else:
                        self._drop(runner)
                        each = True
                        break
                for outcome in outcomes:
                    error = self.pool._judge(outcome)
                    if error is not None:
                        return error
                    results.append((0.0, {}) if isinstance(outcome, RewardError) else outcome)
        return results

    def _receive(self, runner: _ThreadRunner | _ProcessRunner, batch: int, where: str) -> list[Outcome] | None:
        """The next outcomes of the runner's ``batch``: a call past its timeout is a RewardError
        (the runner is dropped), a dead worker ``_DIED``; None once the pool is closed."""
        timeout = self.pool.rules.timeout_s
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.pool._closed.is_set():
            left = _POLL_S if deadline is None else min(_POLL_S, deadline - time.monotonic())
            if left <= 0:
                self._drop(runner)
                return [RewardError(
                    f"reward function {self.pool.name} did not return within task.reward_timeout_s={timeout:g}s on "
                    f"{where}; make it return sooner, raise task.reward_timeout_s, or set task.reward_errors=zero "
                    "to score such calls 0",
                    key="timeout",
                )]  # fmt: skip
            try:
                answer = runner.receive(left)
            except _WorkerDied:
                return _DIED
            if answer is not None and answer[0] == batch:  # answers of a batch cut short are stale
                return answer[1]
        return None

    def _died(self, runner: _ThreadRunner | _ProcessRunner, where: str) -> RewardError:
        assert isinstance(runner, _ProcessRunner), "only a worker process dies"
        code = runner.exit_code()
        self._drop(runner)
        return RewardError(
            f"a reward worker process died while scoring {where} (exit code {code}): a reward function ended or "
            "crashed its interpreter, or a spawned worker could not import it; give task.reward as "
            "package.module:function or path/to/file.py:function, or use task.reward_pool=thread",
            key="worker died",
        )


class RewardPool:
    """Runs groups of reward calls on worker threads or processes and reports each group's
    checked ``(score, extras)`` list, or the error that stops the run, to a callback."""

    def __init__(self, *, workers: int = 1, kind: str = "thread", name: str = "reward", rules: RewardRules = RewardRules()):
        assert workers >= 1, f"reward workers must be >= 1, got {workers}"
        assert kind in REWARD_POOLS, f"unknown reward pool {kind!r}"
        self.name = name
        self.kind = kind
        self.rules = rules
        self._lock = threading.Lock()  # slots and their runners, the error accounts, closing
        self._closed = threading.Event()
        self._groups: queue.SimpleQueue[_Group | None] = queue.SimpleQueue()
        self._batches = itertools.count()
        self._slots = [_Slot(self) for _ in range(workers)]
        self._started = False
        # task.reward_errors=zero: the outcomes of the latest calls (True: failed), failures since
        # take_errors, and the first of each distinct error
        self._window: deque[bool] = deque(maxlen=rules.error_window)
        self._failed = 0
        self._seen: set[str] = set()
        self._first: list[RewardError] = []

    def _new_runner(self) -> _ThreadRunner | _ProcessRunner:
        return _ProcessRunner(self.name) if self.kind == "process" else _ThreadRunner(self.name)

    def submit(self, calls: Sequence[Callable[[], RewardValue]], wheres: Sequence[str], done: Done) -> None:
        """Score ``calls`` (one per sample) and call ``done(results, None)`` or ``done(None,
        error)`` from a pool thread. After ``close`` nothing is scored or reported: the groups
        stay with the producer, like groups still being generated when the loop stops."""
        with self._lock:
            if self._closed.is_set():
                return
            if not self._started:  # the threads start with the first work
                self._started = True
                for slot in self._slots:
                    slot.thread.start()
            self._groups.put(_Group(list(calls), list(wheres), done))

    def submit_groups(self, groups: Sequence[tuple[Sequence[Callable[[], RewardValue]], Sequence[str], Done]]) -> None:
        """``submit`` for several groups (calls, wheres, done) at once, as at most one job per
        worker: each hand-off between threads takes the interpreter for a while from the process's
        other threads (docs/training.md "What asynchrony buys on a CPU"), so a round of generation
        makes a few instead of one per group. Each ``done`` gets its own group's results; an error that
        stops the run reaches every group of its job."""
        jobs = min(len(self._slots), len(groups))
        for j in range(jobs):
            chunk = groups[len(groups) * j // jobs : len(groups) * (j + 1) // jobs]
            sizes = [len(calls) for calls, _, _ in chunk]
            self.submit(
                [call for calls, _, _ in chunk for call in calls],
                [where for _, wheres, _ in chunk for where in wheres],
                functools.partial(_split_results, sizes, [done for _, _, done in chunk]),
            )

    def score(
        self, calls: Sequence[Callable[[], RewardValue]], wheres: Sequence[str], *, give_up: Callable[[], bool]
    ) -> list[tuple[float, dict[str, float]]] | None:
        """Score ``calls`` and wait for them (the greedy evaluation); raise the error that would
        stop a run. None as soon as ``give_up()`` is true (a stop was requested): the calls are
        left to the pool, which the caller closes."""
        assert not self._closed.is_set(), "score on a closed reward pool"
        answered: list[tuple[Any, BaseException | None]] = []
        ready = threading.Event()

        def done(results: Any, error: BaseException | None) -> None:
            answered.append((results, error))
            ready.set()

        self.submit(calls, wheres, done)
        while not ready.wait(0.1):
            if give_up():
                return None
        results, error = answered[0]
        if error is not None:
            raise error
        return results

    def _judge(self, outcome: Outcome) -> RewardError | None:
        """Account one call; the error that stops the run, or None (the outcome stands, a
        failure under task.reward_errors=zero scores 0)."""
        failed = isinstance(outcome, RewardError)
        rules = self.rules
        with self._lock:
            if not failed:
                self._window.append(False)
                return None
            assert isinstance(outcome, RewardError)
            if rules.errors == "raise":
                return outcome
            self._window.append(True)
            self._failed += 1
            if outcome.key not in self._seen:
                self._seen.add(outcome.key)
                self._first.append(outcome)
            failures, calls = sum(self._window), len(self._window)
        # more than the rate allows; the tolerance keeps 0.57 × 100 from counting 57 as too many
        if failures <= rules.max_error_rate * rules.error_window + 1e-9:
            return None
        return RewardError(
            f"reward function {self.name} failed on {failures} of the last {calls} calls, more than "
            f"task.reward_max_error_rate={rules.max_error_rate:g} allows; the last: {outcome}; fix it, or raise "
            "task.reward_max_error_rate",
            outcome.details,
            key="error rate",
        )

    def take_errors(self) -> tuple[int, list[RewardError]]:
        """(calls that failed and scored 0 since the last take, the first of each distinct error
        not taken before)."""
        with self._lock:
            failed, first = self._failed, self._first
            self._failed, self._first = 0, []
        return failed, first

    def _report(self, group: _Group, result: list[tuple[float, dict[str, float]]] | Exception) -> None:
        if self._closed.is_set():
            return
        if isinstance(result, Exception):
            group.done(None, result)
        else:
            group.done(result, None)

    def close(self) -> None:
        """Stop reporting and drop queued work, without waiting for user code: worker processes
        are killed and reaped; a worker thread inside a call is left to it."""
        with self._lock:
            if self._closed.is_set():
                return
            self._closed.set()
            runners = [slot.runner for slot in self._slots if slot.runner is not None]
            for slot in self._slots:
                slot.runner = None
            for _ in self._slots:
                self._groups.put(None)
        for runner in runners:
            runner.drop()


def extra_means(extras: Sequence[dict[str, float] | None]) -> dict[str, float]:
    """``reward/<key>``: the mean of each extra over the samples that report it."""
    sums: dict[str, list[float]] = {}
    for sample_extras in extras:
        for key, value in (sample_extras or {}).items():
            sums.setdefault(key, []).append(value)
    return {f"reward/{key}": sum(values) / len(values) for key, values in sorted(sums.items())}
