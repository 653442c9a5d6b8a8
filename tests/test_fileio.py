"""Atomic writes: whole files or nothing, normal permissions, one-line errors."""

import os
import stat

import pytest

from sdp_cli import fileio
from sdp_cli.errors import UserError


def _mode(path):
    return stat.S_IMODE(path.stat().st_mode)


def test_new_file_gets_normal_permissions_not_owner_only(tmp_path):
    path = fileio.atomic_write_bytes(tmp_path / "a.bin", b"abc")
    assert path.read_bytes() == b"abc"
    assert _mode(path) == fileio.default_file_mode()
    assert _mode(path) & 0o044  # readable by group/others under the usual 022 umask


def test_replaced_file_keeps_its_mode(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text("old")
    os.chmod(path, 0o640)
    fileio.atomic_write_text(path, "new")
    assert path.read_text() == "new" and _mode(path) == 0o640


def test_failed_write_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "a.txt"
    path.write_text("old")

    def boom(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", boom)
    with pytest.raises(UserError, match="cannot be written") as info:
        fileio.atomic_write_text(path, "new")
    assert "\n" not in str(info.value)
    assert path.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt"]


def test_missing_directory_is_a_one_line_error(tmp_path):
    with pytest.raises(UserError, match="cannot create a file in"):
        fileio.atomic_write_bytes(tmp_path / "nope" / "a.bin", b"x")


def test_stage_then_replace(tmp_path):
    target = tmp_path / "t.bin"
    tmp = fileio.stage_bytes(target, b"staged")
    assert not target.exists() and tmp.read_bytes() == b"staged" and tmp.parent == tmp_path
    os.replace(tmp, target)
    assert target.read_bytes() == b"staged"
