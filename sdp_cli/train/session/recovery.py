"""Creating a run directory, reading back its recipe, and tidying it after a crash.

A crash can leave a JSON-lines log (metrics, events, ledger) with a torn last line, a session that never wrote its end
event, and weight directories and batch files whose writing was killed (``.v*`` and
``.step-*.tmp`` temporaries). Before a resume,
``recover_after_crash`` repairs the first, records the second as a ``crashed`` event and
deletes the third (docs/reliability.md "Crash recovery"); checkpoints are validated separately
(sdp_cli/train/session/checkpoint.py). Once the trainer holds the checkpoint's state,
``discard_past`` deletes the batches, version checkpoints and weights the crashed session wrote
past it.

Before a resume writes anything, ``check_run_files`` refuses a run directory that holds a
symbolic link or a special file, a hard-linked log, and logs damaged before their torn tail
(docs/reliability.md, "Links and special files in a run directory" and "Damaged logs").
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from sdp_cli.config.schema import SdpConfig
from sdp_cli.dirlock import LOCK_NAME, DirectoryLock
from sdp_cli.errors import UserError, WriteFailed, write_fix
from sdp_cli.fileio import check_tree, open_fd_in_place, open_in_place, refuse_in_place
from sdp_cli.modes import resolve_mode
from sdp_cli.rundir import STEP_GLOB, WANDB, RunDir, saved_batches, step_dirs, version_dirs
from sdp_cli.train.session import checkpoint as ckpt
from sdp_cli.train.session.reporting import EventLog
from sdp_cli.train.session.trackers import saved_ids

#: events that end a session; a resume after any other last event follows a crash
END_EVENTS = ("stopped", "interrupted", "aborted", "finished")


@dataclass
class OwnedRunDir:
    """A run directory this process holds the lock of (sdp_cli/dirlock.py)."""

    run_dir: RunDir
    lock: DirectoryLock
    #: whether this process started the run here (a failed start removes what it wrote)
    created: bool
    #: the highest directory this process made for it (the run directory, or a parent such as a
    #: new run.root), None when the run directory was there, empty
    made: Path | None = None

    def remove(self, error: BaseException | None = None) -> None:
        """Undo a start that failed before training on ``error``: remove what the run wrote,
        except its logs when the error's line names one of them (a launched server's log that
        says why it did not start), then the directory if this process made it and nothing is
        left, with the parents it made for it. Logs no line points to (the rollout process's
        start lines, written from the run's first second) go with the rest."""
        path = self.run_dir.path
        kept = [LOCK_NAME] + ([self.run_dir.logs.name] if _names_a_log(error, self.run_dir.logs) else [])
        for child in path.iterdir():
            if child.name not in kept:
                shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()
        self.lock.release()
        if len(kept) == 1:
            (path / LOCK_NAME).unlink(missing_ok=True)
            if self.made is not None:
                for directory in [path, *path.parents]:
                    try:
                        directory.rmdir()
                    except OSError:  # another process put something in a parent meanwhile
                        break
                    if directory == self.made:
                        break


def _has_files(directory: Path) -> bool:
    return directory.is_dir() and any(p.is_file() for p in directory.rglob("*"))


def _names_a_log(error: BaseException | None, logs: Path) -> bool:
    """Whether ``error``'s line points to a file of ``logs`` (by its path, or by its name, as
    "see local_engine.log in the run's logs directory" does)."""
    if error is None or not _has_files(logs):
        return False
    text = str(error)
    return f"{logs}{os.sep}" in text or any(p.name in text for p in logs.rglob("*") if p.is_file())


def make_run_dir(cfg: SdpConfig) -> OwnedRunDir:
    """The new, empty run directory of ``cfg`` (``run.dir``, or ``run.root``/``run.name`` with
    a timestamped default name), locked; refuses one that already holds files, and any path
    that cannot be a directory, in one line."""
    if cfg.run.dir:
        path = Path(cfg.run.dir)
    else:
        name = cfg.run.name or f"{datetime.now():%Y%m%d-%H%M%S}-{resolve_mode(cfg.loss.mode).name}-{cfg.task.name}"
        path = Path(cfg.run.root) / name
    key = "run.dir" if cfg.run.dir else "run.root/run.name"
    try:
        if path.exists() and not path.is_dir():
            raise UserError(f"{key}: {path} exists and is not a directory; choose another run directory")
        if path.is_dir() and any(path.iterdir()):
            if (path / LOCK_NAME).is_file():  # a run that is going on: name its process
                DirectoryLock.acquire(path, "run directory").release()
            raise UserError(
                f"run directory {path} already exists and is not empty; pass run.name=... or resume={path}"
            )
        made = next((p for p in reversed([path, *path.parents]) if not p.exists()), None)
    except UserError:  # (a WriteFailed is an OSError too: said as it is)
        raise
    except OSError as err:
        raise WriteFailed(f"{key}: cannot create the run directory {path} ({err.strerror}); {write_fix(err)}", err, path) from None
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".write-test"  # a read-only file system or directory fails here, not later
        os.close(open_fd_in_place(probe, os.O_WRONLY | os.O_CREAT))
        probe.unlink()
        lock = DirectoryLock.acquire(path, "run directory")
    except (OSError, UserError) as err:  # (a full disk at the lock file's PID: a WriteFailed)
        # a failed start leaves nothing: the directories made, or the lock file written
        if made is not None or (isinstance(err, WriteFailed) and err.filename == str(path / LOCK_NAME)):
            _remove_made(path, made)
        if isinstance(err, UserError):
            raise
        raise WriteFailed(f"{key}: cannot create the run directory {path} ({err.strerror}); {write_fix(err)}", err, path) from None
    return OwnedRunDir(RunDir(path), lock, created=True, made=made)


def _remove_made(path: Path, made: Path | None) -> None:
    """Undo a failed ``make_run_dir``: the probe and the lock file it wrote into ``path``, and
    the directories from ``path`` up to ``made`` (the outermost it made; None: it made none),
    each only while it is empty (nothing of anyone else's goes)."""
    for written in (path / ".write-test", path / LOCK_NAME):
        with contextlib.suppress(OSError):
            written.unlink(missing_ok=True)
    if made is None:
        return
    for directory in [path, *path.parents]:
        try:
            directory.rmdir()
        except OSError:
            return
        if directory == made:
            return


def read_overrides(path: Path) -> list[str]:
    """The overrides a run was started with (``overrides.json``), checked to be what sdp wrote."""
    try:
        overrides = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as err:
        raise UserError(f"{path} cannot be read ({err}); it must hold the JSON list sdp wrote there") from None
    if not isinstance(overrides, list) or not all(isinstance(o, str) for o in overrides):
        raise UserError(f"{path} is not a JSON list of overrides; restore the one sdp wrote there")
    return overrides


def whole_prefix(data: bytes) -> int:
    """The length of ``data`` without the tail a crash tore from an append-only JSON-lines log:
    a last line without its newline, then trailing lines that are not JSON (a half-written line
    that got its newline, the zeros a lost page leaves). Lines before the tail are kept as
    they are."""
    keep = data.rfind(b"\n") + 1 if data and not data.endswith(b"\n") else len(data)
    while keep > 0:
        start = data.rfind(b"\n", 0, keep - 1) + 1
        try:
            json.loads(data[start:keep])
            break
        except (ValueError, RecursionError):  # also UnicodeDecodeError
            keep = start
    return keep


def _drop_torn_line(path: Path) -> None:
    """Cut the torn tail (:func:`whole_prefix`) of a log that :func:`check_run_files` passed."""
    if not path.is_file():
        return
    with open_in_place(path, "r+b") as fh:
        data = fh.read()
        keep = whole_prefix(data)
        if keep != len(data):
            fh.truncate(keep)


def check_run_files(run_dir: RunDir) -> None:
    """Everything a resume reads or writes in place, checked before it writes anything (one
    ``UserError`` line each): no symbolic link or special file anywhere in the run directory
    (``wandb/`` is W&B's own), the lock and the logs regular files of one name, every line of
    ``metrics.jsonl`` and ``events.jsonl`` before its torn tail a JSON object (a metrics row
    with an integer ``step``), and ``trackers.json`` what sdp wrote. The ledger is checked
    against its checkpoint (sdp_cli/train/session/resume_check.py)."""
    check_tree(run_dir.path, skip=(WANDB,))
    for path in (run_dir.lock, run_dir.metrics, run_dir.events, run_dir.ledger):
        refuse_in_place(path)
    for path, row, stepped in ((run_dir.metrics, "a metrics row", True), (run_dir.events, "an event", False)):
        if path.is_file():
            _check_log(path, row, stepped=stepped)
    if run_dir.trackers.exists():
        saved_ids(run_dir.trackers)


def _check_log(path: Path, row: str, *, stepped: bool) -> None:
    """Every line before the torn tail is a JSON object (``row``), with a step number when
    ``stepped``."""
    data = path.read_bytes()
    fix = "fix or delete that line, then resume again (this resume changed nothing)"
    for number, line in enumerate(data[: whole_prefix(data)].split(b"\n"), 1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except (ValueError, RecursionError):  # also UnicodeDecodeError
            raise UserError(f"{path}: line {number} is not JSON (damaged); {fix}") from None
        if not isinstance(value, dict):
            raise UserError(f"{path}: line {number} is {type(value).__name__}, not {row} (damaged); {fix}")
        step = value.get("step")
        if stepped and (type(step) is not int or step < 0):
            raise UserError(f"{path}: line {number} has step {json.dumps(step)[:40]}, not a step number (damaged); {fix}")


def _last_event(path: Path) -> dict[str, Any] | None:
    lines = path.read_text().splitlines() if path.is_file() else []
    return json.loads(lines[-1]) if lines else None


def recover_after_crash(run_dir: RunDir, events: EventLog) -> None:
    """Before a resume: cut lines a crash tore, say in the events that the last session
    crashed, and delete weight directories and batch files whose writing was killed. The
    ledger's tail is cut only past the prefix its checkpoint recorded, which
    ``sdp_cli.train.session.resume_check`` found whole (the resume then truncates it to that
    prefix, sdp_cli/train/asyncloop/ledger.py)."""
    for log in (run_dir.events, run_dir.metrics, run_dir.ledger):
        _drop_torn_line(log)
    last = _last_event(run_dir.events)
    if last is not None and last.get("event") not in END_EVENTS:
        events.write("crashed", last_event=last.get("event"), last_event_time=last.get("time"))
    for parent in (run_dir.weights, run_dir.versions):
        for tmp in parent.glob(".v*") if parent.is_dir() else []:
            shutil.rmtree(tmp, ignore_errors=True)
    for tmp in run_dir.batches.glob(f".{STEP_GLOB}.tmp") if run_dir.batches.is_dir() else []:
        tmp.unlink(missing_ok=True)  # a batch file whose writing was killed (sdp_cli.fileio.stage_bytes)


def discard_past(run_dir: RunDir, step: int, version: int) -> list[str]:
    """Delete the files a crashed session wrote past the point a resume goes on from (``step``,
    the trainer at ``version``; 0 and 0 when it starts over): the saved batches of later steps,
    the version checkpoints of later versions and every weight directory a server loads at an
    update (this session writes its own). They are not the resumed run's: a batch the crashed
    session trained at step 6 holds tokens of its versions, which ``sdp recompute`` would score
    under the resumed session's, and its weights/v000006 outranks the resumed run's v000004 by
    number. The metrics log and TensorBoard are cut back to ``step`` elsewhere, the ledger to its
    checkpoint's length. Returns the batches and version checkpoints removed, relative to the run."""
    removed = []
    for saved, path in saved_batches(run_dir.batches):
        if saved > step:
            _remove_left(path, f"wrote past step {step}")
            removed.append(f"{run_dir.batches.name}/{path.name}")
    for number, paths in version_dirs(run_dir.versions).items():
        for path in paths if number > version else ():
            _remove_left(path, f"wrote past step {step}")
            removed.append(f"{run_dir.versions.name}/{path.name}")
    for paths in version_dirs(run_dir.weights).values():
        for path in paths:
            _remove_left(path, "wrote for its server to load")
    return removed


def _remove_left(path: Path, why: str) -> None:
    """Remove ``path``, which an earlier session ``why``; one line when it cannot be."""
    try:
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    except OSError as err:
        raise WriteFailed(
            f"cannot remove {path}, which an earlier session {why} ({err.strerror}); "
            f"{write_fix(err)}, then resume again",
            err,
            path,
        ) from None


def past_resume_note(discarded: list[str], step: int) -> str:
    """The line a resume prints when :func:`discard_past` removed batches or version checkpoints."""
    shown = ", ".join(discarded[:4]) + (f" and {len(discarded) - 4} more" if len(discarded) > 4 else "")
    return f"note: removed what an earlier session wrote past step {step}, which this run goes on without: {shown}"


def started_here(run_dir: RunDir) -> bool:
    """Whether a session of sdp train started in ``run_dir`` (its events say so): such a run,
    killed before its first checkpoint, is started over by a resume."""
    if not run_dir.events.is_file():
        return False
    with run_dir.events.open(errors="replace") as fh:
        return any('"event": "started"' in line for line in fh)


def resume_point(run_dir: RunDir) -> Path | None:
    """The newest complete checkpoint of ``run_dir``; None when a resume starts the run over
    (it started but never checkpointed). A run whose every checkpoint fails its checks is
    refused. Reads only."""
    found = ckpt.find_latest(run_dir.checkpoints)
    damaged = _damaged_newer(run_dir, found)
    if found is None and damaged:
        raise UserError(
            f"{run_dir.path}: no checkpoint passes its checks ({', '.join(damaged)}); nothing to resume from"
        )
    if found is None and not started_here(run_dir):
        raise UserError(f"{run_dir.path}: no complete checkpoint to resume from; start a new run instead")
    return found


def _damaged_newer(run_dir: RunDir, found: Path | None) -> list[str]:
    """Names of the checkpoint directories newer than ``found`` (they failed their checks)."""
    newest = ckpt.step_of(found) if found is not None else -1
    return [path.name for step, path in step_dirs(run_dir.checkpoints) if step > newest]


def announce_resume_point(run_dir: RunDir, found: Path | None) -> None:
    """Say on stderr that the run starts over, or that newer checkpoints failed their checks."""
    damaged = _damaged_newer(run_dir, found)
    if found is None:  # killed or stopped before its first checkpoint
        print(f"note: {run_dir.path} has no complete checkpoint yet; starting it over", file=sys.stderr)
    elif damaged:
        print(
            f"warning: {run_dir.path}: {', '.join(damaged)} failed its checks (damaged or incomplete); "
            f"resuming from the older {found.name}",
            file=sys.stderr,
        )
