"""Errors a user can cause and fix. The CLI prints them as one line and exits with code 2."""

import errno


class UserError(Exception):
    """Bad input (file, config value, CLI argument, unreachable server).

    The message must name the problem and the fix in one line, e.g.
    ``"batch.safetensors: cu_seqlens is not increasing at index 3; re-create the file with sdp train save_batches=true"``.
    """

    exit_code = 2

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))


class EngineError(UserError, RuntimeError):
    """An engine failed in a way the user can act on; the message says how (one line).

    Part of the engine contract (``sdp_cli.engine.base``); defined here, with the other errors,
    so that code the engines depend on (rollout records, the recompute pass, fault injection)
    can raise it without depending on the engine package."""


class EngineUnavailable(EngineError):
    """The engine (or its server) cannot be reached."""


class UserCodeError(UserError):
    """Your code (a reward function, a correction mode) raised or returned something unusable:
    one line naming it, and ``details``, its traceback, which a run keeps in its ``stopped``
    event (the line says where; the traceback says how)."""

    def __init__(self, message: str, details: str = ""):
        super().__init__(message)
        self.details = details


class WriteFailed(UserError, OSError):
    """A write that failed, said in one line (a UserError, as a command prints it) and still the
    OSError it was (``errno``, ``strerror``, ``filename``): code that ends cleanly on a failed
    write, a training session stopping at its step with a checkpoint and a resume line, treats it
    as one. A helper that turned the OSError into a plain UserError hid it from that handling."""

    def __init__(self, message: str, cause: OSError, path: object = None):
        UserError.__init__(self, message)
        self.errno, self.strerror = cause.errno, cause.strerror or str(cause)
        self.filename = cause.filename or (None if path is None else str(path))

    def __str__(self) -> str:
        return str(self.args[0])


class Interrupted(Exception):
    """A run stopped on a signal (SIGINT, SIGTERM). Not an error: the CLI prints the message as
    it is (``stopped at step N (SIGINT); resume with: ...``) and exits with ``exit_code``
    (128 + the signal number)."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(" ".join(str(message).split()))
        self.exit_code = exit_code


#: what to do about a write that failed, by its cause
_WRITE_FIXES = {
    errno.ENOSPC: "free space there",
    errno.EDQUOT: "free space within your disk quota",
    errno.EFBIG: "raise the file-size limit (ulimit -f)",
    errno.EROFS: "remount it read-write",
    errno.EACCES: "make it writable",
    errno.EPERM: "make it writable",
    errno.ENOENT: "check that its directory exists",
}


def write_fix(err: OSError) -> str:
    """The remedy for a failed write: ``free space there`` for a full disk, ``make it writable``
    for a permission error; a hint at both when the cause is neither."""
    return _WRITE_FIXES.get(err.errno or 0, "check disk space and permissions")


#: causes of a failed write that every later write to the same place meets too
_NO_ROOM = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS})


def no_room_behind(err: BaseException) -> OSError | None:
    """The failed write behind ``err`` (itself, its cause, or the error it was raised while
    handling) when it failed for want of room (a full disk, a quota, the file-size limit) or on
    a read-only file system; None for any other error."""
    seen: set[int] = set()
    found: BaseException | None = err
    while found is not None and id(found) not in seen:
        if isinstance(found, OSError) and found.errno in _NO_ROOM:
            return found
        seen.add(id(found))
        found = found.__cause__ or found.__context__
    return None


def describe_os_error(err: OSError) -> str:
    """One line for a failed file operation and its remedy:
    ``cannot write <file>: No space left on device (free space there)``."""
    what = err.strerror or str(err)
    fix = _WRITE_FIXES.get(err.errno or 0)
    if fix:
        what = f"{what} ({fix})"
    return f"cannot write {err.filename}: {what}" if err.filename else what


def describe_exception(err: BaseException) -> str:
    """One line naming an exception by its type: ``ValueError: bad``, ``SystemExit: 3``, and a
    bare ``KeyboardInterrupt`` (whose message alone would say nothing)."""
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text}" if text else type(err).__name__
