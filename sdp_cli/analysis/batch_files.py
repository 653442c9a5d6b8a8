"""Which batch files ``sdp recompute`` reads, where it writes them, and writing them all or none.

Writing stages every output next to its target (validated, written, fsynced) before renaming
any into place, so a failure while staging leaves every target unchanged (docs/recompute.md
"Output, atomicity, errors").
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from pathlib import Path

from sdp_cli.errors import UserError
from sdp_cli.fileio import fsync_directory, stage_bytes
from sdp_cli.rollout.batch_file import SavedBatch, serialize_batch


def expand_batch_paths(paths: Sequence[str | os.PathLike[str]]) -> list[Path]:
    """Batch files, with a directory standing for its ``*.safetensors`` files (sorted)."""
    files: list[Path] = []
    for raw in paths:
        path = Path(raw).expanduser()
        if path.is_dir():
            found = sorted(p for p in path.glob("*.safetensors") if p.is_file())
            if not found:
                raise UserError(f"{path} holds no *.safetensors batch files; pass batch files or a batches/ directory")
            files.extend(found)
        else:
            files.append(path)
    seen: set[Path] = set()
    for path in files:
        key = path.resolve()
        if key in seen:
            raise UserError(f"{path} is given twice; pass each batch once")
        seen.add(key)
    return files


def resolve_targets(sources: Sequence[Path], output: str | os.PathLike[str] | None) -> list[Path]:
    """Where each batch is written: in place, into the directory ``output``, or (one batch)
    to the file ``output``. A directory is recognised by existing or by a trailing slash."""
    if output is None:
        return list(sources)
    raw = os.fspath(output)
    out = Path(raw).expanduser()
    as_dir = out.is_dir() or raw.endswith(("/", os.sep)) or len(sources) > 1
    if not as_dir:
        return [out]
    if out.exists() and not out.is_dir():
        raise UserError(f"--output {out} is a file but {len(sources)} batches were given; pass a directory")
    targets = [out / s.name for s in sources]
    names = [t.name for t in targets]
    clash = next((n for n in names if names.count(n) > 1), None)
    if clash is not None:
        raise UserError(
            f"two batches are named {clash} and would both be written to {out}; recompute them in separate calls"
        )
    return targets


def write_batches(outputs: Sequence[tuple[SavedBatch, Path]]) -> list[Path]:
    """Write every batch to its target: all are staged (validated, written, fsynced) next to
    their targets first, then renamed into place. A failure while staging leaves every target
    unchanged; a failing rename (after staging succeeded) leaves the earlier targets new and
    the later ones old, and the message names how many were written. Returns the targets."""
    staged: list[tuple[Path, Path]] = []
    try:
        for batch, target in outputs:
            if not target.parent.is_dir():
                try:
                    target.parent.mkdir(parents=True, exist_ok=True)
                except OSError as err:
                    raise UserError(
                        f"cannot create {target.parent} ({err.strerror}); choose a writable --output"
                    ) from None
            staged.append((stage_bytes(target, serialize_batch(batch, str(target))), target))
    except BaseException:
        for tmp, _ in staged:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        raise
    written: list[Path] = []
    for i, (tmp, target) in enumerate(staged):
        try:
            os.replace(tmp, target)
        except OSError as err:
            for rest, _ in staged[i:]:
                with contextlib.suppress(OSError):
                    os.unlink(rest)
            raise UserError(
                f"{target}: cannot replace it ({err.strerror}); {len(written)} of {len(staged)} batches "
                f"were written before it, the others are unchanged; fix the problem and run again"
            ) from None
        written.append(target)
    for directory in {t.parent for t in written}:
        fsync_directory(directory)
    return written
