"""What a resume checks before it changes anything in the run directory (docs/reliability.md,
"What a resume checks").

- The run's identity: a random id written once into ``identity.json`` when the directory is
  made and recorded in every checkpoint. A checkpoint with another id (or none, in a run that
  has one) was copied in from elsewhere and is refused.
- The config: a resume may change only the keys of ``sdp_cli.config.resume_keys``; every other
  change (model, task, loss, rollout, ...) is refused naming the key, and the config a resume
  composes must hash to the ``config_hash`` its checkpoint was trained with.
- The model: the checkpoint's policy must have the parameter names and shapes of the model
  the config builds (``sdp_cli.train.session.model_shape``).
- The ledger: present, at least as long as the offset the checkpoint recorded, whole JSON
  lines up to it, those bytes the sha256 the checkpoint recorded, each line an event sdp
  writes, and the fates they give, with the groups the snapshot holds and had in flight, one
  per group id below its ``next_group_id`` (``sdp_cli.train.asyncloop.ledger.audit``).

Every refusal is one ``UserError`` line raised before anything is written, so a refused resume
leaves every file of the run as it was. Runs made by an sdp without identities (no
``identity.json``, checkpoints without a ``run`` stamp) resume with a warning.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import sys
from pathlib import Path
from typing import Any

from sdp_cli.config.resume_keys import changed_keys, config_hash
from sdp_cli.config.schema import SdpConfig
from sdp_cli.errors import UserError
from sdp_cli.fileio import atomic_write_text
from sdp_cli.rundir import RunDir
from sdp_cli.tasks import Task
from sdp_cli.train.session import checkpoint as ckpt
from sdp_cli.train.asyncloop.ledger import audit_events, parse_events

#: the key of ``state.json`` that holds a checkpoint's run id and config hash
STAMP = "run"


def write_identity(run_dir: RunDir) -> str:
    """Give a new run directory its id (once, when it is made); returns it."""
    run_id = secrets.token_hex(16)
    atomic_write_text(run_dir.identity, json.dumps({"run_id": run_id}) + "\n")
    return run_id


def read_identity(run_dir: RunDir) -> str | None:
    """The run's id, or None for a run made before runs had one."""
    path = run_dir.identity
    if not path.exists():
        return None
    try:
        run_id = json.loads(path.read_text())["run_id"]
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, RecursionError):
        run_id = None
    if not isinstance(run_id, str) or not run_id:
        raise UserError(f"{path} is not what sdp wrote there; restore it, or start a new run")
    return run_id


def stamp(run_id: str | None, config: dict[str, Any]) -> dict[str, Any]:
    """What a checkpoint records about the run it belongs to (``state.json``'s ``run``)."""
    return {"run_id": run_id, "config_hash": config_hash(config)}


def _shown(value: Any) -> str:
    return "unset" if value is None else json.dumps(value, default=str)


def refuse_structural_changes(run_dir: RunDir, saved: dict[str, Any], resumed: dict[str, Any]) -> None:
    """One line naming the first key whose change a resume does not allow."""
    changed = changed_keys(saved, resumed)
    if not changed:
        return
    key = changed[0]
    old, new = _value(saved, key), _value(resumed, key)
    more = f" (and {len(changed) - 1} more key(s))" if len(changed) > 1 else ""
    raise UserError(
        f"{run_dir.path}: a resume cannot change {key} ({_shown(old)} -> {_shown(new)}){more}; it changes what "
        "is trained: start a new run instead (a resume may change train.steps, logging, evaluation, "
        "checkpointing and engine connection keys; docs/reliability.md)"
    )


def _value(config: dict[str, Any], key: str) -> Any:
    for part in key.split("."):
        if not isinstance(config, dict) or part not in config:
            return None
        config = config[part]
    return config


def check_checkpoint(
    run_dir: RunDir, checkpoint: ckpt.Checkpoint, cfg: SdpConfig, config: dict[str, Any], task: Task, *, speak: bool
) -> None:
    """Refuse a checkpoint of another run, of another config, of another model, or one whose
    ledger is gone or cut short; ``speak``: print the warning for a run made by an older sdp."""
    where = checkpoint.path
    run_id = read_identity(run_dir)
    recorded = checkpoint.state.get(STAMP)
    if recorded is None and run_id is None:
        if speak:
            print(
                f"warning: {run_dir.path} was made by an older sdp: its checkpoints carry no run identity or config "
                "hash, so they are not checked against the run",
                file=sys.stderr,
            )
    elif not isinstance(recorded, dict) or recorded.get("run_id") != run_id:
        raise UserError(
            f"{where}: this checkpoint belongs to another run (its run id is not the one in {run_dir.identity.name}); "
            "it was copied in from elsewhere: move it away, or resume the run it came from"
        )
    elif recorded.get("config_hash") != config_hash(config):
        raise UserError(
            f"{where}: trained with another config than the one this resume composes (config hash differs): "
            f"{run_dir.overrides.name} or the config files changed since; restore them, or start a new run instead"
        )
    check_ledger(run_dir, checkpoint, cfg.rollout.group_size)
    if cfg.model.lora.r == 0:
        from sdp_cli.train.session.model_shape import policy_mismatch

        problem = policy_mismatch(cfg, task, checkpoint.policy_dir)
        if problem is not None:
            raise UserError(
                f"{where}: its model is not the one the config builds ({problem}); resume with the model the run "
                "was started with, or start a new run instead"
            )


def check_ledger(run_dir: RunDir, checkpoint: ckpt.Checkpoint, group_size: int) -> None:
    """The ledger must hold, as whole JSON lines of ledger events, the prefix the checkpoint
    recorded, with the recorded sha256 (checkpoints of an sdp before ledger digests have none),
    and account for every group of the checkpoint's snapshot exactly once."""
    loop = checkpoint.state["loop"]
    offset = loop.get("ledger_offset")
    path = run_dir.ledger
    if not offset:
        return
    name, fix = checkpoint.path.name, "restore it, or start a new run (resume changed nothing)"
    if not path.is_file():
        raise UserError(f"{path} is missing, but {name} records {offset} bytes of it; {fix}")
    with open(path, "rb") as fh:
        data = fh.read(offset)
    if len(data) < offset:
        raise UserError(f"{path} holds {len(data)} bytes, fewer than the {offset} that {name} records (it was cut short); {fix}")
    if not data.endswith(b"\n"):
        raise UserError(f"{path} does not end a line at the {offset} bytes {name} records (damaged); {fix}")
    for number, line in enumerate(data.splitlines(), 1):
        try:
            json.loads(line)
        except (ValueError, RecursionError):  # also UnicodeDecodeError
            raise UserError(f"{path}: line {number}, before the end {name} records, is not JSON (damaged); {fix}") from None
    recorded = loop.get("ledger_sha256")
    if recorded is not None and hashlib.sha256(data).hexdigest() != recorded:
        raise UserError(
            f"{path}: its first {offset} bytes are not the ones {name} recorded (their sha256 differs from the one "
            f"{name} records: edited or damaged); {fix}"
        )
    try:
        events = parse_events(data)
    except ValueError as err:
        raise UserError(f"{path}: {err}, not a ledger event sdp writes (damaged); {fix}") from None
    try:
        result = audit_events(events, loop, group_size)
    except (KeyError, TypeError, ValueError):
        raise UserError(f"{checkpoint.path}: its state.json has no loop snapshot sdp wrote; move it away to resume from an earlier one") from None
    if not result.ok:
        raise UserError(
            f"{path} does not account for the groups {name} records ({result.problems()}): edited or damaged; {fix}"
        )


def read_for_resume(
    run_dir: RunDir, found: Path | None, cfg: SdpConfig, config: dict[str, Any], task: Task, *, speak: bool
) -> ckpt.Checkpoint | None:
    """The checkpoint ``found`` (None: the run starts over), read and checked."""
    if found is None:
        return None
    checkpoint = ckpt.read_checkpoint(found)
    check_checkpoint(run_dir, checkpoint, cfg, config, task, speak=speak)
    return checkpoint
