"""Which batch files ``sdp recompute`` and ``sdp inspect-weights`` read, and where ``sdp
recompute`` writes them (docs/recompute.md "Output, atomicity, errors"); ``fileio.OutputPlan``
then writes them all or none.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from sdp_cli.errors import UserError
from sdp_cli.fileio import file_identity
from sdp_cli.rundir import RunDir


def expand_batch_paths(paths: Sequence[str | os.PathLike[str]]) -> list[Path]:
    """Batch files, with a directory standing for its ``*.safetensors`` files (sorted) and a run
    directory for those of its ``batches/``. One file named twice, in whatever spelling (also
    inside a directory given), is refused: it would be read twice."""
    files: list[Path] = []
    for raw in paths:
        path = Path(raw).expanduser()
        if os.path.isdir(path):  # False for a name too long: the reader then names the problem
            found = _batch_files_in(path)
            run = RunDir(path)
            if not found and run.is_run:
                found = _batch_files_in(run.batches)
                if not found:
                    raise UserError(
                        f"{path} is a run that saved no batches; train with train.save_batches=true to keep them"
                    )
            if not found:
                raise UserError(
                    f"{path} holds no *.safetensors batch files; pass batch files, a batches/ directory or a run directory"
                )
            files.extend(found)
        else:
            files.append(path)
    seen: dict[tuple[object, ...], Path] = {}
    for path in files:
        first = seen.setdefault(file_identity(path), path)
        if first is not path:
            same = "is given twice" if str(first) == str(path) else f"is the same file as {first}"
            raise UserError(f"{path} {same}; pass each batch once")
    return files


def batches_run(files: Sequence[Path]) -> Path:
    """The run directory whose ``batches/`` holds every one of ``files``: where ``sdp recompute``
    finds their checkpoints when ``--checkpoints`` is not given."""
    runs: dict[str, Path] = {}
    for path in files:
        run = RunDir(Path(os.path.abspath(path)).parent.parent)  # also for a bare name given inside batches/
        if not run.is_run or os.path.realpath(run.batches) != os.path.realpath(path.parent):
            raise UserError(
                f"{path} is not in a run's batches/, so its run's checkpoints are unknown; pass --checkpoints RUN_DIR"
            )
        runs.setdefault(os.path.realpath(run.path), run.path)
    if len(runs) > 1:
        first, second = list(runs.values())[:2]
        raise UserError(
            f"the batches come from two runs ({first}, {second}); recompute each run's batches with its own --checkpoints"
        )
    return next(iter(runs.values()))


def _batch_files_in(directory: Path) -> list[Path]:
    return sorted(p for p in directory.glob("*.safetensors") if p.is_file())


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

