"""What sdp writes: crash-safe files (batches, checkpoints, plots, dumps), the output files a
command is asked for, and JSON documents.

A file is written to a temporary sibling, flushed and fsynced, given normal permissions (a new
file gets 0666 minus the umask, a replaced file keeps its mode — ``mkstemp`` alone would leave it
owner-only), renamed over the target, and the directory is fsynced so the rename survives a
crash. A reader therefore sees the old file or the new one, never a partial one.

A command's output files (``--plot``, ``--dump-weights``, ``-o``) go through one
:class:`OutputPlan`: declared and checked before any work (docs/reliability.md, "Outputs"),
then written together at the end, all of them or none.

Files sdp writes in place inside a run or sweep directory (the lock, the JSON-lines logs, a
server's log) are opened with :func:`open_in_place`: never through a symbolic link, and only
when they are regular files with one name; :func:`check_tree` refuses a directory that holds a
link or a special file before anything is written in it (docs/reliability.md, "Links and
special files in a run directory"). An atomic write replaces a link by its rename and never
writes through it.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import stat
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from sdp_cli.errors import UserError, WriteFailed, write_fix

# read once at import: os.umask can only be queried by setting it, which is not thread-safe later
_UMASK = os.umask(0o022)
os.umask(_UMASK)


def default_file_mode() -> int:
    return 0o666 & ~_UMASK


def default_dir_mode() -> int:
    return 0o777 & ~_UMASK


def fsync_directory(directory: Path) -> None:
    """Persist renames inside ``directory``; a no-op where directories cannot be opened."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_all(fd: int, data: bytes | memoryview) -> None:
    """Write ``data`` to the descriptor ``fd``: a write may take part of it, so write until all
    of it is out (an OSError says the rest was not)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _short(name: str, limit: int = 200) -> str:
    """``name`` cut to at most ``limit`` UTF-8 bytes, so that a temporary name built from a
    255-byte name still fits the file system's name limit."""
    return name.encode()[:limit].decode(errors="ignore")


def stage_bytes(path: Path, data: bytes) -> Path:
    """Write ``data`` to a fsynced temporary file next to ``path`` and return it (not yet renamed).

    The caller renames it with ``os.replace`` (or deletes it). Errors are one-line UserErrors.
    """
    path = Path(path)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{_short(path.name)}.", suffix=".tmp", dir=path.parent)
    except OSError as err:
        raise WriteFailed(f"{path}: cannot create a file in {path.parent} ({err.strerror}); {write_fix(err)}", err, path) from None
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        try:
            mode = stat.S_IMODE(path.stat().st_mode)
        except FileNotFoundError:
            mode = default_file_mode()
        os.chmod(tmp, mode)
    except BaseException as err:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        if isinstance(err, OSError):
            raise WriteFailed(f"{path}: cannot be written ({err.strerror or err}); {write_fix(err)}", err, path) from None
        raise
    return Path(tmp)


def atomic_write_bytes(path: Path, data: bytes) -> Path:
    """Replace ``path`` with ``data`` atomically (see the module docstring)."""
    path = Path(path)
    tmp = stage_bytes(path, data)
    try:
        os.replace(tmp, path)
    except OSError as err:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise WriteFailed(f"{path}: cannot replace it ({err.strerror}); {write_fix(err)}", err, path) from None
    fsync_directory(path.parent)
    return path


def atomic_write_text(path: Path, text: str) -> Path:
    """Replace ``path`` with ``text`` (UTF-8) atomically, creating its directory if needed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return atomic_write_bytes(path, text.encode("utf-8"))


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def json_document(doc: Any) -> str:
    """``doc`` as indented JSON that every parser accepts (``--json`` of every command): a
    non-finite number (NaN, ±inf: not JSON) becomes null, "no defined value"."""
    return json.dumps(_finite(doc), indent=2, allow_nan=False)


# ---------------------------------------------------------------- files written in place
#: what a file that sdp writes may not be, by ``stat.S_IFMT`` (a link only where it is not followed)
_KINDS = {
    stat.S_IFLNK: "a symbolic link",
    stat.S_IFDIR: "a directory",
    stat.S_IFIFO: "a FIFO",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
}
#: never follow a link at the last component; never wait on a FIFO while opening
_IN_PLACE_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
#: ``open_in_place`` modes: what each opens
_MODES = {
    "a": os.O_WRONLY | os.O_APPEND | os.O_CREAT,
    "ab": os.O_WRONLY | os.O_APPEND | os.O_CREAT,
    "a+b": os.O_RDWR | os.O_APPEND | os.O_CREAT,
    "r+b": os.O_RDWR,
}


def _kind(mode: int) -> str:
    return _KINDS.get(stat.S_IFMT(mode), "a special file")


def _refusal(path: Path, info: os.stat_result) -> str | None:
    """Why sdp must not write ``path`` in place (None: it may): a link, not a regular file, or
    a file with a second name (a hard link: the write would change that one too)."""
    if not stat.S_ISREG(info.st_mode):
        fix = "remove it" if stat.S_ISLNK(info.st_mode) else "move it away"
        return f"{path} is {_kind(info.st_mode)}, not a regular file; sdp never writes through it: {fix}"
    if info.st_nlink > 1:
        return (
            f"{path} has {info.st_nlink} hard links: writing it would change the other names too; "
            "replace it with a copy of its own (cp, not cp -l)"
        )
    return None


def refuse_in_place(path: Path) -> None:
    """Refuse, in one line, a ``path`` that exists and that :func:`open_fd_in_place` would
    refuse to open (a check before anything is written; the open checks again)."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    problem = _refusal(Path(path), info)
    if problem is not None:
        raise UserError(problem)


def open_fd_in_place(path: Path, flags: int, mode: int = 0o644) -> int:
    """``os.open(path, flags)`` refusing, in one line, a symbolic link (``O_NOFOLLOW``), a FIFO,
    device, socket or directory (``O_NONBLOCK`` keeps a FIFO from blocking the open; ``fstat``
    then checks the file itself) and a hard-linked file. Returns a blocking descriptor; any
    other failure (permissions, a missing directory) is the ``OSError`` of ``os.open``."""
    path = Path(path)
    try:
        fd = os.open(path, flags | _IN_PLACE_FLAGS, mode)
    except OSError:
        refuse_in_place(path)  # a link (ELOOP), a FIFO without reader (ENXIO), a directory, ...
        raise
    try:
        problem = _refusal(path, os.fstat(fd))
        if problem is not None:
            raise UserError(problem)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_in_place(path: Path, mode: str) -> IO[Any]:
    """A file sdp writes in place inside a run or sweep directory, opened as
    :func:`open_fd_in_place` allows: ``a`` (text, appended, line-buffered), ``ab`` (appended),
    ``a+b`` (appended, and read) or ``r+b`` (an existing file, read and written)."""
    fd = open_fd_in_place(path, _MODES[mode])
    if mode == "a":
        return os.fdopen(fd, "a", buffering=1, encoding="utf-8")
    return os.fdopen(fd, mode)


def redirect_output(log_path: Path, *, copied: int = 0) -> None:
    """Send this process's output (descriptors 1 and 2) to ``log_path``, appended (opened as
    ``open_in_place`` opens), after what it wrote until now to the file its stdout was (a
    process started before its run directory existed kept it in an unlinked file) from byte
    ``copied`` on (what its parent copied into the log already)."""
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    with open_in_place(log_path, "ab") as log:
        try:
            log.write(os.pread(1, max(0, os.fstat(1).st_size - copied), copied))
        except OSError:  # its stdout is no readable file: nothing kept
            pass
        log.flush()
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)


def check_tree(root: Path, *, skip: Iterable[str] = ()) -> None:
    """Refuse, in one line, a directory tree in which sdp is about to write that holds a
    symbolic link or anything but regular files and directories: it would write through it or
    wait on it. Directories named in ``skip`` (``wandb``, whose files W&B manages and links)
    are checked themselves but not entered. ``root`` itself may be a link (the user named it)."""
    skipped = set(skip)
    pending = [Path(root)]
    while pending:
        directory = pending.pop()
        try:
            entries = list(os.scandir(directory))
        except OSError as err:
            raise UserError(f"{directory}: cannot be listed ({err.strerror}); check its permissions") from None
        for entry in entries:
            info = entry.stat(follow_symlinks=False)
            if stat.S_ISDIR(info.st_mode):
                if entry.name not in skipped:
                    pending.append(Path(entry.path))
            elif not stat.S_ISREG(info.st_mode):
                raise UserError(_refusal(Path(entry.path), info) or f"{entry.path}: not a regular file")


# ----------------------------------------------------------------------- command outputs
def file_identity(path: Path) -> tuple[object, ...]:
    """What makes two spellings one file: the same real path (symlinks, ``./x``, ``d/../x``)
    or, for an existing file, the same device and inode (hard links)."""
    real = os.path.realpath(path)
    try:
        info = os.stat(real)
    except OSError:
        return ("path", real)
    return ("inode", info.st_dev, info.st_ino)


@dataclass(frozen=True)
class Output:
    """One output file: ``path`` as the user gave it (for messages), ``target`` the real path
    written (symlinks resolved: writing through a link updates the file it points to)."""

    path: Path
    target: Path
    option: str


class OutputPlan:
    """The output files of one command, checked before any work and written together.

    ``add`` refuses, each in one line: a name longer than the file system allows; a missing
    directory (unless ``make_dirs``); a target that exists but is not a regular file (a
    directory, FIFO, device or socket, also behind a symlink); an input of the command; one
    file named for two outputs (whatever the spelling, see :func:`file_identity`); an existing
    file unless ``force`` (or ``replace=True`` for that output); an unwritable directory.
    ``commit`` re-checks, stages every file, then renames them into place; if any step fails,
    every output is as it was before (a replaced file is restored from a hard-link backup, or
    a copy where the file system has no hard links).
    """

    def __init__(self, *, force: bool = False, inputs: Iterable[Path] = (), make_dirs: bool = False):
        self.force = force
        self.make_dirs = make_dirs
        self._inputs = {file_identity(Path(p)) for p in inputs}
        self._outputs: list[Output] = []
        self._replace: dict[Output, bool] = {}

    @property
    def outputs(self) -> list[Output]:
        return list(self._outputs)

    def add(self, path: str | os.PathLike[str], option: str, *, replace: bool | None = None) -> Output:
        """Declare and check one output file (see the class docstring)."""
        given = Path(path).expanduser()
        out = Output(given, Path(os.path.realpath(given)), option)
        self._check(out, replace=True)  # where and what it is; whether it may be replaced: last
        identity = file_identity(out.target)
        if identity in self._inputs:
            raise UserError(f"{given}: is one of the input batches; write {option} to another file")
        for other in self._outputs:
            if file_identity(other.target) == identity:
                raise UserError(
                    f"{given}: is given for both {other.option} and {option}; pass a different file to each"
                )
        replace = self.force if replace is None else replace
        self._check(out, replace)
        self._outputs.append(out)
        self._replace[out] = replace
        return out

    def _check(self, out: Output, replace: bool) -> None:
        given, target = out.path, out.target
        name_max, path_max = _limits(target.parent)
        too_long = next((part for part in target.parts if len(os.fsencode(part)) > name_max), None)
        if too_long is not None:
            raise UserError(
                f"{given}: file name is {len(os.fsencode(too_long))} bytes, longer than the {name_max} "
                "this file system allows; choose a shorter name"
            )
        if len(os.fsencode(target)) >= path_max:
            raise UserError(f"{given}: path is longer than the {path_max} bytes the system allows; choose a shorter one")
        directory = _existing_ancestor(target.parent)
        if directory != target.parent and not self.make_dirs:
            raise UserError(f"{given}: directory {target.parent} does not exist; create it first")
        if not directory.is_dir():
            raise UserError(f"{given}: {directory} is not a directory; choose another place for {out.option}")
        try:
            info = os.stat(target)
        except FileNotFoundError:
            info = None
        except OSError as err:
            raise UserError(f"{given}: cannot be checked ({err.strerror}); choose another path") from None
        if info is not None:
            if not stat.S_ISREG(info.st_mode):
                raise UserError(
                    f"{given}: is {_kind(info.st_mode)}, not a regular file; {out.option} writes a regular file: pass a file path"
                )
            if not replace:
                raise UserError(f"{given}: already exists; pass --force to replace it, or choose another name")
        if not os.access(directory, os.W_OK | os.X_OK):
            raise UserError(f"{given}: directory {directory} is not writable; choose another place")

    def commit(self, contents: Mapping[Output, bytes]) -> list[Path]:
        """Write every declared output (``contents`` has the bytes of each): all or none.
        Returns the paths as given."""
        assert set(contents) == set(self._outputs), "commit() needs the contents of every output"
        for out in self._outputs:  # time has passed since add(): the targets may have changed
            self._check(out, self._replace[out])
        created: list[Path] = []
        staged: list[tuple[Path, Output]] = []
        published: list[tuple[Output, Path | None]] = []
        current = self._outputs[0] if self._outputs else None
        try:
            for out in self._outputs:
                current = out
                _make_dirs(out.target.parent, created)
                staged.append((stage_bytes(out.target, contents[out]), out))
            for tmp, out in staged:
                current = out
                published.append((out, _backup(out.target)))
                try:
                    os.replace(tmp, out.target)
                except OSError:
                    _, backup = published.pop()  # the target is still the old file
                    if backup is not None:
                        os.unlink(backup)
                    raise
        except UserError as err:  # already names the file and the problem
            _roll_back(published, staged, created)
            if isinstance(err, WriteFailed):
                raise WriteFailed(f"{err}; nothing was written", err) from None
            raise UserError(f"{err}; nothing was written") from None
        except OSError as err:
            _roll_back(published, staged, created)
            where = current.path if current else "?"
            raise WriteFailed(
                f"{where}: cannot be written ({err.strerror or err}); nothing was written; {write_fix(err)}", err, where
            ) from None
        except BaseException:
            _roll_back(published, staged, created)
            raise
        for _, backup in published:
            if backup is not None:
                with contextlib.suppress(OSError):
                    os.unlink(backup)
        for directory in {out.target.parent for out in self._outputs}:
            fsync_directory(directory)
        return [out.path for out in self._outputs]


def _limits(directory: Path) -> tuple[int, int]:
    """(NAME_MAX, PATH_MAX) of the file system holding ``directory`` (255, 4096 if unknown)."""
    where = _existing_ancestor(directory)
    try:
        return os.pathconf(where, "PC_NAME_MAX"), os.pathconf(where, "PC_PATH_MAX")
    except (OSError, ValueError):
        return 255, 4096


def _existing_ancestor(directory: Path) -> Path:
    while not os.path.lexists(directory) and directory != directory.parent:
        directory = directory.parent
    return directory


def _make_dirs(directory: Path, created: list[Path]) -> None:
    """Create ``directory`` and its missing parents, outermost first, appending each to
    ``created`` as soon as it exists (so that a failure half-way can remove them)."""
    missing = []
    while not os.path.lexists(directory):
        missing.append(directory)
        directory = directory.parent
    for path in reversed(missing):
        try:
            path.mkdir()
        except OSError as err:
            raise WriteFailed(f"{path}: cannot create the directory ({err.strerror}); {write_fix(err)}", err, path) from None
        created.append(path)


#: how safetensors' writer (Rust) words a failed write: "I/O error: No space left on device (os error 28)"
_SAFETENSORS_IO_ERROR = re.compile(r"I/O error: (?P<what>.+?) \(os error (?P<errno>\d+)\)")


@contextlib.contextmanager
def written_by_safetensors(where: str | os.PathLike[str], *, shown_as: str | os.PathLike[str] | None = None) -> Iterator[None]:
    """Around a write that safetensors makes (``save_file``, ``save_pretrained``) of the file
    ``where``, or into the directory ``where``, two things it does unlike every other writer:

    - a failed write (a full disk) comes out as its own ``SafetensorError``, which every handler
      of write errors, built for OSError, would let through as a traceback: it is re-raised as
      the OSError it was, naming ``shown_as`` (default ``where``);
    - its files are created owner-only (0600) whatever the umask: they get the mode a new file
      gets here (``default_file_mode``), as the config and tokenizer files beside them have.
    """
    try:
        yield
    except Exception as err:
        found = _SAFETENSORS_IO_ERROR.search(str(err)) if type(err).__name__ == "SafetensorError" else None
        if found is None:
            raise
        raise OSError(int(found["errno"]), found["what"], os.fspath(shown_as or where)) from err
    path = Path(where)
    for file in [path] if path.is_file() else path.rglob("*.safetensors"):
        file.chmod(default_file_mode())


@contextlib.contextmanager
def missing_dirs_made(directory: Path) -> Iterator[None]:
    """Create ``directory`` and its missing parents for the block; if the block raises, remove
    the ones it created (those still empty), so that a failed write leaves no trace."""
    created: list[Path] = []
    try:
        _make_dirs(Path(directory), created)
        yield
    except BaseException:
        for made in reversed(created):
            with contextlib.suppress(OSError):
                made.rmdir()
        raise


def _backup(target: Path) -> Path | None:
    """A copy of the file about to be replaced (None if there is none), so that a later failure
    can put it back: a hard link where the file system has them, else a copy. Raises OSError
    when neither works; then nothing is replaced."""
    if not os.path.lexists(target):
        return None
    backup = target.parent / f".{_short(target.name)}.{os.getpid()}.bak"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(backup)
    try:
        os.link(target, backup)
    except OSError:
        shutil.copyfile(target, backup)
    return backup


def _roll_back(published: list[tuple[Output, Path | None]], staged: list[tuple[Path, Output]], created: list[Path]) -> None:
    """Undo a failed commit: published outputs back to their old content (or removed when
    they are new), staged files and created directories removed."""
    for out, backup in reversed(published):
        with contextlib.suppress(OSError):
            if backup is not None:
                os.replace(backup, out.target)
            else:
                os.unlink(out.target)
    for tmp, _ in staged:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
    for directory in reversed(created):
        with contextlib.suppress(OSError):
            directory.rmdir()
