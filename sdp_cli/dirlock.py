"""One sdp process per run directory or sweep directory: an exclusive ``flock`` on ``DIR/.lock``.

The lock belongs to the open file, so the kernel releases it when the holder exits, however it
exits (``kill -9`` included): a crash never leaves a stale lock, and the file itself may stay.
The holder writes its PID into the file so that a refused process can name it
(docs/reliability.md, "One process per directory"). The file is never opened through a symbolic
link, nor when it is a FIFO or another special file (``fileio.open_fd_in_place``). Torch-free.
"""

from __future__ import annotations

import errno
import fcntl
import os
import time
from pathlib import Path

from sdp_cli.errors import UserError, WriteFailed, write_fix
from sdp_cli.fileio import open_fd_in_place

LOCK_NAME = ".lock"


class DirectoryLock:
    """An exclusive lock on a directory, held from :meth:`acquire` until :meth:`release` or exit."""

    #: locks this process holds until it ends (:meth:`keep`), by lock file
    _kept: dict[Path, DirectoryLock] = {}

    def __init__(self, path: Path, fd: int):
        self.path = path
        self._fd: int | None = fd
        self.pid = os.getpid()

    @classmethod
    def acquire(cls, directory: Path, what: str) -> DirectoryLock:
        """Lock ``directory`` (which must exist) or raise a one-line UserError naming the PID that
        holds it. ``what`` names the directory in the message ("run directory"). A lock this
        process kept (:meth:`keep`) on the same lock file is taken over."""
        path = Path(directory) / LOCK_NAME
        kept = cls._kept.pop(path.resolve(), None)
        if kept is not None:
            if kept._fd is not None and _same_file(kept._fd, path):
                return kept
            kept.release()  # the directory was replaced meanwhile
        try:
            fd = open_fd_in_place(path, os.O_RDWR | os.O_CREAT)
        except OSError as err:
            raise WriteFailed(f"{what} {directory}: cannot create its lock file ({err.strerror}); {write_fix(err)}", err, path) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            holder = _holder(fd)
            os.close(fd)
            if err.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise UserError(f"{what} {directory}: cannot lock it ({err.strerror})") from None
            raise UserError(
                f"{what} {directory} is in use by another sdp process (pid {holder}); "
                "wait for it to end or stop it, then try again"
            ) from None
        try:
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
        except OSError as err:  # a full disk: said here, before anything else is tried
            os.close(fd)
            raise WriteFailed(f"{what} {directory}: cannot write its lock file ({err.strerror}); {write_fix(err)}", err, path) from None
        return cls(path, fd)

    def release(self) -> None:
        """Give the lock up (closing the file releases it; the file stays)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def keep(self) -> None:
        """Hold the lock until this process ends, when the kernel releases it: a process that
        is about to exit keeps its directory until it is gone, teardown included. Should this
        process open the directory again meanwhile, :meth:`acquire` takes the kept lock over."""
        DirectoryLock._kept[self.path.resolve()] = self

    def __enter__(self) -> DirectoryLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except OSError:
        return False


def _holder(fd: int) -> str:
    """The PID the holder wrote, or "unknown" (it may be between locking and writing it)."""
    for _ in range(20):
        text = os.pread(fd, 32, 0).decode(errors="replace").strip()
        if text.isdigit():
            return text
        time.sleep(0.01)
    return "unknown"
