"""The layout of an ``sdp train`` run directory, in one place (docs/design.md §7).

    config.yaml                 the resolved config
    overrides.json              the command-line overrides (``resume`` re-composes from them)
    config_source.json          --config-dir / --config-name, when given (``resume`` composes with them)
    identity.json               the run's random id, written once when the directory is made; every
                                checkpoint carries it (sdp_cli/train/session/resume_check.py)
    metrics.jsonl               one line per step
    events.jsonl                start / resume / crashes / checkpoints / stops / end
    ledger.jsonl                the fate of every rollout group (sdp_cli/train/asyncloop/ledger.py)
    summary.json                final numbers of the run (present once it finished)
    .lock                       the lock one process holds while it trains (sdp_cli/dirlock.py)
    tensorboard/                TensorBoard event files (run.trackers)
    wandb/                      W&B's files (run.trackers includes wandb)
    trackers.json               the W&B / MLflow run ids a resume continues
    logs/                       output of a server sdp launched
    checkpoints/step-000050/    atomic, validated checkpoints (sdp_cli/train/session/checkpoint.py)
    checkpoints/latest          the name of the newest one (a hint; validation decides)
    batches/step-000050.safetensors   training batches (train.save_batches=true)
    versions/v000012/           the policy of every version (train.keep_version_checkpoints=true;
                                under LoRA its adapters)
    versions/base/              under LoRA: the base model the adapters of versions/ belong to
    weights/v000012/            what a server loads at a weight update (the version pushed and the one before)
    weights/launch/             what a launched server starts from

Training writes these paths and ``sdp recompute``, ``sdp ablate`` and the tests read them, all
through ``RunDir``: no other module spells a file name or a ``%06d`` pattern of the layout.
Torch-free.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from sdp_cli.dirlock import LOCK_NAME

#: name of the file in ``checkpoints/`` that names the newest checkpoint
LATEST = "latest"
#: glob of the checkpoint directories (and of the saved batches, plus their suffix)
STEP_GLOB = "step-*"
#: the suffix of a saved batch's file name (``step-000050.safetensors``)
BATCH_SUFFIX = ".safetensors"
#: the directory in ``versions/`` that holds the base model of LoRA adapter versions
VERSION_BASE = "base"
#: the directory W&B writes in a run: its files, links among them, are W&B's own
WANDB = "wandb"
_STEP_NAME = re.compile(r"^step-(\d+)$")
_VERSION_NAME = re.compile(r"^v(\d+)$")


def step_name(step: int) -> str:
    """``50`` → ``step-000050`` (a checkpoint directory, the stem of a saved batch)."""
    return f"step-{int(step):06d}"


def version_name(version: int) -> str:
    """``12`` → ``v000012`` (a directory in ``versions/`` or ``weights/``)."""
    return f"v{int(version):06d}"


def parse_step_name(name: str) -> int | None:
    """``step-000050`` → 50; None for any other name."""
    match = _STEP_NAME.match(name)
    return int(match.group(1)) if match else None


def parse_version_name(name: str) -> int | None:
    """``v000012`` → 12; None for any other name."""
    match = _VERSION_NAME.match(name)
    return int(match.group(1)) if match else None


@dataclass(frozen=True)
class RunDir:
    """The paths of one run directory (nothing is created or read by constructing it)."""

    path: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", Path(self.path))

    @property
    def config(self) -> Path:
        return self.path / "config.yaml"

    @property
    def lock(self) -> Path:
        return self.path / LOCK_NAME

    @property
    def overrides(self) -> Path:
        return self.path / "overrides.json"

    @property
    def identity(self) -> Path:
        return self.path / "identity.json"

    @property
    def config_source(self) -> Path:
        return self.path / "config_source.json"

    @property
    def metrics(self) -> Path:
        return self.path / "metrics.jsonl"

    @property
    def events(self) -> Path:
        return self.path / "events.jsonl"

    @property
    def ledger(self) -> Path:
        return self.path / "ledger.jsonl"

    @property
    def summary(self) -> Path:
        return self.path / "summary.json"

    @property
    def tensorboard(self) -> Path:
        return self.path / "tensorboard"

    @property
    def trackers(self) -> Path:
        return self.path / "trackers.json"

    @property
    def logs(self) -> Path:
        return self.path / "logs"

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    @property
    def batches(self) -> Path:
        return self.path / "batches"

    @property
    def versions(self) -> Path:
        return self.path / "versions"

    @property
    def weights(self) -> Path:
        return self.path / "weights"

    @property
    def launch_weights(self) -> Path:
        return self.weights / "launch"

    def checkpoint(self, step: int) -> Path:
        return self.checkpoints / step_name(step)

    def batch(self, step: int) -> Path:
        return self.batches / f"{step_name(step)}{BATCH_SUFFIX}"

    def version(self, version: int) -> Path:
        return self.versions / version_name(version)

    @property
    def version_base(self) -> Path:
        return self.versions / VERSION_BASE

    def weights_of(self, version: int) -> Path:
        return self.weights / version_name(version)

    @property
    def is_run(self) -> bool:
        """Whether the directory holds a run (its resolved config, written when the run starts)."""
        return self.config.is_file()

    @property
    def finished(self) -> bool:
        """Whether the run ended normally (it wrote ``summary.json``)."""
        return self.summary.is_file()


def run_part(path: Path) -> tuple[RunDir, str] | None:
    """What ``path`` is of an sdp run, by its place: (the run, "run") for a run directory (it
    holds ``overrides.json``, the first file a run writes), (its run, "checkpoint") for one of a
    run's ``checkpoints/step-N``, (its run, "version") for one of its ``versions/vN``; else None."""
    if RunDir(path).overrides.is_file():
        return RunDir(path), "run"
    run = RunDir(path.parent.parent)
    if parse_step_name(path.name) is not None and path.parent == run.checkpoints:
        return run, "checkpoint"
    if parse_version_name(path.name) is not None and path.parent == run.versions:
        return run, "version"
    return None


def step_dirs(root: Path) -> list[tuple[int, Path]]:
    """(step, directory) of every ``step-N`` directory under ``root``, oldest first. Ordered by
    number: past step 999,999 the names grow a digit, and ``step-1000000`` < ``step-999999`` as
    strings."""
    found = [(parse_step_name(p.name), p) for p in root.iterdir()] if root.is_dir() else []
    return sorted((step, p) for step, p in found if step is not None and p.is_dir())


def superseded_versions(root: Path, current: int) -> list[Path]:
    """The version directories under ``root`` other than ``current`` and the one before it.
    Relative to ``current``, not "all but the newest two": after a resume the directories
    numbered above it are a crashed session's, and the newest by number are not this run's."""
    return [p for version, paths in version_dirs(root).items() if version not in (current - 1, current) for p in paths]


def saved_batches(root: Path) -> list[tuple[int, Path]]:
    """(step, file) of every ``step-N.safetensors`` batch file under ``root``, by step."""
    files = root.glob(f"{STEP_GLOB}{BATCH_SUFFIX}") if root.is_dir() else []
    found = [(parse_step_name(p.name.removesuffix(BATCH_SUFFIX)), p) for p in files]
    return sorted((step, p) for step, p in found if step is not None and p.is_file())


def version_dirs(root: Path) -> dict[int, list[Path]]:
    """Version → the directories under ``root`` named for it (``v000012``; ``v12`` too, so that a
    caller can refuse two directories of one version). Files and other names are skipped."""
    found: dict[int, list[Path]] = {}
    for child in sorted(root.iterdir()) if root.is_dir() else []:
        version = parse_version_name(child.name)
        if version is not None and child.is_dir():
            found.setdefault(version, []).append(child)
    return dict(sorted(found.items()))
