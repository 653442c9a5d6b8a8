"""The one-line descriptions of failed writes name the remedy for the cause, not one for all."""

import errno
import os

import pytest

from sdp_cli.errors import UserError, describe_os_error, no_room_behind, write_fix


#: each cause of a failed write and the remedy its line names (the lines that use them test
#: against this table too: tests/models/test_warm_start.py)
FIX_BY_CAUSE = [
    (errno.ENOSPC, "free space there"),
    (errno.EDQUOT, "free space within your disk quota"),
    (errno.EFBIG, "raise the file-size limit (ulimit -f)"),
    (errno.EROFS, "remount it read-write"),
    (errno.EACCES, "make it writable"),
    (errno.EPERM, "make it writable"),
    (errno.ENOENT, "check that its directory exists"),
    (errno.EIO, "check disk space and permissions"),
]


@pytest.mark.parametrize("code,fix", FIX_BY_CAUSE)
def test_write_fix_follows_the_cause(code, fix):
    assert write_fix(OSError(code, os.strerror(code))) == fix


def test_a_failed_write_names_file_cause_and_remedy():
    err = OSError(errno.EROFS, "Read-only file system", "/runs/a/metrics.jsonl")
    assert describe_os_error(err) == "cannot write /runs/a/metrics.jsonl: Read-only file system (remount it read-write)"
    # a cause without a known remedy is named alone, and an error without a file by its text
    assert describe_os_error(OSError(errno.EIO, "Input/output error", "/x")) == "cannot write /x: Input/output error"
    assert describe_os_error(OSError("odd")) == "odd"


def _raised(make):
    try:
        make()
    except Exception as err:  # noqa: BLE001 - the test inspects what was raised
        return err
    raise AssertionError("nothing raised")


def test_no_room_behind_finds_the_failed_write_under_a_users_error():
    full = OSError(errno.ENOSPC, "No space left on device", "/runs/a/x")

    def from_none():
        try:
            raise full
        except OSError:
            raise UserError("cannot write the warm-start cache entry E") from None

    def with_cause():
        raise UserError("training stopped at step 3") from full

    assert no_room_behind(_raised(from_none)) is full  # a line raised "from None" still has its context
    assert no_room_behind(_raised(with_cause)) is full
    assert no_room_behind(OSError(errno.EROFS, "Read-only file system")).errno == errno.EROFS
    # a cause a later write elsewhere would not meet: a missing file, a permission, a bad value
    assert no_room_behind(OSError(errno.ENOENT, "No such file or directory")) is None
    assert no_room_behind(_raised(lambda: _raise_chained(OSError(errno.EACCES, "Permission denied")))) is None
    assert no_room_behind(UserError("task.path: no such file")) is None
    looped = UserError("a")
    looped.__context__ = UserError("b")
    looped.__context__.__context__ = looped
    assert no_room_behind(looped) is None


def _raise_chained(cause):
    raise UserError("cannot write") from cause
