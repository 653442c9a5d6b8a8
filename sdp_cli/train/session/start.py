"""The start of ``sdp train``: checks before anything is written, then the run directory.

A new run's directory is made and locked only after the model, task data and engine settings
passed (:func:`preflight`); a resume locks the directory it is given before reading it
(docs/reliability.md, "One process per directory") and checks the checkpoint, the overrides
and the ledger before it changes anything (sdp_cli/train/session/resume_check.py). What a resume
changes in the directory is returned as ``deferred`` writes, made once setup has accepted it.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from sdp_cli.config.compose import ConfigSource, compose_config, to_yaml
from sdp_cli.config.schema import EngineConfig, SdpConfig
from sdp_cli.config.validation import load_mode
from sdp_cli.dirlock import DirectoryLock
from sdp_cli.engines import engine_kind
from sdp_cli.errors import UserError
from sdp_cli.fileio import atomic_write_text
from sdp_cli.models.gguf import check_gguf_file, is_gguf
from sdp_cli.redact import is_loopback, is_redacted, redact_urls
from sdp_cli.rundir import RunDir
from sdp_cli.tasks import Task
from sdp_cli.train.asyncloop.distributed import Coordinator
from sdp_cli.train.session.checkpoint import Checkpoint
from sdp_cli.train.session.recovery import (
    OwnedRunDir,
    announce_resume_point,
    check_run_files,
    make_run_dir,
    read_overrides,
    resume_point,
)
from sdp_cli.train.session.resume_check import read_for_resume, refuse_structural_changes, write_identity
from sdp_cli.train.session.task_setup import prepare_task
from sdp_cli.train.session.trackers import active_trackers, check_installed


def _launched_python(cfg: SdpConfig) -> str | None:
    """engine.python when sdp launches a server with it and it is not the default."""
    launches = engine_kind(cfg.engine.kind).launches(cfg)
    return cfg.engine.python if launches and cfg.engine.python != EngineConfig().python else None


def _code(value: str | None) -> str | None:
    """A value that names code to import (``module:fn``, ``file.py:fn``); None for a built-in."""
    return value if value is not None and ":" in value else None


#: config keys that name a program to start or code to import, each with the program it names in
#: a config (None: the default, a built-in, or nothing sdp would start). A resume takes them only
#: from its command line, so every resume command sdp prints repeats them (docs/reliability.md,
#: "Security defaults"); a new key of the kind is one entry here.
PROGRAM_KEYS: dict[str, Callable[[SdpConfig], str | None]] = {
    "engine.python": _launched_python,
    "task.reward": lambda cfg: _code(cfg.task.reward),
    "loss.mode": lambda cfg: _code(cfg.loss.mode),
}


def _sets(override: str, key: str) -> bool:
    """Whether the command-line override sets ``key`` (``key=…``, ``+key=…``, ``~key=…``)."""
    return override.lstrip("+~").startswith(f"{key}=")


def refuse_saved_programs(cfg: SdpConfig, saved: list[str], given: list[str], run_dir: RunDir) -> None:
    """A run directory may come from elsewhere: a resume runs a program its files name (through
    overrides.json, config.yaml or a saved --config-dir) only if the command line names it again.
    What sdp's own config groups and this process's environment give (e.g. engine=vllm's
    engine.python from $SDP_VLLM_PYTHON) does not come from the run's files and needs no repeating:
    that is what the run's overrides compose to without their program keys and its config dir."""
    from sdp_cli.config.compose import compose_dict

    def names_program(override: str) -> bool:
        return any(_sets(override, key) for key in PROGRAM_KEYS)

    try:
        trusted = compose_dict([o for o in [*saved, *given] if not names_program(o) and not o.startswith("resume=")])
    except UserError:  # e.g. a task of the run's own config dir: nothing it names is trusted
        trusted = None
    for key, named in PROGRAM_KEYS.items():
        program = named(cfg)
        if program is None or any(_sets(o, key) for o in given):
            continue
        if trusted is None or _select(trusted, key) != program:
            raise UserError(
                f"{run_dir.path}: its saved config sets {key}={program}, which sdp would run; a resume takes "
                f"programs only from the command line: pass {key}=... again if you trust it"
            )


def _select(cfg: Any, key: str) -> Any:
    """``key`` of a composed config, resolved; None where it is unset or does not resolve."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        return OmegaConf.select(cfg, key, default=None)
    except OmegaConfBaseException:
        return None


def bind_warning(cfg: SdpConfig) -> str | None:
    """The warning for a server sdp launches (a remote engine without engine.urls) bound beyond
    loopback — config validation already requires an API key for it — or None."""
    host = cfg.engine.host
    if not engine_kind(cfg.engine.kind).launches(cfg) or is_loopback(host):
        return None
    return (
        f"warning: engine.host={host}: the inference server will accept connections from the network "
        f"(with the key in ${cfg.engine.api_key_env}); use 127.0.0.1 unless other machines must reach it"
    )


@dataclass
class RunStart:
    """A run directory ready for :class:`sdp_cli.train.session.run.TrainingRun`."""

    cfg: SdpConfig
    raw: Any
    run_dir: RunDir
    task: Task
    resuming: bool
    #: the directory and its lock (rank 0 only)
    owned: OwnedRunDir | None
    #: (file, text) a resume writes once setup accepted it: a refused resume rewrites nothing
    deferred: list[tuple[Path, str]] = field(default_factory=list)
    #: the checked checkpoint a resume continues from (None: a new run, or a resume starting over)
    checkpoint: Checkpoint | None = None


def open_run(
    cfg: SdpConfig, raw: Any, overrides: list[str], source: ConfigSource, coordinator: Coordinator
) -> RunStart:
    """Lock and read the directory ``resume=`` names, or make and lock a new one."""
    owned: OwnedRunDir | None = None
    try:
        if cfg.resume:
            run_dir = RunDir(Path(cfg.resume))
            saved = run_dir.overrides
            if not saved.is_file():
                raise UserError(
                    f"{run_dir.path}: not an sdp run directory (no overrides.json); pass the run directory to resume="
                )
            original = read_overrides(saved)  # a directory that is no run gets no lock file
            if coordinator.is_main:
                # Locked before its files are read: a live run's half-written checkpoint is its own
                # business (the lock file itself is opened neither through a link nor as a FIFO).
                owned = OwnedRunDir(run_dir, DirectoryLock.acquire(run_dir.path, "run directory"), created=False)
            found = resume_point(run_dir)  # nothing to resume from: one line, before any output
            check_run_files(run_dir)  # links, special files, damaged logs: before anything is written
            extra = [o for o in overrides if not o.startswith("resume=")]
            source = resume_source(run_dir, source)
            cfg, raw = compose_config([*original, *extra, f"resume={run_dir.path}"], source=source, accepted=original)
            refuse_saved_programs(cfg, original, extra, run_dir)
            if any(is_redacted(url) for url in cfg.engine.urls):
                raise UserError(
                    f"{run_dir.path}: its engine.urls had credentials, which sdp does not store; "
                    "pass engine.urls=[...] again on the command line"
                )
            config = config_dict(raw)
            if extra:
                _, saved_raw = compose_config([*original, f"resume={run_dir.path}"], source=source, accepted=original)
                refuse_structural_changes(run_dir, config_dict(saved_raw), config)
            task = preflight(cfg)
            checkpoint = read_for_resume(run_dir, found, cfg, config, task, speak=coordinator.is_main)
            if coordinator.is_main:
                announce_resume_point(run_dir, found)
                if checkpoint is not None:  # without one, the run starts over and the note says so
                    print(resume_line(run_dir, checkpoint, cfg.train.steps), file=sys.stderr)
            start = RunStart(cfg, raw, run_dir, task, True, owned, checkpoint=checkpoint)
            if extra:
                start.deferred.append((saved, redact_urls(json.dumps([*original, *extra]))))
            start.deferred.append((run_dir.config, redact_urls(to_yaml(raw))))
            return start
        task = preflight(cfg)
        owned = make_run_dir(cfg) if coordinator.is_main else None
        run_dir = RunDir(Path(coordinator.broadcast_json(str(owned.run_dir.path) if owned else None)))
        if coordinator.is_main:
            write_identity(run_dir)
            # credentials in URLs are masked: a resume asks for engine.urls again
            atomic_write_text(run_dir.overrides, redact_urls(json.dumps(overrides)))
            if source != ConfigSource():
                atomic_write_text(run_dir.config_source, source.to_json())
            atomic_write_text(run_dir.config, redact_urls(to_yaml(raw)))
        return RunStart(cfg, raw, run_dir, task, False, owned)
    except BaseException as exc:
        if owned is not None:
            owned.remove(exc) if owned.created else owned.lock.release()
        raise


def resume_line(run_dir: RunDir, checkpoint: Checkpoint, steps: int) -> str:
    """The line a resume starts its output with, shown with or without the progress display
    (docs/training.md, "What a run prints")."""
    return f"resuming {run_dir.path} from checkpoint {checkpoint.path.name} (step {checkpoint.step} of {steps})"


def preflight(cfg: SdpConfig) -> Task:
    """Refuse what is certain to fail before anything is written (a model that is neither a
    directory nor a hub id, bad task data, a reward function that does not import, an API-key
    variable that is not set) and return the task, ready to sample."""
    if cfg.model.kind == "hf" and is_gguf(cfg.model.path):
        check_gguf_file(cfg.model.path)
    elif cfg.model.kind == "hf":
        from sdp_cli.models.loader import check_hf_model_dir
        from sdp_cli.models.model_dir import resolve_model_dir

        if not resolve_model_dir(cfg.model.path or "").is_dir():
            raise UserError(
                f"model.path={cfg.model.path} is not a directory; pass a Hugging Face model directory or a hub id (org/name)"
            )
        check_hf_model_dir(cfg.model.path)
    check_installed(active_trackers(cfg.run.trackers, cfg.run.tensorboard))
    load_mode(cfg)  # a mode of yours (loss.mode=file.py:fn) is imported and tried here
    task = prepare_task(cfg)
    if (warning := bind_warning(cfg)) is not None:
        print(warning, file=sys.stderr)
    key_env = cfg.engine.api_key_env
    if engine_kind(cfg.engine.kind).server and key_env and not os.environ.get(key_env):
        raise UserError(
            f"engine.api_key_env={key_env}, but that environment variable is empty; "
            "export the key in it or unset engine.api_key_env"
        )
    return task


def config_dict(raw: Any) -> dict[str, Any]:
    """The resolved config as plain data (what config.yaml holds)."""
    from omegaconf import OmegaConf

    return OmegaConf.to_container(raw, resolve=True)  # type: ignore[return-value]


def resume_source(run_dir: RunDir, given: ConfigSource) -> ConfigSource:
    """The config source a run started with; a different one given at the resume is refused."""
    path = run_dir.config_source
    saved = ConfigSource.from_json(path.read_text(), str(path)) if path.is_file() else ConfigSource()
    if given != ConfigSource() and given != saved:
        raise UserError(
            f"{run_dir.path} was started with {saved.config_dir or 'no --config-dir'}; "
            "resume it without --config-dir/--config-name (its own are used)"
        )
    if saved.config_dir is not None and not Path(saved.config_dir).is_dir():
        raise UserError(
            f"{run_dir.path} was started with --config-dir {saved.config_dir}, which is gone; restore it to resume"
        )
    return saved
