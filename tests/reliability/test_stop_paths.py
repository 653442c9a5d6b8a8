"""Stops that used to lose their record or the run (issue 24 item 24): a second Ctrl-C during
the run's first checkpoint, and SIGHUP, sent by `kill` or by a terminal that goes away."""

from __future__ import annotations

import fcntl
import os
import pty
import select
import signal
import subprocess
import sys
import termios
import threading
import time

import pytest

from sdp_cli.rundir import RunDir
from sdp_cli.train.session import checkpoint as ckpt

from ..fast_run import printed_command
from . import report
from .harness import FAST, check_finished_run, events, first_step_time_after, metrics, run_sdp, sdp_env, wait_for

pytestmark = pytest.mark.reliability


def test_a_second_ctrl_c_during_the_first_checkpoint_writes_the_aborted_event(tmp_path, sdp_cache):
    run_dir, steps = tmp_path / "run", 9
    # the run's first checkpoint (step 3, written by the step itself) stalls 10 s at checkpoint.policy
    env = sdp_env(sdp_cache, SDP_TEST_FAULTS="stall:checkpoint.policy@1", SDP_TEST_STALL_S="10")
    args = ["train", *FAST, f"run.dir={run_dir}", f"train.steps={steps}", "train.checkpoint_every=3"]
    proc = subprocess.Popen([sys.executable, "-m", "sdp_cli", *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    checkpoints = run_dir / "checkpoints"
    wait_for(lambda: checkpoints.is_dir() and any(p.name.startswith(".tmp-step-") for p in checkpoints.iterdir()),
             300, "the first checkpoint to start", proc)  # fmt: skip
    proc.send_signal(signal.SIGINT)
    # 1 s for the first to reach sdp's handler: two SIGINTs pending at once reach it once (Python
    # keeps one flag per signal), and the run would then only stop (test_signals.py says more)
    time.sleep(1.0)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    exited_at = time.time()
    assert proc.returncode == 130, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    last = [x for x in stderr.splitlines() if x.strip()][-1]
    assert last == f"aborted at step 3 (second SIGINT); resume with: sdp train resume={run_dir} (it starts over: no checkpoint yet)", last
    # before: the abort closed the logs first, so the event was lost
    event = events(run_dir)[-1]
    assert (event["event"], event["step"], event["signal"], event.get("resume_step")) == ("aborted", 3, "SIGINT", None), event
    assert ckpt.find_latest(RunDir(run_dir).checkpoints) is None
    assert not list(checkpoints.glob(".tmp-*"))
    done = run_sdp(["train", f"resume={run_dir}"], sdp_env(sdp_cache))
    assert done.returncode == 0, done.stderr[-3000:]
    verdict = check_finished_run(run_dir, steps)
    run_id = "stops: second SIGINT during the first checkpoint"
    report.run_result(run_id, survived=True, samples_lost=verdict.audit.samples_lost,
                      samples_duplicated=verdict.audit.samples_duplicated)  # fmt: skip
    back = first_step_time_after(run_dir, 0, exited_at)
    report.fault("signal", "second SIGINT during the first checkpoint", run_id, None if back is None else back - exited_at)


def _check_hangup_stop(run_dir, code: int, steps: int, exited_at: float, label: str, sdp_cache) -> None:
    """SIGHUP stops like SIGTERM: exit 129, an interrupted event and a checkpoint of its step;
    then a resume finishes the run."""
    assert code == 128 + signal.SIGHUP, (code, events(run_dir)[-3:])
    event = events(run_dir)[-1]
    assert event["event"] == "interrupted" and event["signal"] == "SIGHUP", event
    step = event["step"]
    assert ckpt.find_latest(RunDir(run_dir).checkpoints).name == f"step-{step:06d}"
    done = run_sdp(["train", f"resume={run_dir}"], sdp_env(sdp_cache))
    assert done.returncode == 0, done.stderr[-3000:]
    verdict = check_finished_run(run_dir, steps)
    report.run_result(label, survived=True, samples_lost=verdict.audit.samples_lost,
                      samples_duplicated=verdict.audit.samples_duplicated)  # fmt: skip
    back = first_step_time_after(run_dir, step, exited_at)
    report.fault("signal", label.removeprefix("stops: "), label, None if back is None else back - exited_at)


def test_sighup_stops_like_sigterm_and_a_second_one_is_ignored(tmp_path, sdp_cache):
    run_dir, steps = tmp_path / "run", 200
    env = sdp_env(sdp_cache, SDP_TEST_FAULTS="stall:checkpoint.policy@1")
    args = ["train", *FAST, f"run.dir={run_dir}", f"train.steps={steps}", "train.checkpoint_every=0"]
    proc = subprocess.Popen([sys.executable, "-m", "sdp_cli", *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    wait_for(lambda: len(metrics(run_dir)) >= 2, 300, "two steps", proc)
    proc.send_signal(signal.SIGHUP)
    # the stop's checkpoint stalls 3 s: a second SIGHUP meanwhile changes nothing (before: the
    # first one killed the run outright, with no checkpoint)
    checkpoints = run_dir / "checkpoints"
    wait_for(lambda: checkpoints.is_dir() and any(p.name.startswith(".tmp-step-") for p in checkpoints.iterdir()),
             60, "the stop's checkpoint", proc)  # fmt: skip
    proc.send_signal(signal.SIGHUP)
    _, stderr = proc.communicate(timeout=120)
    assert "Traceback" not in stderr, stderr[-3000:]
    last = [x for x in stderr.splitlines() if x.strip()][-1]
    assert last.startswith("stopped at step ") and last.endswith(f"(SIGHUP); resume with: sdp train resume={run_dir}"), last
    _check_hangup_stop(run_dir, proc.returncode, steps, time.time(), "stops: SIGHUP (kill), then a second one", sdp_cache)


def test_a_terminal_that_goes_away_stops_the_run_with_a_checkpoint(tmp_path, sdp_cache):
    """`sdp train` as the session leader on a pseudo-terminal, which is then closed: the kernel
    sends SIGHUP, and every later write to the terminal fails (EIO). The run must still stop at
    a step boundary, checkpoint and exit 129, although nobody can read its last line."""
    run_dir, steps = tmp_path / "run", 200
    master, slave = pty.openpty()
    args = ["train", *FAST, f"run.dir={run_dir}", f"train.steps={steps}", "train.checkpoint_every=0",
            "run.progress=true"]  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-m", "sdp_cli", *args], env=sdp_env(sdp_cache), stdin=slave,
                            stdout=slave, stderr=slave, start_new_session=True,
                            preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0))  # fmt: skip
    os.close(slave)
    hang_up = threading.Event()

    def show() -> None:  # a terminal reads what it is sent; a full one would block sdp
        while not hang_up.is_set():
            if select.select([master], [], [], 0.1)[0]:
                try:
                    os.read(master, 4096)
                except OSError:
                    return

    reader = threading.Thread(target=show, daemon=True)
    reader.start()
    try:
        wait_for(lambda: len(metrics(run_dir)) >= 2, 300, "two steps", proc)
    finally:
        hang_up.set()
        reader.join()
        os.close(master)  # the terminal goes away
    proc.wait(timeout=120)
    _check_hangup_stop(run_dir, proc.returncode, steps, time.time(), "stops: the terminal went away (SIGHUP)", sdp_cache)


def test_a_crash_says_how_to_resume_under_its_traceback(tmp_path, sdp_cache):
    """A bug (here an injected exception after step 3's metrics) ends the run with its traceback;
    a note under it says how to go on from the last complete checkpoint, and that command,
    pasted as it is, finishes the run."""
    run_dir, steps = tmp_path / "run", 6
    args = ["train", *FAST, f"run.dir={run_dir}", f"train.steps={steps}", "train.checkpoint_every=2"]
    crashed = run_sdp(args, sdp_env(sdp_cache, SDP_TEST_FAULTS="raise:run.metrics_written@3"))
    assert crashed.returncode == 1, crashed.stderr[-3000:]
    lines = [x for x in crashed.stderr.splitlines() if x.strip()]
    assert lines[-2].startswith("sdp_cli.faults.InjectedFault: fault injected at run.metrics_written"), lines[-3:]
    # before: nothing after the traceback
    assert lines[-1] == (f"sdp train stopped at step 3 on this error; resume with: sdp train resume={run_dir} "
                         "(from step 2, the last complete checkpoint)"), lines[-1]  # fmt: skip
    command = printed_command(lines[-1])
    done = run_sdp(command[1:], sdp_env(sdp_cache))
    assert done.returncode == 0, done.stderr[-3000:]
    check_finished_run(run_dir, steps)
