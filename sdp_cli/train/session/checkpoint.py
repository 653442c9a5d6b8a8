"""Atomic, self-validating checkpoints of a training run (no pickle anywhere).

Layout of ``<run>/checkpoints/step-000050/``:
    policy/                 Hugging Face model directory (weights, config, tokenizer)
    optimizer.safetensors   every optimizer tensor, keyed ``state.<param>.<name>`` (absent when
                            the optimizer state is not saved: ``train.save_optimizer=false``)
    state.json              optimizer param groups + scalar state (or null), trainer version, RNG states,
                            the loop snapshot (counters, staleness manager, queued/cached groups)
    manifest.json           size and sha256 of every file above; written last

A checkpoint is built in a temporary sibling directory, every file and directory is fsynced,
and only then is it renamed into place; ``latest`` is replaced atomically afterwards. A reader
accepts a directory only if its manifest matches the files, so a half-written checkpoint (the
process was killed mid-write) is never loaded: the previous valid one is used instead. A
checkpoint renamed into place is complete even if the process died before ``latest`` was
updated, so the newest valid checkpoint wins over the one ``latest`` names.

Pruning keeps the checkpoint just written plus the newest ``keep − 1`` complete ones older than
it. Directories numbered above it are left alone: they can only be leftovers of a session that
crashed after a resume from an earlier checkpoint (they failed validation), and counting them
would delete the newest complete checkpoint.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from sdp_cli.errors import UserError
from sdp_cli.faults import fault_point
from sdp_cli.fileio import atomic_write_text, default_dir_mode, fsync_directory, written_by_safetensors
from sdp_cli.rundir import LATEST, STEP_GLOB, parse_step_name, step_dirs, step_name

MANIFEST = "manifest.json"
FORMAT = "sdp-checkpoint"
FORMAT_VERSION = 1


@dataclass
class Checkpoint:
    """A validated checkpoint on disk."""

    path: Path
    step: int
    state: dict[str, Any]
    optimizer_tensors: dict[str, torch.Tensor]

    @property
    def policy_dir(self) -> Path:
        return self.path / "policy"


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def flatten_optimizer_state(state: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Split ``optimizer.state_dict()`` into tensors (for safetensors) and JSON-safe rest."""
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for pid, entries in state["state"].items():
        for name, value in entries.items():
            if isinstance(value, torch.Tensor):
                tensors[f"state.{pid}.{name}"] = value.detach().cpu().contiguous()
            else:
                scalars.setdefault(str(pid), {})[name] = value
    groups = json.loads(json.dumps(state["param_groups"], default=list))
    return tensors, {"scalars": scalars, "param_groups": groups}


def unflatten_optimizer_state(tensors: dict[str, torch.Tensor], rest: dict[str, Any]) -> dict[str, Any]:
    """Inverse of :func:`flatten_optimizer_state`."""
    state: dict[int, dict[str, Any]] = {}
    for key, value in tensors.items():
        _, pid, name = key.split(".", 2)
        state.setdefault(int(pid), {})[name] = value
    for pid, entries in rest["scalars"].items():
        state.setdefault(int(pid), {}).update(entries)
    groups = rest["param_groups"]
    for group in groups:
        if isinstance(group.get("betas"), list):
            group["betas"] = tuple(group["betas"])
    return {"state": state, "param_groups": groups}


def trainer_parts(trainer_state: dict[str, Any]) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """``Trainer.state_dict(model=False)`` as a checkpoint stores it: the optimizer state (for
    ``write_checkpoint``; None when not saved) and the JSON ``trainer`` entry of ``state.json``."""
    assert trainer_state.get("model") is None, "the policy directory holds the weights, not state.json"
    entry = {
        "version": int(trainer_state["version"]),
        "generator": trainer_state["generator"].tolist(),
        "torch_rng": trainer_state["torch_rng"].tolist(),
    }
    return trainer_state["optimizer"], entry


def trainer_state(checkpoint: Checkpoint) -> dict[str, Any]:
    """The checkpoint's trainer state for ``Trainer.load_state_dict`` (inverse of
    :func:`trainer_parts`; the weights come from the policy directory)."""
    entry, optimizer = checkpoint.state["trainer"], checkpoint.state["optimizer"]
    return {
        "model": None,
        "optimizer": unflatten_optimizer_state(checkpoint.optimizer_tensors, optimizer) if optimizer is not None else None,
        "generator": torch.tensor(entry["generator"], dtype=torch.uint8),
        "torch_rng": torch.tensor(entry["torch_rng"], dtype=torch.uint8),
        "version": int(entry["version"]),
    }


def write_checkpoint(
    root: Path,
    step: int,
    *,
    save_policy: Callable[[Path], None],
    optimizer_state: dict[str, Any] | None,
    state: dict[str, Any],
    keep: int = 2,
) -> Path:
    """Write checkpoint ``step`` under ``root`` atomically, then prune older ones (module docstring).

    ``optimizer_state=None`` writes no optimizer state (``state.json`` records null).
    """
    assert keep >= 1, f"keep must be >= 1 (the checkpoint just written stays), got {keep}"
    from safetensors.torch import save_file

    root.mkdir(parents=True, exist_ok=True)
    name = step_name(step)
    final = root / name
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=root))
    try:
        save_policy(tmp / "policy")
        fault_point("checkpoint.policy")
        opt_rest = None
        if optimizer_state is not None:
            tensors, opt_rest = flatten_optimizer_state(optimizer_state)
            with written_by_safetensors(tmp / "optimizer.safetensors"):
                save_file(tensors, str(tmp / "optimizer.safetensors"), metadata={"format": FORMAT})
        fault_point("checkpoint.optimizer")
        payload = {"format": FORMAT, "format_version": FORMAT_VERSION, "step": step, "optimizer": opt_rest, **state}
        (tmp / "state.json").write_text(json.dumps(payload))
        fault_point("checkpoint.state")
        files = sorted(p for p in tmp.rglob("*") if p.is_file())
        for path in files:
            _fsync_file(path)
        manifest = {
            "format": FORMAT,
            "step": step,
            "files": {str(p.relative_to(tmp)): {"size": p.stat().st_size, "sha256": _sha256(p)} for p in files},
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
        _fsync_file(tmp / MANIFEST)
        for directory in sorted({p.parent for p in files} | {tmp}, key=lambda p: -len(p.parts)):
            fsync_directory(directory)
        tmp.chmod(default_dir_mode())  # mkdtemp makes it owner-only
        fault_point("checkpoint.manifest")
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
        fsync_directory(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fault_point("checkpoint.renamed")
    atomic_write_text(root / LATEST, name + "\n")
    fault_point("checkpoint.latest")
    _prune(root, step, keep)
    return final


def _step_of(path: Path) -> int | None:
    try:
        return int(path.name.split("-", 1)[1])
    except (IndexError, ValueError):
        return None


def _prune(root: Path, step: int, keep: int) -> None:
    """Delete checkpoints older than ``step`` beyond the newest ``keep − 1`` complete ones."""
    older = sorted(
        ((n, p) for p in root.glob(STEP_GLOB) if p.is_dir() and (n := _step_of(p)) is not None and n < step),
        reverse=True,
    )
    # A directory is renamed into place only after its manifest is written: complete.
    kept = [p for _, p in older if (p / MANIFEST).is_file()][: keep - 1]
    for _, old in older:
        if old not in kept:
            shutil.rmtree(old, ignore_errors=True)


def _is_valid(path: Path) -> bool:
    manifest_path = path / MANIFEST
    try:
        manifest = json.loads(manifest_path.read_text())
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
            return False
        for rel, meta in manifest["files"].items():
            file = path / rel
            if not file.is_file() or file.stat().st_size != meta["size"] or _sha256(file) != meta["sha256"]:
                return False
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError):  # a file sdp did not write
        return False
    return True


def is_complete(path: Path) -> bool:
    """Whether ``path`` is a checkpoint whose files all match its manifest."""
    return _is_valid(path)


def find_latest(root: Path) -> Path | None:
    """The valid checkpoint of the highest step under ``root``, or None.

    ``latest`` is not trusted: a process killed between renaming a checkpoint into place and
    updating ``latest`` leaves it naming the previous one. A live run (read by ``sdp export``)
    may write a newer checkpoint and prune (remove in place) the ones listed while they are
    checked: when none listed was complete and the listing has changed meanwhile, it is checked
    again (a live run always has one complete checkpoint).
    """
    listed = step_dirs(root)
    for _ in range(_LISTINGS):
        for _, path in reversed(listed):
            if _is_valid(path):
                return path
        again = step_dirs(root)
        if again == listed:
            return None
        listed = again
    return None


#: listings ``find_latest`` makes while checkpoints go as it checks them (each check is
#: milliseconds; a run writes a checkpoint in no less)
_LISTINGS = 20


def step_of(path: Path) -> int:
    """The step a checkpoint directory is named for (``step-000050`` → 50)."""
    step = parse_step_name(path.name)
    assert step is not None, f"{path} is not a checkpoint directory"
    return step


def read_checkpoint(path: Path) -> Checkpoint:
    """Load a checkpoint directory that passed validation."""
    from safetensors.torch import load_file

    if not _is_valid(path):
        raise UserError(f"{path}: checkpoint is incomplete or corrupted; resume from an earlier one")
    try:
        state = json.loads((path / "state.json").read_text())
        if state.get("format") != FORMAT or not {"trainer", "loop", "optimizer"} <= set(state):
            raise ValueError("state.json is not an sdp checkpoint state")
        version = state.get("format_version")
        if type(version) is not int:
            raise ValueError("state.json has no integer format_version")
        if version < FORMAT_VERSION:
            raise ValueError(f"state.json has format_version {version}, which no sdp wrote")
        if version == FORMAT_VERSION:
            tensors = load_file(str(path / "optimizer.safetensors")) if state["optimizer"] is not None else {}
            return Checkpoint(path=path, step=int(state["step"]), state=state, optimizer_tensors=tensors)
    except Exception as err:  # files that match their manifest but were written by something else
        problem = " ".join(str(err).split())[:200]
        raise UserError(
            f"{path}: checkpoint cannot be read ({type(err).__name__}: {problem}); "
            "move it away to resume from an earlier one"
        ) from None
    # a later sdp's layout may differ in ways this one cannot see, so it is not guessed at
    raise UserError(
        f"{path}: checkpoint format version {version} is newer than this sdp reads ({FORMAT_VERSION}); "
        "upgrade sdp to resume from it, or move it away to resume from an earlier one"
    )


def hold_checkpoint(checkpoint: Path, into: Path) -> bool:
    """Hold the files of the complete ``checkpoint`` in the new directory ``into``, where its run
    cannot remove them: hard links where ``into`` is on the run's file system (instant; a
    checkpoint's files are never rewritten, only pruned), else copies. True when the held files
    pass the held manifest's check; False when the checkpoint went meanwhile (a run that is
    training prunes its older checkpoints) or was not complete. ``into`` is the caller's to remove."""
    try:
        into.mkdir()
        _hold_file(checkpoint / MANIFEST, into / MANIFEST)
        files = json.loads((into / MANIFEST).read_text())["files"]
        for rel in files:
            if Path(rel).is_absolute() or ".." in Path(rel).parts:  # a manifest sdp did not write
                return False
            (into / rel).parent.mkdir(parents=True, exist_ok=True)
            _hold_file(checkpoint / rel, into / rel)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError):
        return False
    return _is_valid(into)


def _hold_file(source: Path, target: Path) -> None:
    try:
        os.link(source, target, follow_symlinks=False)
    except OSError as err:
        if err.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.EOPNOTSUPP):
            raise  # gone (ENOENT) included: the caller looks again
        shutil.copyfile(source, target, follow_symlinks=False)


def remove_stale_temporaries(root: Path) -> None:
    """Delete leftovers of checkpoint writes that were killed midway."""
    for tmp in root.glob(f".tmp-{STEP_GLOB}") if root.is_dir() else []:
        shutil.rmtree(tmp, ignore_errors=True)
