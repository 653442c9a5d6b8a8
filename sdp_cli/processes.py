"""What sdp's own processes share (torch-free): the ``PYTHONPATH`` that makes a child it starts
(the rollout process, the local engine's process) run this sdp_cli whatever the environment's
path says, where the local engine's weight files go (``make_scratch``), and which cores a
process's threads run on (``pin_process``; where sdp places them:
``sdp_cli/train/session/placement.py``)."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable
from pathlib import Path

import sdp_cli
from sdp_cli.errors import UserError

#: scratch directories live here when it is a writable tmpfs (files in memory, no disk writes)
SHM = Path("/dev/shm")
#: where they live instead when set (a /dev/shm too small for the weights, a faster disk)
SCRATCH_ENV = "SDP_SCRATCH_DIR"


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


def scratch_root() -> Path:
    """Where weight files go: ``$SDP_SCRATCH_DIR`` when set, else ``/dev/shm`` when it is a
    writable directory, else the temp dir."""
    chosen = os.environ.get(SCRATCH_ENV)
    if chosen:
        root = Path(chosen).expanduser()
        if not root.is_dir() or not os.access(root, os.W_OK):
            raise UserError(
                f"{SCRATCH_ENV}={chosen} is not a writable directory; point it at one (the local "
                "engine's weight files go there) or unset it"
            )
        return root
    return SHM if SHM.is_dir() and os.access(SHM, os.W_OK) else Path(tempfile.gettempdir())


def make_scratch() -> Path:
    """A new, empty scratch directory for an engine's process (under ``scratch_root``)."""
    return Path(tempfile.mkdtemp(prefix="sdp-engine-", dir=scratch_root()))
