"""The version checkpoints a recompute scores under: ``<run>/versions/v000012/`` (docs/recompute.md).

A run with ``train.keep_version_checkpoints=true`` keeps the policy of every version v in its
``versions/`` directory (the layout is ``sdp_cli.rundir``); ``sdp recompute --checkpoints`` takes
that run directory, its ``versions/`` directory, or any directory of ``v000012``-style ones.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from sdp_cli.errors import UserError
from sdp_cli.rundir import RunDir, version_dirs

KEEP_VERSIONS_FIX = "keep every version with `sdp train train.keep_version_checkpoints=true`"


def checkpoint_root(path: str | os.PathLike[str]) -> Path:
    """The directory holding the version directories: a run directory's ``versions/``, or
    ``path`` itself."""
    root = Path(path).expanduser()
    try:
        is_dir = root.is_dir()
    except OSError as err:  # e.g. a name too long for the file system
        raise UserError(f"checkpoint directory {root}: {err.strerror}; pass a run directory or its versions/") from None
    if not is_dir:
        raise UserError(
            f"checkpoint directory {root} does not exist; pass a run directory or its versions/ directory"
        )
    versions = RunDir(root).versions
    return versions if versions.is_dir() else root


def find_checkpoints(path: str | os.PathLike[str]) -> dict[int, Path]:
    """Version → checkpoint directory, from a run directory (its ``versions/``) or from a
    directory holding ``v000012``-style directories."""
    root = checkpoint_root(path)
    found: dict[int, Path] = {}
    for version, directories in version_dirs(root).items():
        if len(directories) > 1:
            names = ", ".join(d.name for d in directories[:2])
            raise UserError(f"{root} has two directories for version {version} ({names}); remove one")
        found[version] = directories[0]
    return found


def format_versions(versions: Iterable[int]) -> str:
    """``[1, 2, 3, 5]`` → ``"1–3, 5"``."""
    values = sorted(set(versions))
    parts: list[str] = []
    i = 0
    while i < len(values):
        j = i
        while j + 1 < len(values) and values[j + 1] == values[j] + 1:
            j += 1
        parts.append(str(values[i]) if i == j else f"{values[i]}–{values[j]}")
        i = j + 1
    return ", ".join(parts)


class MissingCheckpoints(UserError):
    """Some version a batch needs has no checkpoint directory."""


@dataclass(frozen=True)
class RunNumerics:
    """How the run computed what its batches store, from its ``config.yaml``: the trainer's
    dtype (``train.dtype``; π_prox) and whether π_prox_t of tokens one version stale is the
    trainer's π_prox (``rollout.proximal_t_source=trainer``) rather than the engine's. The
    engine's dtype needs no config: version checkpoints are saved in it."""

    train_dtype: str
    trainer_fills_proximal_t: bool
    source: Path


def run_numerics(root: Path) -> RunNumerics | None:
    """Those of the run whose ``versions/`` directory is ``root``; None when ``root`` is not a
    run's ``versions/``."""
    import yaml

    config = RunDir(root.parent).config
    if root.name != "versions" or not config.is_file():
        return None
    try:
        data = yaml.safe_load(config.read_text())
        train, rollout = (data.get(k) or {} for k in ("train", "rollout"))
        return RunNumerics(str(train.get("dtype", "float32")), rollout.get("proximal_t_source") == "trainer", config)
    except (OSError, UnicodeDecodeError, yaml.YAMLError, AttributeError) as err:
        raise UserError(
            f"{config}: unreadable run config ({type(err).__name__}); restore it, or pass a copy of versions/ alone"
        ) from None
