"""The policy a run saved, as one whole model: a run's newest checkpoint, a given checkpoint, or
a version checkpoint, with LoRA adapters merged onto the base they were trained on (what
``sdp export`` writes out; docs/real-models.md, "Exporting a trained model").

A full fine-tuning checkpoint's ``policy/`` is already a whole model (the float32 master
weights, config and tokenizer); a version checkpoint holds the weights the engine ran. Under
LoRA both hold only the adapters (``train/session/policy_setup.py``). Their base is ``versions/base``
when the run kept version checkpoints (written in ``train.dtype``, the dtype the base trained
in), else it is rebuilt from the run's config as a resume rebuilds it (``model.path``, or the
tiny model's cached warm start) and cast to ``train.dtype``.
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sdp_cli.errors import UserError, WriteFailed, write_fix
from sdp_cli.rundir import RunDir, run_part

SOURCE_FIX = "pass a run directory, one of its checkpoints/step-NNNNNN or one of its versions/vNNNNNN"

#: how many times ``held`` looks for a run's newest checkpoint again when the run pruned the one it found
HOLD_ATTEMPTS = 5


@dataclass(frozen=True)
class SavedPolicy:
    """Where a saved policy is: its directory (a whole model or adapters) and its run."""

    policy_dir: Path
    run: RunDir
    #: what it is, for messages: "checkpoint step-000040" or "version v000012"
    name: str
    #: the checkpoint directory holding ``policy_dir`` (None: a version directory, which its run keeps)
    checkpoint: Path | None = None
    #: whether ``checkpoint`` was chosen as the run's newest (another may be chosen if it goes)
    newest: bool = False


def find_saved_policy(source: str | Path) -> SavedPolicy:
    """The saved policy ``source`` names: a run directory (its newest complete checkpoint), a
    checkpoint directory or a version directory. One-line UserError for anything else."""
    from sdp_cli.train.session.checkpoint import find_latest, is_complete

    path = Path(source).expanduser()
    if not path.is_dir():
        raise UserError(f"{path} is not a directory; {SOURCE_FIX}")
    part = run_part(path)
    if part is None:
        raise UserError(f"{path} is no run, checkpoint or version directory of sdp train; {SOURCE_FIX}")
    run, kind = part
    if kind == "run":
        latest = find_latest(run.checkpoints) if run.checkpoints.is_dir() else None
        if latest is None:
            raise UserError(f"{path} has no complete checkpoint; train with train.checkpoint_every > 0, or pass a version directory")
        return SavedPolicy(latest / "policy", run, f"checkpoint {latest.name}", latest, newest=True)
    if kind == "checkpoint":
        if not is_complete(path):
            raise UserError(f"{path} is an incomplete or corrupted checkpoint; pass an earlier one")
        return SavedPolicy(path / "policy", run, f"checkpoint {path.name}", path)
    return SavedPolicy(path, run, f"version {path.name}")


@contextmanager
def held(saved: SavedPolicy, near: Path) -> Iterator[SavedPolicy]:
    """``saved`` with its checkpoint's files held in a temporary directory in ``near`` (or its
    nearest existing parent: nothing is made for a load that fails) for as long as the block
    runs: a run that is training prunes its older checkpoints, and one chosen a moment ago may
    go before it is loaded. A run's newest checkpoint that went is replaced by the newest then;
    a named one that went is refused in one line. A version directory, which its run keeps, is
    not copied."""
    from sdp_cli.train.session.checkpoint import find_latest, hold_checkpoint

    if saved.checkpoint is None:
        yield saved
        return
    existing = next((p for p in (near, *near.parents) if p.is_dir()), Path.cwd())
    try:
        root = Path(tempfile.mkdtemp(prefix=".sdp-hold-", dir=existing))
    except OSError as err:
        raise WriteFailed(f"cannot write in {existing} ({err.strerror}); {write_fix(err)} or choose another place", err, existing) from None
    try:
        checkpoint = saved.checkpoint
        for attempt in range(HOLD_ATTEMPTS):
            into = root / str(attempt)
            if hold_checkpoint(checkpoint, into):
                yield dataclasses.replace(saved, policy_dir=into / "policy", name=f"checkpoint {checkpoint.name}")
                return
            if not saved.newest:
                raise UserError(
                    f"{checkpoint} was removed while it was read (its run is training and keeps only its newest "
                    "checkpoints); pass the run directory to take its newest one"
                )
            checkpoint = find_latest(saved.run.checkpoints)
            if checkpoint is None:
                raise UserError(f"{saved.run.path}: its checkpoints were removed while they were read; try again")
        raise UserError(
            f"{saved.run.path}: its newest checkpoint was removed {HOLD_ATTEMPTS} times while it was read "
            "(the run writes checkpoints faster than they can be held); try again, or pass a version directory"
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)


def load_saved_policy(saved: SavedPolicy) -> Any:
    """The whole policy (``models.policy.Policy``) of ``saved``, in the dtype it was saved or
    trained in, adapters merged (module docstring)."""
    from sdp_cli.models import load_policy
    from sdp_cli.models.lora import is_adapter_dir, load_merged

    if not is_adapter_dir(saved.policy_dir):
        return load_policy("hf", path=saved.policy_dir, dtype="auto")
    base = saved.run.version_base
    policy = load_policy("hf", path=base, dtype="auto") if base.is_dir() else _base_from_config(saved.run)
    policy.model = load_merged(policy.model, saved.policy_dir)
    return policy


def _base_from_config(run: RunDir) -> Any:
    """The LoRA base as a resume of ``run`` loads it: the run's config composed again from its
    overrides (and its --config-dir), then ``train.dtype``, which the base trains in."""
    from sdp_cli.config.compose import ConfigSource, compose_config
    from sdp_cli.models.precision import DTYPES
    from sdp_cli.train.session.policy_setup import load_policy_from
    from sdp_cli.train.session.recovery import read_overrides
    from sdp_cli.train.session.start import resume_source
    from sdp_cli.train.session.task_setup import prepare_task

    saved = read_overrides(run.overrides)
    cfg, _ = compose_config(saved, source=resume_source(run, ConfigSource()), accepted=saved)
    policy = load_policy_from(cfg, prepare_task(cfg))
    policy.model.to(DTYPES[cfg.train.dtype])
    return policy
