"""A run directory's lock that `sdp train` keeps until its process has ended (issue 24 item 16):
no other process gets it meanwhile, and only the process's end releases it."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from sdp_cli.dirlock import DirectoryLock

pytestmark = pytest.mark.reliability

PROBE = (
    "import sys; from pathlib import Path; from sdp_cli.dirlock import DirectoryLock\n"
    "from sdp_cli.errors import UserError\n"
    "try:\n    DirectoryLock.acquire(Path(sys.argv[1]), 'run directory').release()\n"
    "except UserError:\n    sys.exit(3)\n"
)


def _free_for_another_process(directory) -> bool:
    return subprocess.run([sys.executable, "-c", PROBE, str(directory)], timeout=60).returncode == 0


def test_a_kept_lock_is_held_until_the_process_ends(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from pathlib import Path; from sdp_cli.dirlock import DirectoryLock\n"
         "DirectoryLock.acquire(Path(sys.argv[1]), 'run directory').keep()\nprint('kept', flush=True)\n"
         "time.sleep(float(sys.argv[2]))", str(tmp_path), "3"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert holder.stdout.readline() == "kept\n"
    assert not _free_for_another_process(tmp_path)  # kept, not released
    holder.wait(timeout=60)
    assert _free_for_another_process(tmp_path)  # the process ended: the kernel released it


def test_the_keeping_process_may_take_its_directory_again(tmp_path):
    kept = DirectoryLock.acquire(tmp_path, "run directory")
    kept.keep()
    again = DirectoryLock.acquire(tmp_path, "run directory")  # this process: the kept lock itself
    assert again is kept
    assert not _free_for_another_process(tmp_path)
    again.release()
    assert _free_for_another_process(tmp_path)


def test_a_kept_lock_of_a_replaced_directory_is_not_taken_over(tmp_path):
    directory = tmp_path / "run"
    directory.mkdir()
    kept = DirectoryLock.acquire(directory, "run directory")
    kept.keep()
    shutil.rmtree(directory)
    directory.mkdir()
    fresh = DirectoryLock.acquire(directory, "run directory")
    try:
        assert fresh is not kept and kept._fd is None  # the old lock was given up
    finally:
        fresh.release()
