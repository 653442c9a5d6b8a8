"""Run a command with a small tmpfs mounted over a directory, in a mount namespace of its own
(``unshare``): a real full file system for the test, seen by no other process. Tests that need
one skip where this machine does not allow the namespace (no ``unshare``, no user namespaces)."""

from __future__ import annotations

import functools
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

import pytest

_MOUNT = 'mount -t tmpfs -o "size=$1" tmpfs "$2" && shift 2 && exec "$@"'


def _command(size: str, directory: Path, command: Sequence[str]) -> list[str]:
    return ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", _MOUNT, "sh", size, str(directory), *command]


@functools.cache
def available() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(_command("64k", Path("/tmp"), ["true"]), capture_output=True, timeout=30)
    return probe.returncode == 0


def run_with_tmpfs(size: str, directory: Path, command: Sequence[str], **kwargs) -> subprocess.CompletedProcess:
    """``command`` with a ``size`` tmpfs (e.g. ``"256k"``) mounted over ``directory``."""
    if not available():
        pytest.skip("needs a mount namespace (unshare) for a small tmpfs")
    return subprocess.run(_command(size, directory, command), capture_output=True, text=True, **kwargs)
