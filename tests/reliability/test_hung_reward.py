"""A reward function that never returns, met by a stop (issue 24 item 16), in real `sdp train`
processes: SIGINT, SIGTERM, SIGHUP and `train.batch_timeout_s`, with the reward running in a
worker thread and in a worker process.

Each run trains the example task (examples/own_task) with `+debug=fast`; once it has stepped,
the test makes every later reward call hang (a file the reward looks for). Then the stop must
end the process within a bounded time with its usual line, exit code, event and a checkpoint
of the step reached; the run lock must stay held until the process is gone (a second sdp must
never get it while the first lives); no reward worker process may outlive it. The reward is
then fixed (the file removed), and the resume command the stop printed, pasted as it is,
finishes the run, which passes ``check_finished_run``. Also: a reward that hangs on some calls,
under `task.reward_timeout_s` and `task.reward_errors=zero`, is scored 0 and the run finishes.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sdp_cli.dirlock import DirectoryLock
from sdp_cli.errors import UserError
from sdp_cli.rundir import RunDir
from sdp_cli.train.session import checkpoint as ckpt

from ..fast_run import printed_command
from . import report
from .harness import FAST, check_finished_run, events, first_step_time_after, metrics, sdp_env, wait_for

pytestmark = pytest.mark.reliability

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "own_task"

# `larger` of examples/own_task, except that it hangs while the file `hang` exists next to it
# (writing its PID to `hung` first; with `hang_held_out` there too, only on held-out records),
# or on the calls whose number (counted in `calls`) is listed in `hang_calls`. A stop must not
# depend on user code's cooperation.
REWARD = '''\
import os
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def _at(name):
    return os.path.join(HERE, name)


def _hang():
    with open(_at("hung"), "a") as fh:
        fh.write(f"{os.getpid()}\\n")
    while True:
        time.sleep(0.5)


def larger(prompt, completion, record):
    with open(_at("calls"), "a") as fh:
        fh.write("x")
        number = fh.tell()
    planned = open(_at("hang_calls")).read().split() if os.path.exists(_at("hang_calls")) else []
    if os.path.exists(_at("hang")) and bool(record.get("held_out")) == os.path.exists(_at("hang_held_out")):
        _hang()
    if str(number) in planned:
        _hang()
    answer = completion.strip()
    return {"score": float(answer == record["answer"]), "format": float(answer.isdigit())}
'''

STOP_BOUND_S = 60  # a stop on a loaded 2-core machine takes seconds; a hang takes forever
STEPS = 12


def _work(tmp_path: Path) -> Path:
    work = tmp_path / "work"
    shutil.copytree(EXAMPLE, work)
    (work / "reward.py").write_text(REWARD)
    return work


def _args(pool: str, run_dir: Path, *extra: str) -> list[str]:
    return ["--config-dir", "conf", "task=larger", *FAST, f"task.reward_pool={pool}", f"train.steps={STEPS}",
            f"run.dir={run_dir}", *extra]  # fmt: skip


def _hung_pids(work: Path) -> list[int]:
    path = work / "hung"
    return [int(x) for x in path.read_text().split()] if path.is_file() else []


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _lock_held_while_alive(run_dir: Path, proc: subprocess.Popen, timeout: float) -> float:
    """Until ``proc`` exits (at most ``timeout`` s): try to take the run lock again and again; it
    must never be free while ``proc`` lives. Returns when it exited."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            lock = DirectoryLock.acquire(run_dir, "run directory")
        except UserError:
            lock = None
        if lock is not None:
            lock.release()
            # the kernel frees an exited process's lock before the parent reaps it: a free lock
            # with the process still running is the defect
            assert proc.poll() is not None or _wait_exit(proc, 1.0), "the run lock was free while sdp still ran"
        if proc.poll() is not None:
            return time.time()
        assert time.monotonic() < deadline, f"sdp did not exit within {timeout:.0f} s of the stop"
        time.sleep(0.05)


def _wait_exit(proc: subprocess.Popen, seconds: float) -> bool:
    try:
        proc.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        return False
    return True


def _resume_and_finish(work: Path, run_dir: Path, line: str, env: dict[str, str], label: str, exited_at: float,
                       stopped_at: int) -> None:  # fmt: skip
    (work / "hang").unlink()
    command = printed_command(line)
    assert command[:2] == ["sdp", "train"] and "task.reward=reward.py:larger" in command, line
    done = subprocess.run([sys.executable, "-m", "sdp_cli", *command[1:]], cwd=work, env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    verdict = check_finished_run(run_dir, STEPS)
    run_id = f"hung reward: {label}"
    report.run_result(run_id, survived=True, samples_lost=verdict.audit.samples_lost,
                      samples_duplicated=verdict.audit.samples_duplicated)  # fmt: skip
    back = first_step_time_after(run_dir, stopped_at, exited_at)
    report.fault("hung reward", label, run_id, None if back is None else back - exited_at)


STOPS = {"SIGINT": signal.SIGINT, "SIGTERM": signal.SIGTERM, "SIGHUP": signal.SIGHUP, "batch timeout": None}


@pytest.mark.parametrize("pool", ["thread", "process"])
@pytest.mark.parametrize("stop", list(STOPS))
def test_a_hung_reward_does_not_keep_a_stopped_run_alive(pool, stop, tmp_path, sdp_cache):
    work, run_dir = _work(tmp_path), tmp_path / "run"
    env = sdp_env(sdp_cache)
    extra = ["train.batch_timeout_s=4"] if stop == "batch timeout" else []
    proc = subprocess.Popen([sys.executable, "-m", "sdp_cli", "train", *_args(pool, run_dir, *extra)], cwd=work,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        wait_for(lambda: len(metrics(run_dir)) >= 2, 300, "two steps", proc)
        (work / "hang").touch()
        wait_for(lambda: _hung_pids(work), 120, "a reward call to hang", proc)
        signum = STOPS[stop]
        if signum is not None:
            proc.send_signal(signum)
        exited_at = _lock_held_while_alive(run_dir, proc, STOP_BOUND_S + (0 if signum else 300))
        _, stderr = proc.communicate(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    for pid in _hung_pids(work):
        wait_for(lambda: not _alive(pid), 10, f"the reward worker {pid} to end")
    assert "Traceback" not in stderr, stderr[-3000:]
    last = [x for x in stderr.splitlines() if x.strip()][-1]
    event = events(run_dir)[-1]
    if signum is not None:
        assert proc.returncode == 128 + signum, (proc.returncode, stderr[-3000:])
        assert last.startswith("stopped at step ") and f"({stop}); resume with: sdp train resume={run_dir}" in last, last
        step = int(last.split()[3])
        assert event["event"] == "interrupted" and event["signal"] == stop and event["step"] == step, event
    else:
        assert proc.returncode == 2, (proc.returncode, stderr[-3000:])
        assert last.startswith("error: training stopped at step ") and "train.batch_timeout_s=4s" in last, last
        step = int(last.split()[5].rstrip(":"))
        assert event["event"] == "stopped" and event["step"] == step, event
    assert ckpt.find_latest(RunDir(run_dir).checkpoints).name == f"step-{step:06d}"
    _resume_and_finish(work, run_dir, last, env, f"{stop}, {pool} pool", exited_at, step)


@pytest.mark.parametrize("pool", ["thread", "process"])
def test_calls_that_hang_past_the_timeout_score_0_and_the_run_finishes(pool, tmp_path, sdp_cache):
    work, run_dir = _work(tmp_path), tmp_path / "run"
    # calls 20 and 70 hang (about steps 2 and 5 of 16 calls each) for good
    (work / "hang_calls").write_text("20 70")
    args = _args(pool, run_dir, "task.reward_timeout_s=2", "task.reward_errors=zero")
    done = subprocess.run([sys.executable, "-m", "sdp_cli", "train", *args], cwd=work, env=sdp_env(sdp_cache),
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(_hung_pids(work)) == 2
    for pid in _hung_pids(work):  # a thread's calls die with the process; a worker is killed at its timeout
        assert not _alive(pid), pid
    rows = [r for r in metrics(run_dir) if "version" in r]
    # both hung calls were scored 0 and counted; every step reports the count of its interval
    assert all("reward/errors" in r for r in rows) and sum(r["reward/errors"] for r in rows) == 2, rows
    errors = [e for e in events(run_dir) if e["event"] == "reward_error"]
    assert len(errors) == 1 and "did not return within task.reward_timeout_s=2s" in errors[0]["error"], errors
    verdict = check_finished_run(run_dir, STEPS)
    run_id = f"hung reward: calls past task.reward_timeout_s, {pool} pool"
    report.run_result(run_id, survived=True, samples_lost=verdict.audit.samples_lost,
                      samples_duplicated=verdict.audit.samples_duplicated)  # fmt: skip
    for _ in range(2):
        report.fault("hung reward", f"calls past task.reward_timeout_s, scored 0, {pool} pool", run_id)


@pytest.mark.parametrize("pool", ["thread", "process"])
def test_a_reward_hung_in_the_greedy_evaluation_does_not_keep_a_stop_waiting(pool, tmp_path, sdp_cache):
    """The evaluations (every 2 steps) score held-out records, on which the reward hangs once
    the run has stepped; SIGTERM must still stop the run, at the step whose evaluation hung
    (before: the evaluation ran the reward in the trainer thread, which never came back to look
    at the stop request)."""
    work, run_dir = _work(tmp_path), tmp_path / "run"
    records = (work / "data.jsonl").read_text().splitlines()
    (work / "train.jsonl").write_text("\n".join(records[:180]) + "\n")
    (work / "held_out.jsonl").write_text("\n".join(
        json.dumps({**json.loads(r), "held_out": True}) for r in records[180:]) + "\n")  # fmt: skip
    (work / "hang_held_out").touch()
    args = _args(pool, run_dir, "task.path=train.jsonl", "task.eval_path=held_out.jsonl", "task.eval_fraction=null",
                 "train.eval_samples=4", "train.eval_every=2")  # fmt: skip
    env = sdp_env(sdp_cache)
    proc = subprocess.Popen([sys.executable, "-m", "sdp_cli", "train", *args], cwd=work, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        wait_for(lambda: len(metrics(run_dir)) >= 2, 300, "the initial evaluation and a step", proc)
        (work / "hang").touch()
        wait_for(lambda: _hung_pids(work), 120, "an evaluation to hang", proc)
        proc.send_signal(signal.SIGTERM)
        exited_at = _lock_held_while_alive(run_dir, proc, STOP_BOUND_S)
        _, stderr = proc.communicate(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    for pid in _hung_pids(work):
        wait_for(lambda: not _alive(pid), 10, f"the reward worker {pid} to end")
    assert proc.returncode == 143, stderr[-3000:]
    last = [x for x in stderr.splitlines() if x.strip()][-1]
    assert last.startswith("stopped at step ") and "(SIGTERM); resume with: " in last, last
    step = int(last.split()[3])
    assert step % 2 == 0, last  # the step of an evaluation
    assert not [r for r in metrics(run_dir) if r["step"] == step and "eval/greedy_accuracy" in r]  # given up: unwritten
    assert ckpt.find_latest(RunDir(run_dir).checkpoints).name == f"step-{step:06d}"
    _resume_and_finish(work, run_dir, last, env, f"in the greedy evaluation, SIGTERM, {pool} pool", exited_at, step)
