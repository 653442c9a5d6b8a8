"""Which batch files ``sdp recompute`` reads and where it writes them (docs/recompute.md
"Output, atomicity, errors"); ``fileio.OutputPlan`` then writes them all or none.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from sdp_cli.errors import UserError


def expand_batch_paths(paths: Sequence[str | os.PathLike[str]]) -> list[Path]:
    """Batch files, with a directory standing for its ``*.safetensors`` files (sorted)."""
    files: list[Path] = []
    for raw in paths:
        path = Path(raw).expanduser()
        if os.path.isdir(path):  # False for a name too long: the reader then names the problem
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
    as_dir = os.path.isdir(out) or raw.endswith(("/", os.sep)) or len(sources) > 1
    if not as_dir:
        return [out]
    if os.path.lexists(out) and not os.path.isdir(out):
        raise UserError(f"--output {out} is a file but {len(sources)} batches were given; pass a directory")
    targets = [out / s.name for s in sources]
    names = [t.name for t in targets]
    clash = next((n for n in names if names.count(n) > 1), None)
    if clash is not None:
        raise UserError(
            f"two batches are named {clash} and would both be written to {out}; recompute them in separate calls"
        )
    return targets

