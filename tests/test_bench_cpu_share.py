"""bench/cpu_share.py: the CPU ticks it reads, how it finds a run's rollout and engine processes, and
a run end to end on the fast config."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from .bench_scripts import load_bench, run_bench


@pytest.fixture(scope="module")
def bench():
    return load_bench("cpu_share.py")


def test_cpu_ticks_count_this_process_s_work_and_none_once_a_process_is_gone(bench):
    before = bench.cpu_ticks(os.getpid())
    end = time.process_time() + 0.3
    while time.process_time() < end:
        pass
    after = bench.cpu_ticks(os.getpid())
    assert after[0] + after[1] - before[0] - before[1] >= 0.2 * bench.TICKS
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    assert bench.cpu_ticks(gone.pid) is None


def test_the_rollout_and_engine_processes_are_found_below_the_run_only(bench):
    # a stand-in run: its child has the rollout process's module as an argument and starts a
    # grandchild with the engine's (as `python -m <module>` has them); the child's own source names
    # the engine's module too, as text, which does not make it the engine; a process outside the
    # run with one of them is left out
    sleep = "import time; time.sleep(60)"
    child = (
        "import subprocess, sys, time; "
        f"subprocess.Popen([sys.executable, '-c', {sleep!r}, {bench.ROLES['engine']!r}]); time.sleep(60)"
    )
    parent = (
        "import subprocess, sys, time; "
        f"subprocess.Popen([sys.executable, '-c', {child!r}, {bench.ROLES['rollout']!r}]); time.sleep(60)"
    )
    run = subprocess.Popen([sys.executable, "-c", parent], start_new_session=True)
    outsider = subprocess.Popen([sys.executable, "-c", sleep, bench.ROLES["engine"]])
    try:
        deadline = time.monotonic() + 30
        found = {}
        while len(found) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
            found = bench.descendants(run.pid)
        assert set(found) == {"rollout", "engine"}
        assert found["engine"] != outsider.pid and found["rollout"] != found["engine"]
        assert bench.descendants(outsider.pid) == {}
    finally:
        os.killpg(run.pid, 9)
        outsider.kill()
        run.wait()
        outsider.wait()


def test_end_to_end_on_the_fast_config(tmp_path):
    out = tmp_path / "cpu.json"
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    done = run_bench(
        "cpu_share.py", "--modes", "decoupled", "--eta", "1", "--steps", "400", "--skip", "0", "--window", "1",
        "--repeats", "1", "--set", "+debug=fast", "--out", str(out), "--keep-runs", timeout=600,
        env={"TMPDIR": str(scratch)},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    (kept,) = scratch.glob("sdp-bench-*")  # --keep-runs: kept, and named
    assert f"cpu: the runs are kept in {kept}" in done.stderr and (kept / "cache").is_dir()
    (row,) = json.loads(out.read_text())["rows"]
    assert row["mode"] == "decoupled" and row["steps_per_second"] > 0
    # every process ran in the window, none past the cores it may use
    assert set(row["cpu_percent"]) == {"trainer", "rollout", "engine"}
    assert all(0 < share <= 100 * os.cpu_count() for share in row["cpu_percent"].values())
    assert "decoupled" in done.stdout and "wrote" in done.stdout


def test_eta_0_is_refused_in_one_line(tmp_path):
    done = run_bench("cpu_share.py", "--eta", "0", "--out", str(tmp_path / "x.json"), timeout=120)
    assert done.returncode == 2 and "--eta must be at least 1" in done.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "x.json").exists()
