"""Reward functions that fail, exit, hang or die (issue 24 items 8, 16 and 24): what the pool
reports, `task.reward_errors=zero` with its error rate, the per-call timeout in both pools, and
a close that neither waits for user code nor leaves a worker process behind.

Rewards are real functions in files, loaded as a run loads them (``load_reward`` +
``call_reward``), so the process pool imports them in its spawned workers."""

from __future__ import annotations

import functools
import os
import sys
import threading
import time
import types
from pathlib import Path

import pytest

from sdp_cli.tasks.plugins import RewardError, call_reward, load_reward
from sdp_cli.train.asyncloop import rewarding
from sdp_cli.train.asyncloop.loop_state import LoopStopped
from sdp_cli.train.asyncloop.rewarding import RewardPool, RewardRules

from .test_rewarding import CountingEngine, GatedTask, _loop

JUDGE = """\
import os, sys, time

def judge(prompt, completion, record):
    what = record["what"]
    if what == "exit":
        sys.exit(3)
    if what == "interrupt":
        raise KeyboardInterrupt
    if what == "fail":
        raise ValueError("judge unreachable")
    if what == "other":
        raise LookupError("another failure")
    if what == "hang":  # until the test ends (the fixture's release file)
        open(record["marker"], "w").write(str(os.getpid()))
        while not os.path.exists(record["release"]):
            time.sleep(0.02)
    if what == "die":
        os._exit(9)
    return float(record.get("score", 1.0))
"""


@pytest.fixture
def judge(tmp_path):
    """A call factory: ``judge(what, **record)`` is one reward call of the judge in a file. Hung
    calls return when the test ends, so no thread of one test runs on into the next."""
    (tmp_path / "judge.py").write_text(JUDGE)
    spec = load_reward(f"{tmp_path}/judge.py:judge", {}, answer_key="answer")
    release = tmp_path / "release"

    def call(what: str, **record):
        record = {"what": what, "release": str(release), **record}
        return functools.partial(call_reward, spec, "p", "c", record, f"record {what}")

    yield call
    release.touch()
    _wait(lambda: not rewarding.user_code_running(), 10, "the hung calls to return")


class Reports:
    """The pool's callback: every ``(results, error)`` it reported, in order."""

    def __init__(self):
        self.got: list[tuple[list | None, BaseException | None]] = []
        self.cond = threading.Condition()

    def __call__(self, results, error):
        with self.cond:
            self.got.append((results, error))
            self.cond.notify_all()

    def wait(self, n: int, timeout: float = 60) -> list:
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.got) >= n, timeout), f"{len(self.got)} of {n} reports"
            return list(self.got)


def _children() -> set[int]:
    """PIDs of this process's live children (zombies excluded), but multiprocessing's resource
    tracker, which the first spawned process starts and which stays for the session."""
    pids = set()
    for proc in Path("/proc").iterdir():
        try:
            stat = (proc / "stat").read_text()
            cmdline = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if fields[1] == str(os.getpid()) and fields[0] != "Z" and b"resource_tracker" not in cmdline:
            pids.add(int(proc.name))
    return pids


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _wait(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


# ------------------------------------------------------- exits and interrupts
@pytest.mark.parametrize("kind", ["thread", "process"])
@pytest.mark.parametrize("what,named", [("exit", "SystemExit: 3"), ("interrupt", "KeyboardInterrupt")])
def test_a_reward_that_exits_or_raises_keyboard_interrupt_is_a_named_reward_error(kind, what, named, judge):
    reports = Reports()
    pool = RewardPool(kind=kind, name="of task t")
    try:
        pool.submit([judge(what)], ["r"], reports)
        ((results, error),) = reports.wait(1)
    finally:
        pool.close()
    assert results is None and isinstance(error, RewardError)
    # before: the bare exception reached the run, "rollout producer failed: 3" (or nothing
    # after the colon for KeyboardInterrupt)
    assert str(error) == f"reward function judge.py:judge failed on record {what}: {named}"


def _exits():
    raise SystemExit(3)


def test_a_reward_outside_call_reward_that_exits_is_named_too():
    # the built-in tasks hand the pool their own callables, not call_reward's
    reports = Reports()
    pool = RewardPool(name="of task arith1")
    try:
        pool.submit([_exits], ["record 4"], reports)
        ((_, error),) = reports.wait(1)
    finally:
        pool.close()
    assert str(error) == "reward function of task arith1 failed on record 4: SystemExit: 3"


class InterruptingEngine(CountingEngine):
    def generate(self, samples, params):
        raise KeyboardInterrupt


def test_a_producer_failure_without_a_message_is_named_by_its_type():
    loop, _ = _loop(GatedTask())
    loop.producer.engine = InterruptingEngine()
    loop.start()
    try:
        _wait(lambda: loop.producer.error is not None, 10, "the producer to fail")
        with pytest.raises(LoopStopped) as stopped:
            loop._raise_if_stopped(stop_requested=False)
    finally:
        loop.stop()
    # before: "rollout producer failed: " and nothing after the colon
    assert str(stopped.value) == "rollout producer failed: KeyboardInterrupt"


# ------------------------------------------------------- task.reward_errors=zero
def test_zero_scores_a_failing_call_0_counts_it_and_keeps_each_distinct_error_once(judge):
    reports = Reports()
    pool = RewardPool(name="of task t", rules=RewardRules(errors="zero", max_error_rate=1.0))
    try:
        pool.submit([judge("ok", score=1.0), judge("fail"), judge("ok", score=0.5)], ["a", "b", "c"], reports)
        pool.submit([judge("fail"), judge("other")], ["d", "e"], reports)
        got = reports.wait(2)
    finally:
        pool.close()
    assert got[0] == ([(1.0, {}), (0.0, {}), (0.5, {})], None)
    assert got[1] == ([(0.0, {}), (0.0, {})], None)
    count, first = pool.take_errors()
    # three failed calls; the two ValueErrors raised on the same line are one distinct error
    assert count == 3
    assert [str(e) for e in first] == [
        "reward function judge.py:judge failed on record fail: ValueError: judge unreachable",
        "reward function judge.py:judge failed on record other: LookupError: another failure",
    ]
    assert 'raise ValueError("judge unreachable")' in first[0].details  # the user's traceback
    assert pool.take_errors() == (0, [])  # taken once


def test_zero_stops_past_the_error_rate_over_the_window(judge):
    # window 10, rate 0.2: the run stops once more than 0.2 × 10 = 2 of the last 10 calls failed.
    # Calls: F, 10 × ok, F, F (the first F has left the window: 2 failures in the last 10) →
    # scored; then F (3 failures in the last 10: F F F among ok ok ok ok ok ok ok) → stop.
    reports = Reports()
    pool = RewardPool(name="of task t", rules=RewardRules(errors="zero", max_error_rate=0.2, error_window=10))
    sequence = ["fail"] + ["ok"] * 10 + ["fail", "fail", "fail"]
    try:
        for i, what in enumerate(sequence):
            pool.submit([judge(what)], [f"call {i}"], reports)
        got = reports.wait(len(sequence))
    finally:
        pool.close()
    assert all(error is None for _, error in got[:-1]), got
    results, error = got[-1]
    assert results is None and isinstance(error, RewardError)
    assert str(error).startswith(
        "reward function of task t failed on 3 of the last 10 calls, more than "
        "task.reward_max_error_rate=0.2 allows; the last: reward function judge.py:judge failed on record fail: "
        "ValueError: judge unreachable;"
    ), error


def test_raise_stops_at_the_first_failure(judge):
    reports = Reports()
    pool = RewardPool(name="of task t")
    try:
        pool.submit([judge("ok"), judge("fail"), judge("ok")], ["a", "b", "c"], reports)
        ((results, error),) = reports.wait(1)
    finally:
        pool.close()
    assert results is None and "ValueError: judge unreachable" in str(error)


# ------------------------------------------------------- per-call timeout
def test_thread_pool_a_call_past_its_timeout_is_abandoned_and_the_group_goes_on(judge, tmp_path):
    reports = Reports()
    pool = RewardPool(name="of task t", rules=RewardRules(errors="zero", timeout_s=0.5, max_error_rate=1.0))
    marker = tmp_path / "hung"
    try:
        started = time.monotonic()
        pool.submit([judge("hang", marker=str(marker)), judge("ok", score=0.75)], ["a", "b"], reports)
        ((results, error),) = reports.wait(1)
        took = time.monotonic() - started
        # the hung call scores 0 after 0.5 s; the next one runs on a fresh thread
        assert (results, error) == ([(0.0, {}), (0.75, {})], None)
        assert took < 10, took
        count, first = pool.take_errors()
        assert count == 1
        assert str(first[0]).startswith("reward function of task t did not return within task.reward_timeout_s=0.5s on a;")
        # the abandoned call still runs in its thread: the process must not wait for it at exit
        assert rewarding.user_code_running()
    finally:
        pool.close()


def test_thread_pool_a_timeout_under_raise_stops_the_run(judge, tmp_path):
    reports = Reports()
    pool = RewardPool(name="of task t", rules=RewardRules(timeout_s=0.3))
    try:
        pool.submit([judge("hang", marker=str(tmp_path / "m"))], ["record 9"], reports)
        ((results, error),) = reports.wait(1)
    finally:
        pool.close()
    assert results is None
    assert str(error).startswith("reward function of task t did not return within task.reward_timeout_s=0.3s on record 9;")


def test_process_pool_a_hung_worker_is_killed_at_its_timeout_and_replaced(judge, tmp_path):
    reports = Reports()
    pool = RewardPool(kind="process", name="of task t",
                      rules=RewardRules(errors="zero", timeout_s=2.0, max_error_rate=1.0))  # fmt: skip
    marker = tmp_path / "hung"
    before = _children()
    try:
        pool.submit([judge("hang", marker=str(marker)), judge("ok", score=0.25)], ["a", "b"], reports)
        _wait(marker.exists, 60, "the hung call to start")
        hung = int(marker.read_text())
        assert hung in _children() - before
        ((results, error),) = reports.wait(1)
        assert (results, error) == ([(0.0, {}), (0.25, {})], None)
        _wait(lambda: not _alive(hung), 10, "the hung worker to be killed")
        assert not rewarding.user_code_running()  # nothing of it runs in this process
        pool.submit([judge("ok", score=0.5)], ["c"], reports)
        assert reports.wait(2)[1] == ([(0.5, {})], None)
    finally:
        pool.close()
    assert _children() - before == set(), "a worker process outlived the pool"


def test_process_pool_a_worker_that_dies_is_one_error_and_is_replaced(judge):
    reports = Reports()
    pool = RewardPool(kind="process", name="of task t", rules=RewardRules(errors="zero", max_error_rate=1.0))
    try:
        pool.submit([judge("die"), judge("ok", score=0.5)], ["a", "b"], reports)
        ((results, error),) = reports.wait(1)
        assert (results, error) == ([(0.0, {}), (0.5, {})], None)
        _, (first,) = pool.take_errors()
        assert str(first).startswith("a reward worker process died while scoring a (exit code 9)")
    finally:
        pool.close()


@pytest.mark.parametrize("kind", ["thread", "process"])
def test_close_does_not_wait_for_a_hung_call_and_leaves_no_worker(kind, judge, tmp_path):
    reports = Reports()
    pool = RewardPool(kind=kind, name="of task t")  # no timeout: the call would run forever
    marker = tmp_path / "hung"
    before = _children()
    pool.submit([judge("hang", marker=str(marker))], ["a"], reports)
    _wait(marker.exists, 60, "the hung call to start")
    started = time.monotonic()
    pool.close()
    assert time.monotonic() - started < 10
    assert reports.got == []  # nothing is reported after close
    assert _children() - before == set(), "the hung worker process was not ended"
    assert rewarding.user_code_running() == (kind == "thread")


# ------------------------------------------------------- scoring while waiting (evaluation)
def test_score_returns_the_results_or_none_once_the_caller_gives_up(judge, tmp_path):
    pool = RewardPool(name="of task t")
    try:
        assert pool.score([judge("ok", score=0.5), judge("ok", score=1.0)], ["a", "b"], give_up=lambda: False) == [
            (0.5, {}),
            (1.0, {}),
        ]
        with pytest.raises(RewardError, match="ValueError: judge unreachable"):
            pool.score([judge("fail")], ["d"], give_up=lambda: False)
        # a stop while a call hangs: the caller goes on (the stop path), the call is abandoned
        asked = time.monotonic()
        assert pool.score([judge("hang", marker=str(tmp_path / "m"))], ["c"],
                          give_up=lambda: time.monotonic() - asked > 0.5) is None  # fmt: skip
        assert time.monotonic() - asked < 5
    finally:
        pool.close()


# ------------------------------------------------------- the config keys
@pytest.mark.parametrize("override,message", [
    ("task.reward_errors=skip", "task.reward_errors='skip' is not valid; choose one of raise, zero"),
    ("task.reward_timeout_s=0", "task.reward_timeout_s=0.0 must be > 0"),
    ("task.reward_timeout_s=inf", "task.reward_timeout_s=inf must be a finite number"),
    ("task.reward_max_error_rate=1.5", "task.reward_max_error_rate=1.5 must be in [0, 1] (1: never stop for reward errors)"),
    ("task.reward_max_error_rate=nan", "task.reward_max_error_rate=nan must be in [0, 1] (1: never stop for reward errors)"),
    ("task.reward_error_window=0", "task.reward_error_window=0 must be > 0"),
])  # fmt: skip
def test_bad_reward_error_settings_are_one_line(override, message):
    from sdp_cli.config.compose import compose_config
    from sdp_cli.errors import UserError

    with pytest.raises(UserError) as refused:
        compose_config([override])
    assert str(refused.value) == message


def test_the_reward_error_settings_apply_to_every_task_and_may_change_at_a_resume():
    from sdp_cli.config.compose import compose_config
    from sdp_cli.config.resume_keys import allowed_at_resume

    keys = {"reward_errors": "zero", "reward_timeout_s": 30.0, "reward_max_error_rate": 0.5, "reward_error_window": 20}
    cfg, _ = compose_config(["task=arith1", *(f"task.{k}={v}" for k, v in keys.items())])  # a built-in task
    assert RewardRules.of(cfg.task) == RewardRules("zero", 30.0, 0.5, 20)
    assert all(allowed_at_resume(f"task.{k}") for k in keys)


def test_a_worker_process_dropped_by_many_threads_at_once_is_dropped_once():
    """The pool's close and a slot that finds its worker dead drop the same runner from two
    threads (CI saw EBADF from the second close of the pipe); every concurrent drop returns."""
    for _ in range(3):
        runner = rewarding._ProcessRunner("of task t")
        barrier = threading.Barrier(8)
        errors: list[BaseException] = []

        def drop() -> None:
            barrier.wait()
            try:
                runner.drop()
            except BaseException as err:  # noqa: BLE001 - the test collects what any thread raises
                errors.append(err)

        threads = [threading.Thread(target=drop) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert errors == []
        assert runner.process.exitcode is not None and runner not in rewarding._ProcessRunner.live


def test_process_pool_calls_a_worker_cannot_load_are_each_an_error(judge):
    """Reward calls whose function lives in a module only this process has (a worker is spawned,
    not forked): every call of the batch is that one error, and the worker goes on to score the
    next batch."""
    module = types.ModuleType("sdp_module_only_in_the_parent")
    exec("def score():\n    return 1.0\n", module.__dict__)
    sys.modules[module.__name__] = module
    reports = Reports()
    pool = RewardPool(kind="process", name="of task t", rules=RewardRules(errors="zero", max_error_rate=1.0))
    try:
        pool.submit([module.score, module.score, module.score], ["a", "b", "c"], reports)
        pool.submit([judge("ok", score=0.5)], ["d"], reports)
        got = reports.wait(2)
    finally:
        pool.close()
        del sys.modules[module.__name__]
    assert got == [([(0.0, {})] * 3, None), ([(0.5, {})], None)]
    count, (first,) = pool.take_errors()
    assert count == 3
    assert str(first).startswith(
        "a reward worker process could not load the reward calls (ModuleNotFoundError: No module named "
        "'sdp_module_only_in_the_parent'); give task.reward as package.module:function"
    ), first
