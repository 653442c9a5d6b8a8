"""Faults of the local engine's own process and of the rollout process (docs/reliability.md
"Engine faults", docs/training.md "Three processes"): `sdp train` with `engine.in_process=false`
in a subprocess, its engine process killed -9 mid-run, its rollout process killed -9 mid-run,
sdp stopped by SIGINT/SIGTERM and killed -9 with both running.

A killed engine process is survived like a server fault: sdp starts it again on the same port,
gives it the current weights and resubmits the samples it held, so every run reaches its target
with nothing lost or duplicated (ledger audit), and every token's behaviour logprob is its
logprob under the weights of the version it is tagged with. A stop of sdp, by signal or kill,
leaves no engine process, no rollout process and no scratch directory behind. A killed
rollout process ends the run at a step boundary in one line, and the resume goes on with
nothing lost or duplicated.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from . import report
from .harness import (
    FAST,
    check_finished_run,
    events,
    first_step_time_after,
    gone,
    metrics,
    run_sdp,
    sdp_env,
    versioned_segment_wise,
    wait_for,
    whole_lines,
)
from .test_engine_faults_vllm import assert_tokens_carry_their_version
from .test_signals import check_interrupted

pytestmark = pytest.mark.reliability

LOG = Path("logs") / "local_engine.log"


def _args(run_dir: Path, steps: int, *extra: str) -> list[str]:
    return [
        *FAST,
        "engine.in_process=false",
        "rollout.max_head_offpolicyness=2",
        *versioned_segment_wise(run_dir, steps, *extra),
    ]


def engine_pids(run_dir: Path) -> list[int]:
    """The engine processes the run started, in order (each writes its pid when it serves)."""
    return [int(p) for p in re.findall(r"sdp local engine: pid (\d+)", whole_lines(run_dir / LOG))]


def rollout_pids(run_dir: Path) -> list[int]:
    """The rollout processes the run started, in order (each writes its pid once it serves)."""
    text = whole_lines(run_dir / "logs" / "rollout.log")
    return [int(p) for p in re.findall(r"sdp rollout process: pid (\d+)", text)]


def rollout_scratches(run_dir: Path) -> list[tuple[int, Path]]:
    """(pid, scratch directory) of each rollout process the run started (each says at its start)."""
    text = whole_lines(run_dir / "logs" / "rollout.log")
    return [(int(pid), Path(p)) for pid, p in re.findall(r"sdp rollout process (\d+): the engine's scratch directory is (\S+)", text)]


def scratches(run_dir: Path) -> list[Path]:
    """The scratch directories the run's engine processes were started with, in order."""
    return [Path(p) for p in re.findall(r"sdp local engine: pid \d+, .*, scratch (\S+)", whole_lines(run_dir / LOG))]


def _finished(run_dir: Path, steps: int, run_id: str, *outputs: str):
    verdict = check_finished_run(run_dir, steps)
    assert assert_tokens_carry_their_version(run_dir) > 0
    report.run_result(run_id, survived=True, samples_lost=verdict.audit.samples_lost,
                      samples_duplicated=verdict.audit.samples_duplicated)  # fmt: skip
    return verdict


def test_engine_process_killed_three_times_mid_run(tmp_path, sdp_cache):
    steps = 14
    run_dir = tmp_path / "run"
    log = tmp_path / "sdp.log"
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "sdp_cli", "train", *_args(run_dir, steps)],
            env=sdp_env(sdp_cache), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )  # fmt: skip
    kills: list[tuple[int, float]] = []  # (step reached before the kill, when)
    try:
        for n, after_step in enumerate((2, 6, 10), start=1):
            wait_for(lambda: len(metrics(run_dir)) >= after_step and len(engine_pids(run_dir)) == n, 600,
                     f"step {after_step} on engine process {n}", proc)  # fmt: skip
            pid = engine_pids(run_dir)[-1]
            os.kill(pid, signal.SIGKILL)
            kills.append((len(metrics(run_dir)), time.time()))
        assert proc.wait(timeout=900) == 0, log.read_text()[-4000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    run_id = "local engine process killed -9 three times"
    _finished(run_dir, steps, run_id, log.read_text())
    assert len(engine_pids(run_dir)) == 4, "each kill was followed by one restart"
    last = metrics(run_dir)[-1]
    assert last["engine/restores"] >= 3, "every restarted process got the current weights again"
    for step, killed_at in kills:
        back = first_step_time_after(run_dir, step, killed_at)
        report.fault("engine", "local engine process killed -9 mid-run", run_id, back - killed_at)
    assert all(gone(pid) for pid in engine_pids(run_dir))


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_stop_signal_stops_the_engine_process_too(signum, tmp_path, sdp_cache):
    steps = 30
    run_dir = tmp_path / "run"
    env = sdp_env(sdp_cache)
    proc = subprocess.Popen(
        [sys.executable, "-m", "sdp_cli", "train", *_args(run_dir, steps)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    wait_for(lambda: len(metrics(run_dir)) >= 2, 600, "step 2", proc)
    (pid,) = engine_pids(run_dir)
    (scratch,) = scratches(run_dir)
    assert scratch.is_dir()
    proc.send_signal(signum)
    _, stderr = proc.communicate(timeout=300)
    stopped_at = time.time()
    step = check_interrupted(run_dir, signum, proc.returncode, stderr, updates_per_step=1)
    assert gone(pid) and not scratch.exists(), "sdp's end stops its engine process and removes its files"
    assert all(gone(p) for p in rollout_pids(run_dir)), "and its rollout process"
    done = run_sdp(["train", f"resume={run_dir}"], env, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    run_id = f"{signal.Signals(signum).name}, local engine process"
    _finished(run_dir, steps, run_id, done.stdout, done.stderr)
    back = first_step_time_after(run_dir, step, stopped_at)
    report.fault("signal", f"{signal.Signals(signum).name} with the local engine's process", run_id, back - stopped_at)


@pytest.mark.parametrize(
    "closing_stall",
    [None, "local.process_stopped"],
    ids=["rollout process idle", "rollout process closing its engine"],
)
def test_kill_9_of_sdp_leaves_no_engine_process(closing_stall, tmp_path, sdp_cache):
    """The rollout process and the engine process notice that sdp has gone (they are
    re-parented), remove the scratch directory sdp cannot remove any more and exit; the resumed
    run starts new ones. ``closing_stall``: the rollout process, which begins to close its engine
    as soon as sdp's end of the link closes, is held where its engine's process is stopped and
    the scratch directory not yet removed, so that it notices sdp's death right there (its close
    was cut off there on a loaded CI machine and left the directory behind)."""
    steps = 8
    run_dir = tmp_path / "run"
    faults = "kill:run.metrics_written@4" + (f",stall:{closing_stall}" if closing_stall else "")
    env = sdp_env(sdp_cache, SDP_TEST_FAULTS=faults)
    done = run_sdp(["train", *_args(run_dir, steps)], env, timeout=600)
    killed_at = time.time()
    assert done.returncode == -signal.SIGKILL, done.stderr[-3000:]
    (pid,) = engine_pids(run_dir)
    (scratch,) = scratches(run_dir)
    (rollout,) = rollout_pids(run_dir)
    wait_for(lambda: gone(rollout) and gone(pid) and not scratch.exists(), 10,
             "the orphaned rollout and engine processes to clean up and exit")  # fmt: skip
    done = run_sdp(["train", f"resume={run_dir}"], sdp_env(sdp_cache), timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    where = "while its rollout process closes the engine" if closing_stall else "with its engine process"
    run_id = f"kill -9 of sdp {where}"
    _finished(run_dir, steps, run_id, done.stdout, done.stderr)
    back = first_step_time_after(run_dir, 0, killed_at)
    report.fault("kill -9", f"sdp {where}", run_id, back - killed_at)


def test_kill_9_of_sdp_while_it_writes_the_start_weights_leaves_nothing(tmp_path, sdp_cache):
    """sdp killed once it has written the engine's start weights, before the rollout process
    has its recipe: the scratch directory holding them is the rollout process's, which removes
    it and exits, and the engine's process it started ahead (never handed its launch) leaves
    too. Both were started before the run directory existed; their first lines are in its log.
    (The run has no checkpoint yet: sdp says to start it again.)"""
    run_dir = tmp_path / "run"
    env = sdp_env(sdp_cache, SDP_TEST_FAULTS="kill:local.start_weights_written")
    done = run_sdp(["train", *_args(run_dir, 4)], env, timeout=600)
    assert done.returncode == -signal.SIGKILL, done.stderr[-3000:]
    ((rollout, scratch),) = rollout_scratches(run_dir)
    (ahead,) = map(int, re.findall(r"the engine's process (\d+) started ahead", whole_lines(run_dir / "logs" / "rollout.log")))
    wait_for(lambda: gone(rollout) and gone(ahead) and not scratch.exists(), 10,
             "the rollout process and the engine's process to remove the start weights and exit")  # fmt: skip
    assert not engine_pids(run_dir), "no engine's process served"


def test_a_killed_rollout_process_stops_the_run_at_a_step_and_the_resume_goes_on(tmp_path, sdp_cache):
    """kill -9 of the rollout process mid-run: sdp stops at its step boundary with one line that
    names the rollout process and its log (exit code 2, a ``stopped`` event), the engine's process
    and its scratch directory go with it, and the resume reaches the target from the last
    checkpoint with nothing lost or duplicated."""
    steps = 30
    run_dir = tmp_path / "run"
    env = sdp_env(sdp_cache)
    proc = subprocess.Popen(
        [sys.executable, "-m", "sdp_cli", "train", *_args(run_dir, steps, "train.checkpoint_every=4")],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    wait_for(lambda: len(metrics(run_dir)) >= 6, 600, "step 6", proc)
    (rollout,) = rollout_pids(run_dir)
    (engine,) = engine_pids(run_dir)
    (scratch,) = scratches(run_dir)
    os.kill(rollout, signal.SIGKILL)
    killed_at = time.time()
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 2, stderr[-3000:]
    line = stderr.strip().splitlines()[-1]
    assert re.fullmatch(
        r"error: training stopped at step (\d+): the rollout process stopped answering: it was killed by SIGKILL; "
        rf"see {re.escape(str(run_dir))}/logs/rollout\.log \(last line: .*\); .*resume with: sdp train "
        rf"resume={re.escape(str(run_dir))}.*",
        line,
    ), line
    assert events(run_dir)[-1]["event"] == "stopped"
    wait_for(lambda: gone(engine) and not scratch.exists(), 10, "the engine process to leave with the rollout process")
    done = run_sdp(["train", f"resume={run_dir}"], env, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    run_id = "rollout process killed -9"
    _finished(run_dir, steps, run_id, done.stdout, done.stderr)
    assert all(gone(p) for p in rollout_pids(run_dir))
    back = first_step_time_after(run_dir, 0, killed_at)
    report.fault("kill -9", "the rollout process, mid-run", run_id, back - killed_at)
