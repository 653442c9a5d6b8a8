"""What sdp's own processes share (torch-free): the ``PYTHONPATH`` that makes a child it starts
(the rollout process, the local engine's process) run this sdp_cli whatever the environment's
path says, and which cores a process's threads run on (``pin_process``; where sdp places them:
``sdp_cli/train/session/placement.py``)."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

import sdp_cli


def sdp_pythonpath() -> str:
    """``PYTHONPATH`` for a child process of sdp's: this sdp_cli's root first, then the path as
    it is."""
    package_root = str(Path(sdp_cli.__file__).resolve().parent.parent)
    return os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))


def pin_process(cores: Iterable[int]) -> None:
    """Run every thread of this process on ``cores`` (threads it starts later inherit them from
    the thread that starts them). A thread that ended meanwhile is skipped."""
    cores = set(cores)
    for task in Path("/proc/self/task").iterdir():
        try:
            os.sched_setaffinity(int(task.name), cores)
        except (ProcessLookupError, FileNotFoundError):
            pass
