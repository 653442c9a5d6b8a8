"""Entries of sdp's on-disk cache (``$SDP_CACHE_DIR``, default ``~/.cache/sdp``): directories
that appear whole or not at all, checked against their checksums before every use.

An entry is built in a temporary directory beside its place (``staging_dir``); ``publish``
checksums and fsyncs every file, writes the info file listing each file's size and sha256 last,
fsyncs the directory and renames it into place, so a reader sees a complete entry or none, and
two processes that build the same key at once both succeed with one of the two (equivalent)
entries kept. ``verified_info`` checks an entry against its info file; ``set_aside`` removes a
damaged one in one atomic step. Used by the tiny model's warm start (``warm_start/``,
sdp_cli/models/warm_start.py) and the dequantised copies of GGUF files (``gguf/``,
sdp_cli/models/gguf_cache.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any

from sdp_cli.errors import UserError
from sdp_cli.fileio import fsync_directory


def cache_root(cache_dir: str | Path | None = None) -> Path:
    """``cache_dir``, else ``$SDP_CACHE_DIR``, else ``~/.cache/sdp``."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get("SDP_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "sdp"


def file_digest(path: Path) -> tuple[int, str]:
    """(size, sha256 hex) of a file."""
    sha = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            sha.update(chunk)
            size += len(chunk)
    return size, sha.hexdigest()


def verified_info(entry: Path, info_file: str, *, weights: bool = True) -> tuple[dict[str, Any] | None, str | None]:
    """(the ``info_file`` of ``entry``, None) when every file it lists has its recorded size and
    sha256, else (None, what is wrong) in a few words. ``weights=False``: the weight files
    (``*.safetensors``) are left unchecked, for a reader of the other files alone."""
    try:
        info = json.loads((entry / info_file).read_text())
    except FileNotFoundError:
        return None, f"has no {info_file}"
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        return None, f"has an unreadable {info_file} ({' '.join(str(err).split())})"
    files = info.get("files") if isinstance(info, dict) else None
    if not isinstance(files, dict) or not files:
        return None, "has no checksums (written by an older sdp)"
    for name, expected in sorted(files.items()):
        if not isinstance(expected, dict) or Path(name).name != name or name == info_file:
            return None, f"has a malformed checksum entry for {name!r}"
        if not weights and name.endswith(".safetensors"):
            continue
        try:
            size, digest = file_digest(entry / name)
        except OSError:
            return None, f"lacks {name}"
        if (size, digest) != (expected.get("size"), expected.get("sha256")):
            return None, f"has a {name} that does not match its checksum"
    return info, None


def set_aside(entry: Path, what: str) -> None:
    """Remove a damaged entry: renamed away first (one atomic step, so no reader sees it half
    deleted), then deleted. Another process may have done it already. ``what`` names the entry
    in the error (e.g. ``warm-start cache entry``)."""
    graveyard = entry.parent / f".{entry.name}.damaged-{uuid.uuid4().hex[:8]}"
    try:
        os.rename(entry, graveyard)
    except FileNotFoundError:
        return
    except OSError as err:
        raise UserError(f"{what} {entry} is damaged and cannot be removed ({err.strerror}); delete it by hand") from None
    if graveyard.is_dir():
        shutil.rmtree(graveyard, ignore_errors=True)
    else:
        graveyard.unlink(missing_ok=True)


def staging_dir(entry: Path) -> Path:
    """A new empty directory beside ``entry`` to build it in (readable by all, as the cache is
    meant to be shared); OSError where it cannot be made."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{entry.name}.", dir=entry.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private
    return tmp


def publish(tmp: Path, entry: Path, info: dict[str, Any], info_file: str) -> None:
    """Checksum and fsync every file of ``tmp``, write ``info`` with the checksums as
    ``info_file`` last, fsync the directory and rename it to ``entry``."""
    files = {}
    for path in sorted(tmp.iterdir()):
        size, digest = file_digest(path)
        files[path.name] = {"size": size, "sha256": digest}
        with open(path, "rb") as f:
            os.fsync(f.fileno())
    with open(tmp / info_file, "w") as f:
        f.write(json.dumps({**info, "files": files}, indent=2, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())
    fsync_directory(tmp)
    try:
        os.rename(tmp, entry)
    except OSError:
        # Another process finished the same key first; its entry is equivalent to ours.
        if not (entry / info_file).is_file():
            raise
    fsync_directory(entry.parent)
