"""Atomic writes: whole files or nothing, normal permissions, one-line errors; command outputs
planned, checked and written all or none; strict JSON."""

import json
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
    # the OS's reason and what to do, not Python's "[Errno 28] ..." text
    assert str(info.value).startswith(f"{path}: cannot be written (No space left on device); ")
    assert "\n" not in str(info.value) and "Errno" not in str(info.value)
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


# ---------------------------------------------------------------------------- OutputPlan
def test_a_plan_writes_every_output_and_leaves_no_temporary(tmp_path):
    plan = fileio.OutputPlan(make_dirs=True)
    a = plan.add(tmp_path / "a.png", "--plot")
    b = plan.add(tmp_path / "new" / "dir" / "b.bin", "-o")
    assert not (tmp_path / "new").exists()  # nothing is created before commit
    assert plan.commit({a: b"A", b: b"B"}) == [tmp_path / "a.png", tmp_path / "new" / "dir" / "b.bin"]
    assert (tmp_path / "a.png").read_bytes() == b"A" and (tmp_path / "new" / "dir" / "b.bin").read_bytes() == b"B"
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["a.png", "b.bin", "dir", "new"]


def test_a_failed_commit_removes_new_files_and_directories_and_restores_old_ones(tmp_path, monkeypatch):
    old = tmp_path / "old.bin"
    old.write_bytes(b"old")
    plan = fileio.OutputPlan(force=True, make_dirs=True)
    outs = [plan.add(old, "-o"), plan.add(tmp_path / "d" / "new.bin", "-o"), plan.add(tmp_path / "last.bin", "-o")]
    real = os.replace
    calls = []

    def third_fails(src, dst, **kwargs):
        calls.append(dst)
        if len(calls) == 3:
            raise OSError(5, "Input/output error")
        return real(src, dst, **kwargs)

    monkeypatch.setattr(os, "replace", third_fails)
    with pytest.raises(UserError, match="last.bin: cannot be written \\(Input/output error\\); nothing was written"):
        plan.commit(dict(zip(outs, [b"1", b"2", b"3"])))
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["old.bin"] and old.read_bytes() == b"old"


def test_without_hard_links_the_backup_is_a_copy(tmp_path, monkeypatch):
    old = tmp_path / "old.bin"
    old.write_bytes(b"old")
    monkeypatch.setattr(os, "link", lambda *a, **k: (_ for _ in ()).throw(OSError(1, "Operation not permitted")))
    plan = fileio.OutputPlan(force=True)
    a, b = plan.add(old, "-o"), plan.add(tmp_path / "b.bin", "-o")
    real = os.replace
    monkeypatch.setattr(os, "replace", lambda src, dst: real(src, dst) if dst != b.target else (_ for _ in ()).throw(OSError(28, "No space left on device")))
    with pytest.raises(UserError, match="nothing was written"):
        plan.commit({a: b"new", b: b"b"})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old.bin"] and old.read_bytes() == b"old"


def test_a_target_that_changes_after_it_was_checked_is_refused_at_commit(tmp_path):
    plan = fileio.OutputPlan()
    out = plan.add(tmp_path / "x", "--plot")
    os.mkfifo(tmp_path / "x")  # another process made it a FIFO meanwhile
    with pytest.raises(UserError, match="x: is a FIFO, not a regular file"):
        plan.commit({out: b"png"})
    assert stat.S_ISFIFO((tmp_path / "x").lstat().st_mode)


def test_writing_through_a_symlink_updates_the_file_it_points_to(tmp_path):
    real = tmp_path / "real.png"
    real.write_bytes(b"old")
    (tmp_path / "link.png").symlink_to(real)
    plan = fileio.OutputPlan(force=True)
    out = plan.add(tmp_path / "link.png", "--plot")
    plan.commit({out: b"new"})
    assert (tmp_path / "link.png").is_symlink() and real.read_bytes() == b"new"


@pytest.mark.parametrize(
    "setup, fragment",
    [
        (lambda t: t / "missing" / "x", "directory {t}/missing does not exist; create it first"),
        (lambda t: (t / "f").write_text("") and None or t / "f" / "x", "{t}/f is not a directory"),
        (lambda t: t, "is a directory, not a regular file"),
        (lambda t: t / ("n" * 256), "file name is 256 bytes, longer than the 255"),
    ],
)
def test_bad_targets_are_one_line(tmp_path, setup, fragment):
    with pytest.raises(UserError) as err:
        fileio.OutputPlan().add(setup(tmp_path), "--plot")
    assert fragment.format(t=tmp_path) in str(err.value) and "\n" not in str(err.value)


def test_json_document_is_strict_json_with_null_for_non_finite_numbers():
    text = fileio.json_document({"a": float("inf"), "b": [float("nan"), 1.5, -float("inf")], "c": {"d": 2}})
    # json.dumps would have written Infinity and NaN, which JSON parsers refuse
    assert json.loads(text) == {"a": None, "b": [None, 1.5, None], "c": {"d": 2}}
    assert "Infinity" not in text and "NaN" not in text


def test_a_name_of_the_maximum_length_can_be_written(tmp_path):
    """255 bytes is a legal name; the temporary sibling's name is shortened to fit too (before,
    ".<name>.XXXXXXXX.tmp" was over the limit and the write failed)."""
    name = "é" * 127 + "a"  # 255 bytes in UTF-8, the usual NAME_MAX
    assert len(name.encode()) == 255
    fileio.atomic_write_bytes(tmp_path / name, b"x")
    plan = fileio.OutputPlan(force=True)
    out = plan.add(tmp_path / name, "--plot")
    plan.commit({out: b"y"})
    assert (tmp_path / name).read_bytes() == b"y" and len(list(tmp_path.iterdir())) == 1


# -------------------------------------------------- files written in place (issue 24 item 15)
def _special(tmp_path, kind):
    """A name in tmp_path that is not a plain file of its own, and a file outside it that a
    write through it would change."""
    outside = tmp_path / "outside.txt"
    outside.write_bytes(b"keep me\n")
    path = tmp_path / "log.jsonl"
    if kind == "symbolic link":
        path.symlink_to(outside)
    elif kind == "dangling symbolic link":
        path.symlink_to(tmp_path / "nowhere.txt")
    elif kind == "FIFO":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    elif kind == "hard link":
        os.link(outside, path)
    return path, outside


IN_PLACE_REFUSALS = [
    ("symbolic link", "is a symbolic link, not a regular file; sdp never writes through it: remove it"),
    ("dangling symbolic link", "is a symbolic link, not a regular file"),
    ("FIFO", "is a FIFO, not a regular file; sdp never writes through it: move it away"),
    ("directory", "is a directory, not a regular file"),
    ("hard link", "has 2 hard links: writing it would change the other names too"),
]


@pytest.mark.parametrize("kind,fragment", IN_PLACE_REFUSALS, ids=[k for k, _ in IN_PLACE_REFUSALS])
@pytest.mark.parametrize("mode", ["a", "ab", "a+b", "r+b"])
def test_open_in_place_refuses_what_is_not_a_plain_file_and_writes_nothing(tmp_path, kind, fragment, mode):
    path, outside = _special(tmp_path, kind)
    with pytest.raises(UserError) as err:
        fileio.open_in_place(path, mode)
    assert str(err.value).startswith(f"{path} ") and fragment in str(err.value), str(err.value)
    assert "\n" not in str(err.value)
    assert outside.read_bytes() == b"keep me\n" and not (tmp_path / "nowhere.txt").exists()
    with pytest.raises(UserError, match=fragment.split(";")[0]):
        fileio.refuse_in_place(path)  # the check before anything is written says the same


def test_open_in_place_appends_to_and_creates_plain_files(tmp_path):
    path = tmp_path / "log.jsonl"
    with fileio.open_in_place(path, "a") as fh:  # created
        fh.write("one\n")
    with fileio.open_in_place(path, "a+b") as fh:
        fh.seek(0)
        assert fh.read() == b"one\n"
        fh.seek(0)
        fh.write(b"two\n")  # appended wherever the position is
    with fileio.open_in_place(path, "r+b") as fh:
        assert fh.read() == b"one\ntwo\n"
        fh.truncate(4)
    assert path.read_bytes() == b"one\n"
    fileio.refuse_in_place(path)  # a plain file passes
    fileio.refuse_in_place(tmp_path / "missing")  # so does a name that is not there
    with pytest.raises(FileNotFoundError):  # r+b creates nothing
        fileio.open_in_place(tmp_path / "missing", "r+b")


def test_a_blocking_descriptor_comes_back(tmp_path):
    fd = fileio.open_fd_in_place(tmp_path / "x", os.O_RDWR | os.O_CREAT)
    try:
        assert os.get_blocking(fd)  # O_NONBLOCK served the open only
    finally:
        os.close(fd)


def test_check_tree_finds_a_link_or_special_file_at_any_depth(tmp_path):
    root = tmp_path / "run"
    (root / "checkpoints" / "step-000001" / "policy").mkdir(parents=True)
    (root / "metrics.jsonl").write_text("{}\n")
    (root / "wandb").mkdir()
    (root / "wandb" / "latest-run").symlink_to(root / "wandb")  # W&B's own link: skipped
    fileio.check_tree(root, skip=("wandb",))
    deep = root / "checkpoints" / "step-000001" / "policy" / "model.safetensors"
    deep.symlink_to(tmp_path)
    with pytest.raises(UserError, match=f"^{deep} is a symbolic link"):
        fileio.check_tree(root, skip=("wandb",))
    deep.unlink()
    os.mkfifo(root / "events.jsonl")
    with pytest.raises(UserError, match="events.jsonl is a FIFO"):
        fileio.check_tree(root, skip=("wandb",))
    (root / "events.jsonl").unlink()
    (root / "wandb").rename(root / "w")
    (root / "wandb").symlink_to(root / "w")  # a skipped name is still checked itself
    with pytest.raises(UserError, match="wandb is a symbolic link"):
        fileio.check_tree(root, skip=("wandb",))
    (root / "wandb").unlink()
    (root / "w").rename(root / "wandb")
    linked_root = tmp_path / "alias"
    linked_root.symlink_to(root)
    fileio.check_tree(linked_root, skip=("wandb",))  # the root itself may be a link


def test_redirect_output_keeps_what_came_before_and_refuses_a_link(tmp_path):
    """A process started before its log existed wrote into an unlinked file; redirected, its
    log holds that output first, then what it writes after (stdout and stderr alike). A log
    that is a symbolic link is refused, as every log in a run directory is."""
    import subprocess
    import sys
    import tempfile

    log = tmp_path / "engine.log"
    log.write_text("an earlier session\n")
    child = (
        "import sys\n"
        "from pathlib import Path\n"
        "from sdp_cli.fileio import redirect_output\n"
        "print('before the run directory', flush=True)\n"
        "redirect_output(Path(sys.argv[1]))\n"
        "print('after', flush=True)\n"
        "print('an error line', file=sys.stderr, flush=True)\n"
    )
    with tempfile.TemporaryFile() as early:
        done = subprocess.run([sys.executable, "-c", child, str(log)], stdout=early, stderr=subprocess.STDOUT, timeout=60)
    assert done.returncode == 0
    assert log.read_text() == "an earlier session\nbefore the run directory\nafter\nan error line\n"
    (tmp_path / "target").write_text("")
    link = tmp_path / "link.log"
    link.symlink_to(tmp_path / "target")
    with tempfile.TemporaryFile() as early:
        done = subprocess.run([sys.executable, "-c", child, str(link)], stdout=early, stderr=subprocess.PIPE, timeout=60)
    assert done.returncode != 0 and (tmp_path / "target").read_text() == ""


def test_missing_dirs_made_are_removed_when_the_block_fails_and_kept_when_it_succeeds(tmp_path):
    (tmp_path / "kept").mkdir()
    deep = tmp_path / "kept" / "a" / "b" / "c"
    with pytest.raises(KeyboardInterrupt):
        with fileio.missing_dirs_made(deep):
            assert deep.is_dir()
            raise KeyboardInterrupt
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["kept"]  # a, b, c gone; kept, which was there, stays
    with pytest.raises(OSError):
        with fileio.missing_dirs_made(deep):
            (deep.parent / "someone-elses.txt").write_text("x")  # b is not empty: left as it is
            raise OSError("disk")
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == [
        "kept", "kept/a", "kept/a/b", "kept/a/b/someone-elses.txt"
    ]  # fmt: skip
    with fileio.missing_dirs_made(deep):
        pass
    assert deep.is_dir()


def test_a_path_of_path_max_bytes_is_refused_and_one_byte_less_is_not(tmp_path):
    """PATH_MAX counts the terminating NUL: a path of exactly that many bytes cannot be opened."""
    _, path_max = fileio._limits(tmp_path)

    def path_of(length):
        left = length - len(os.fsencode(tmp_path)) - 1
        parts = []
        while left > 0:
            part = min(left, 200)
            if left - part == 1:  # a part of 0 bytes after the separator cannot be
                part -= 1
            parts.append("d" * part)
            left -= part + 1
        path = tmp_path.joinpath(*parts)
        assert len(os.fsencode(path)) == length
        return path

    with pytest.raises(UserError, match=f"path is longer than the {path_max} bytes the system allows"):
        fileio.OutputPlan(make_dirs=True).add(path_of(path_max), "--plot")
    fileio.OutputPlan(make_dirs=True).add(path_of(path_max - 1), "--plot")
