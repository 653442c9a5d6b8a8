"""One process per run directory (and per sweep directory): an exclusive OS lock.

Two ``sdp train resume=R`` started together used to both run, interleaving metrics and ledger
(97 metric rows for 60 steps). The lock is ``flock`` on ``<run>/.lock``: the kernel releases it
when the holder exits, however it exits (kill -9 included), so a crash never leaves a stale lock.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from sdp_cli.dirlock import DirectoryLock
from sdp_cli.errors import UserError

from .harness import (
    FAST,
    check_finished_run,
    complete_checkpoint_steps,
    error_line,
    metrics,
    run_sdp,
    sdp_env,
    start_sdp,
    wait_for,
)

pytestmark = pytest.mark.reliability


def test_a_second_process_on_a_run_directory_is_refused_naming_the_holder(tmp_path, sdp_cache):
    run_dir = tmp_path / "run"
    steps = 400  # long enough to still be running while the others try
    args = [*FAST, f"run.dir={run_dir}", f"train.steps={steps}", "train.checkpoint_every=1"]
    first = start_sdp(["train", *args], sdp_env(sdp_cache), tmp_path / "first.log")
    try:
        wait_for(lambda: complete_checkpoint_steps(run_dir), 120, "a first checkpoint", first)
        # a resume while the run trains, and a new run on the same directory
        for argv in (["train", f"resume={run_dir}"], ["train", *args]):
            rows = len(metrics(run_dir))
            done = run_sdp(argv, sdp_env(sdp_cache), timeout=120)
            assert done.returncode == 2, (argv, done.returncode, done.stderr[-2000:])
            line = error_line(done.stderr)
            assert f"pid {first.pid}" in line, line
            assert first.poll() is None, "the first process must not be disturbed"
            # the refused process wrote nothing: the rows are the first process's alone
            assert all(r["step"] == i + 1 for i, r in enumerate(metrics(run_dir))) and len(metrics(run_dir)) >= rows
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    # kill -9 left the lock file, but the kernel released the lock: a resume runs
    done = run_sdp(["train", f"resume={run_dir}", "train.steps=" + str(max(complete_checkpoint_steps(run_dir)) + 3)],
                   sdp_env(sdp_cache), timeout=240)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]


def test_two_resumes_started_together_one_trains_the_other_is_refused(tmp_path, sdp_cache):
    run_dir = tmp_path / "run"
    steps = 60
    done = run_sdp(["train", *FAST, f"run.dir={run_dir}", "train.steps=2"], sdp_env(sdp_cache))
    assert done.returncode == 0, done.stderr[-3000:]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "sdp_cli", "train", f"resume={run_dir}", f"train.steps={steps}"],
            env=sdp_env(sdp_cache),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    outcomes = [(p.wait(timeout=300), p.stderr.read()) for p in procs]
    codes = sorted(code for code, _ in outcomes)
    assert codes == [0, 2], outcomes
    refused = next(err for code, err in outcomes if code == 2)
    assert "in use by another sdp process" in error_line(refused)
    check_finished_run(run_dir, steps)
    assert len([r for r in metrics(run_dir) if "version" in r]) == steps


def test_the_lock_is_exclusive_names_its_holder_and_is_released(tmp_path):
    held = DirectoryLock.acquire(tmp_path, "run directory")
    # another process cannot take it (flock locks belong to the open file, so a second open
    # in this process would conflict too; a subprocess shows what another sdp sees)
    probe = (
        "import sys; from pathlib import Path; from sdp_cli.dirlock import DirectoryLock\n"
        "from sdp_cli.errors import UserError\n"
        "try:\n    DirectoryLock.acquire(Path(sys.argv[1]), 'run directory')\n"
        "except UserError as e:\n    print(e); sys.exit(3)\n"
    )
    done = subprocess.run([sys.executable, "-c", probe, str(tmp_path)], capture_output=True, text=True)
    assert done.returncode == 3 and f"pid {held.pid}" in done.stdout, done
    with pytest.raises(UserError, match="in use by another sdp process"):
        DirectoryLock.acquire(tmp_path, "run directory")
    held.release()
    again = DirectoryLock.acquire(tmp_path, "run directory")
    again.release()


def test_an_ablate_sweep_directory_is_locked(tmp_path, sdp_cache):
    sweep_dir = tmp_path / "sweep"
    sweep_dir.mkdir()
    held = DirectoryLock.acquire(sweep_dir, "sweep directory")
    try:
        started = time.monotonic()
        done = run_sdp(["ablate", "smoke", "--dir", str(sweep_dir)], sdp_env(sdp_cache), timeout=120)
        assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
        line = error_line(done.stderr)
        assert "sweep directory" in line and f"pid {held.pid}" in line, line
        assert time.monotonic() - started < 100
        assert not (sweep_dir / "runs").exists() and not (sweep_dir / "ablate.json").exists()
    finally:
        held.release()
