"""The one-line descriptions of failed writes name the remedy for the cause, not one for all."""

import errno
import os

import pytest

from sdp_cli.errors import describe_os_error, write_fix


@pytest.mark.parametrize(
    "code,fix",
    [
        (errno.ENOSPC, "free space there"),
        (errno.EDQUOT, "free space within your disk quota"),
        (errno.EFBIG, "raise the file-size limit (ulimit -f)"),
        (errno.EROFS, "remount it read-write"),
        (errno.EACCES, "make it writable"),
        (errno.EPERM, "make it writable"),
        (errno.ENOENT, "check that its directory exists"),
        (errno.EIO, "check disk space and permissions"),
    ],
)
def test_write_fix_follows_the_cause(code, fix):
    assert write_fix(OSError(code, os.strerror(code))) == fix


def test_a_failed_write_names_file_cause_and_remedy():
    err = OSError(errno.EROFS, "Read-only file system", "/runs/a/metrics.jsonl")
    assert describe_os_error(err) == "cannot write /runs/a/metrics.jsonl: Read-only file system (remount it read-write)"
    # a cause without a known remedy is named alone, and an error without a file by its text
    assert describe_os_error(OSError(errno.EIO, "Input/output error", "/x")) == "cannot write /x: Input/output error"
    assert describe_os_error(OSError("odd")) == "odd"
