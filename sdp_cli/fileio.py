"""Crash-safe file writing shared by every writer in sdp (batches, checkpoints, plots, dumps).

A file is written to a temporary sibling, flushed and fsynced, given normal permissions (a new
file gets 0666 minus the umask, a replaced file keeps its mode — ``mkstemp`` alone would leave it
owner-only), renamed over the target, and the directory is fsynced so the rename survives a
crash. A reader therefore sees the old file or the new one, never a partial one.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import stat
import tempfile
from pathlib import Path
from typing import Any

from sdp_cli.errors import UserError

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


def stage_bytes(path: Path, data: bytes) -> Path:
    """Write ``data`` to a fsynced temporary file next to ``path`` and return it (not yet renamed).

    The caller renames it with ``os.replace`` (or deletes it). Errors are one-line UserErrors.
    """
    path = Path(path)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as err:
        raise UserError(
            f"{path}: cannot create a file in {path.parent} ({err.strerror}); check that it exists and is writable"
        ) from None
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
            raise UserError(
                f"{path}: cannot be written ({err.strerror or err}); check disk space and permissions"
            ) from None
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
        raise UserError(f"{path}: cannot replace it ({err.strerror}); check permissions") from None
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
