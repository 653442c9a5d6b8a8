"""`sdp ablate`: plan a sweep, run it through Hydra's multirun machinery, resume it.

A sweep is a Hydra multirun over the ordinary sdp run config. ``sdp_cli/conf/ablate/<name>.yaml``
is a ``@package _global_`` config that sets the regime (steps, batch, optimiser, the shadow
recompute pass) and, under ``hydra.sweeper.params``, the axes (``+preset`` = the correction mode,
``rollout.max_head_offpolicyness`` = η, ``seed``). A job is one ``sdp train`` run whose overrides
are the job's Hydra overrides plus ``run.dir=<sweep>/runs/<name>``, so ``overrides.json`` in a run
directory is a complete recipe for ``sdp train``.

``plan_sweep`` expands the axes exactly as Hydra's ``BasicSweeper`` does (command-line values
replace an axis of the same key), composes every value of every axis and every run that already
exists, and classifies each run directory, all before anything starts. ``run_sweep`` then starts
``python -m sdp_cli.ablate.app --multirun ...`` in a subprocess; the configured launcher
(``hydra/launcher=basic|joblib|submitit_slurm|ray``) executes the jobs and each job calls
``run_job``, which skips a finished run (``summary.json`` present), resumes an interrupted one
from its latest checkpoint, or trains a new one. Re-running the same command therefore never
redoes finished work. One sweep process per sweep directory at a time.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from sdp_cli.config.compose import ConfigSource
from sdp_cli.errors import Interrupted, UserError, no_room_behind
from sdp_cli.fileio import atomic_write_text, check_tree, open_fd_in_place
from sdp_cli.rundir import WANDB, RunDir

SWEEP_GROUP = "ablate"
APP_MODULE = "sdp_cli.ablate.app"
RUNS_SUBDIR = "runs"
#: written into the sweep directory when the sweep is signalled: jobs not started yet do not start
STOP_MARKER = ".stopping"
#: the sdp config keys a sweep owns: one run directory per job, never resumed by hand
MANAGED_KEYS = ("run.dir", "run.root", "run.name", "resume")
MODE_KEY = "+preset"
MAX_HEAD_OFFPOLICYNESS_KEY = "rollout.max_head_offpolicyness"
SEED_KEY = "seed"
_MAX_NAME = 120
# what stays in a run name: characters Hydra accepts unquoted in `resume=<dir>` (no '=' or ',')
_UNSAFE = re.compile(r"[^A-Za-z0-9._@+-]")

#: `sdp train resume=<run dir>` re-composes with the path unquoted: these would break it
_FORBIDDEN_IN_DIR = "'=,"

# Run states, in the order a sweep moves a run through them.
NEW, PARTIAL, RESUMABLE, FINISHED = "new", "partial", "resumable", "finished"


# ------------------------------------------------------------------ naming
def split_override(override: str) -> tuple[str, str]:
    """``key=value`` → ``(key, value)``; the key keeps its ``+``/``~`` prefix."""
    key, sep, value = override.partition("=")
    assert sep, f"override without '=': {override!r}"
    return key, value


def run_name(overrides: Sequence[str]) -> str:
    """The run directory name of a job: mode, η, the other overrides (sorted), seed.

    ``+ablate=...`` and ``run.dir=...`` are left out (the sweep directory names the sweep).
    ``[+preset=decoupled, rollout.max_head_offpolicyness=4, seed=2]`` → ``decoupled-eta4-seed2``,
    ``optim.lr=3e-4`` adds ``optim.lr@3e-4``; a name longer than 120 characters is cut and
    suffixed with a hash of the whole.
    """
    mode = offpolicyness = seed = None
    others = []
    for override in overrides:
        key, value = split_override(override)
        bare = key.lstrip("+~")
        if bare in (SWEEP_GROUP, "run.dir"):
            continue
        if key == MODE_KEY:
            mode = value
        elif key == MAX_HEAD_OFFPOLICYNESS_KEY:
            offpolicyness = f"eta{value}"
        elif key == SEED_KEY:
            seed = f"seed{value}"
        else:
            others.append(f"{bare}@{value}")
    parts = [p for p in (mode, offpolicyness, *sorted(others), seed) if p is not None]
    name = _UNSAFE.sub("_", "-".join(parts)) or "run"
    if len(name) > _MAX_NAME:
        digest = hashlib.sha256(name.encode()).hexdigest()[:12]
        name = f"{name[: _MAX_NAME - 13]}-{digest}"
    return name


# -------------------------------------------------------------- run states
def run_state(run_dir: Path) -> str:
    """``finished`` (summary.json), ``resumable`` (a complete checkpoint), ``partial`` (started,
    nothing to resume from) or ``new``."""
    layout = RunDir(run_dir)
    if layout.finished:
        return FINISHED
    if not run_dir.is_dir() or not any(run_dir.iterdir()):
        return NEW
    from sdp_cli.train.session import checkpoint as ckpt

    return RESUMABLE if ckpt.find_latest(layout.checkpoints) is not None else PARTIAL


# ------------------------------------------------------------------ sweeps
def available_sweeps() -> list[str]:
    """Names of the sweep definitions shipped in ``sdp_cli/conf/ablate``."""
    folder = resources.files("sdp_cli.conf").joinpath(SWEEP_GROUP)
    return sorted(p.name[: -len(".yaml")] for p in folder.iterdir() if p.name.endswith(".yaml"))


def default_sweep_dir(sweep: str) -> Path:
    """Where a sweep writes when no directory is given: ``runs/ablate/<sweep>``."""
    return Path("runs") / "ablate" / sweep


def mode_label(config: dict[str, Any], overrides: Sequence[str] = ()) -> str:
    """The correction a run trains with, as reports and studies name it: with a drift clip
    ``segment_wise_drift(κ=…)`` (docs/math.md §1.1), so that each κ is a mode of its own; else the
    ``+preset`` the run was given when it names a correction other than its mode (the field's
    presets ``gspo``, ``m2po``, ``icepop``, … train ``mode=decoupled`` with their own options,
    docs/math.md §9); else ``loss.mode`` (the registered name of a mode of yours)."""
    loss = config["loss"]
    kappa = loss.get("drift_clip")
    if kappa is not None:
        return f"{loss['mode']}_drift(κ={float(kappa):g})"
    mode = str(loss["mode"])
    if ":" in mode:  # a mode of yours, named by its function (sdp_cli/modes.py)
        mode = mode.rpartition(":")[2]
    preset = next((split_override(o)[1] for o in overrides if split_override(o)[0] == MODE_KEY), None)
    return preset if preset is not None and preset != mode else mode


@dataclass(frozen=True)
class Job:
    """One run of the sweep: its overrides (as Hydra passes them to the job) and its directory."""

    overrides: tuple[str, ...]
    name: str
    run_dir: Path
    state: str

    def train_overrides(self) -> list[str]:
        """What the job hands to ``sdp train``."""
        return [*self.overrides, f"run.dir={quote(self.run_dir)}"]


def quote(path: Path) -> str:
    """A path as a quoted Hydra override value (paths may hold spaces)."""
    text = str(path)
    assert not set(text) & set(_FORBIDDEN_IN_DIR), f"unchecked sweep directory {text!r}"
    return f"'{text}'"


@dataclass
class SweepPlan:
    """A validated sweep: every job, its run state, and how to launch the multirun."""

    sweep: str
    sweep_dir: Path
    jobs: list[Job]
    job_overrides: list[str]
    hydra_overrides: list[str]
    axes: dict[str, list[str]] = field(default_factory=dict)
    source: ConfigSource = ConfigSource()
    #: the training modes the sweep's runs have, as the report labels them (``mode_label``)
    modes: set[str] = field(default_factory=set)

    def count(self, state: str) -> int:
        return sum(1 for job in self.jobs if job.state == state)

    def command(self) -> list[str]:
        """The multirun command line (run from any working directory)."""
        source = []
        if self.source.config_dir is not None:  # the app's jobs read them back (run_job's source)
            source = ["--config-dir", self.source.config_dir, "--config-name", self.source.config_name]
        return [
            sys.executable,
            "-m",
            APP_MODULE,
            *source,
            "--multirun",
            f"+{SWEEP_GROUP}={self.sweep}",
            f"hydra.sweep.dir={quote(self.sweep_dir)}",
            *self.hydra_overrides,
            *self.job_overrides,
        ]


def _is_hydra_override(override: str) -> bool:
    key = override.partition("=")[0].lstrip("+~")
    return key == "hydra" or key.startswith(("hydra.", "hydra/"))


def _parse_overrides(overrides: Sequence[str]) -> list[Any]:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        return OverridesParser.create().parse_overrides(list(overrides))
    except Exception as exc:  # a malformed override: one line naming it
        first = next((line for line in str(exc).splitlines() if line.strip()), str(exc))
        raise UserError(
            f"cannot parse override: {first.strip()} (use key=value or key=a,b,c)"
        ) from None


def _sweeper_params(
    sweep: str, plain: list[str], hydra_overrides: list[str], source: ConfigSource
) -> dict[str, str]:
    """``hydra.sweeper.params`` of the composed sweep (hydra overrides applied)."""
    from hydra import compose
    from omegaconf import OmegaConf

    from sdp_cli.config.compose import hydra_initialized

    try:
        with hydra_initialized(source) as search:
            cfg = compose(
                config_name=source.config_name,
                overrides=[*search, f"+{SWEEP_GROUP}={sweep}", *plain, *hydra_overrides],
                return_hydra_config=True,
            )
    except Exception as exc:
        first = next((line for line in str(exc).splitlines() if line.strip()), str(exc))
        raise UserError(
            f"cannot apply {' '.join(hydra_overrides) or 'the sweep'}: {first.strip()}"
        ) from None
    params = OmegaConf.to_container(cfg.hydra.sweeper.params, resolve=True) or {}
    return {str(k): str(v) for k, v in params.items()}


def _expand(params: dict[str, str], job_overrides: list[str]) -> list[list[str]]:
    """Every job's overrides, in the order and form Hydra's BasicSweeper produces them."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper

    parsed = _parse_overrides([*(f"{k}={v}" for k, v in params.items()), *job_overrides])
    try:
        (batch,) = BasicSweeper.split_arguments(parsed, max_batch_size=None)
    except Exception as exc:
        raise UserError(f"cannot expand the sweep: {str(exc).splitlines()[0]}") from None
    return batch


def _comparable(yaml_text: str, where: str | Path) -> dict[str, Any]:
    from sdp_cli.config.limits import load_yaml_text

    data = load_yaml_text(yaml_text, where) or {}
    data.pop("resume", None)
    return data


def _first_difference(old: Any, new: Any, prefix: str = "") -> str | None:
    """The first key whose value differs. Keys only one side has are skipped: a newer sdp may add
    config keys (or drop some) without changing what an existing run means."""
    if isinstance(old, dict) and isinstance(new, dict):
        for key in sorted(set(old) & set(new), key=str):
            found = _first_difference(old[key], new[key], f"{prefix}{key}.")
            if found:
                return found
        return None
    return None if old == new else f"{prefix.rstrip('.')}: {old!r} → {new!r}"


def _check_same_config(run_dir: Path, planned_yaml: str) -> None:
    saved = RunDir(run_dir).config
    if not saved.is_file():
        return
    from sdp_cli.config.limits import read_yaml_file

    diff = _first_difference(_comparable(read_yaml_file(saved), saved), _comparable(planned_yaml, "the planned config"))
    if diff:
        raise UserError(
            f"{run_dir} was trained with a different config ({diff}); "
            "pass a new sweep directory with --dir, or delete that run"
        )


def plan_sweep(
    sweep: str, overrides: Sequence[str], sweep_dir: Path | None = None, *, source: ConfigSource = ConfigSource()
) -> SweepPlan:
    """Validate the sweep and every job's config; classify each run directory.

    ``overrides``: sdp config overrides (a comma list or ``range(...)`` makes or replaces an axis)
    and Hydra overrides (``hydra/launcher=joblib``, ``hydra.launcher.n_jobs=2``). ``source``:
    the user's config directory and primary config (``--config-dir``/``--config-name``).
    """
    from sdp_cli.config.compose import compose_config, to_yaml
    from sdp_cli.config.scopes import unread_keys

    sweeps = available_sweeps()
    if sweep not in sweeps:
        raise UserError(
            f"unknown sweep '{sweep}'; choose one of {', '.join(sweeps)} "
            "(files in sdp_cli/conf/ablate)"
        )
    from sdp_cli.config.limits import check_override_sizes

    check_override_sizes(list(overrides))  # before any parse: Hydra's grammar is quadratic in items
    hydra_overrides = [o for o in overrides if _is_hydra_override(o)]
    job_overrides = [o for o in overrides if not _is_hydra_override(o)]
    for parsed in _parse_overrides(job_overrides):
        key = parsed.get_key_element().lstrip("+~")
        if key in MANAGED_KEYS:
            raise UserError(
                f"{key} is set by the sweep (one run directory per job); "
                "use --dir DIR to choose where the sweep writes"
            )
        if key == SWEEP_GROUP:
            raise UserError(
                f"choose the sweep as the first argument (sdp ablate NAME), not with {key}="
            )
    plain = [
        str(o.input_line) for o in _parse_overrides(job_overrides) if not o.is_sweep_override()
    ]
    # a bad key or value gets sdp train's own message; whether a run reads a key is judged over
    # the jobs below (a sweep over model.lora.r or engine= may set keys only some of its runs read)
    compose_config([f"+{SWEEP_GROUP}={sweep}", *plain], source=source, accepted=plain)
    params = _sweeper_params(sweep, plain, hydra_overrides, source)
    expanded = _expand(params, [f"+{SWEEP_GROUP}={sweep}", *job_overrides])

    root = (sweep_dir or default_sweep_dir(sweep)).expanduser().resolve()
    if set(str(root)) & set(_FORBIDDEN_IN_DIR):
        raise UserError(
            f"{root}: a sweep directory must not contain any of {' '.join(_FORBIDDEN_IN_DIR)}; "
            "choose another --dir"
        )
    jobs: list[Job] = []
    modes: set[str] = set()
    seen: dict[str, tuple[str, ...]] = {}
    unread_everywhere: dict[str, str] | None = None  # keys no run composed below reads
    for job_list in expanded:
        name = run_name(job_list)
        assert name not in seen, (
            f"two jobs map to run directory {name}: {seen[name]} and {job_list}"
        )
        seen[name] = tuple(job_list)
        run_dir = root / RUNS_SUBDIR / name
        job = Job(tuple(job_list), name, run_dir, run_state(run_dir))
        # Jobs that differ from the first in at most one axis hold every value of every axis, so
        # composing them finds any bad value; a run that exists must match its planned config.
        if sum(a != b for a, b in zip(job_list, expanded[0], strict=True)) <= 1 or job.state != NEW:
            try:
                typed, raw = compose_config(job.train_overrides(), source=source, accepted=job.train_overrides())
            except UserError as err:
                raise UserError(f"run {name}: {err}") from None
            unread = unread_keys(typed, job.train_overrides())
            if unread_everywhere is None:
                unread_everywhere = unread
            else:
                unread_everywhere = {k: v for k, v in unread_everywhere.items() if k in unread}
            modes.add(mode_label({"loss": {"mode": typed.loss.mode, "drift_clip": typed.loss.drift_clip}}, job_list))
            _check_same_config(run_dir, to_yaml(raw))
        jobs.append(job)
    if unread_everywhere:
        raise UserError(f"{next(iter(unread_everywhere.values()))} (no run of the sweep reads it)")

    final: dict[str, Any] = {}
    for parsed in _parse_overrides([*(f"{k}={v}" for k, v in params.items()), *job_overrides]):
        final[parsed.get_key_element()] = parsed  # a later value of a key replaces the earlier one
    axes = {
        key: [str(v) for v in o.sweep_string_iterator()]
        for key, o in final.items()
        if o.is_sweep_override()
    }
    return SweepPlan(sweep, root, jobs, job_overrides, hydra_overrides, axes, source, modes)


def run_sweep(plan: SweepPlan) -> int:
    """Run the multirun in a subprocess (its output goes to this process's stdout/stderr) and
    return its exit code. Jobs whose run is finished return at once.

    The multirun gets a process group of its own, and SIGINT and SIGTERM sent to this process
    are forwarded to that group once each (a Ctrl-C at the terminal reaches only this process,
    so a job never sees one Ctrl-C as two); the jobs stop at a step boundary with a checkpoint
    and are waited for, then :class:`Interrupted` says how to resume (docs/reliability.md,
    "Signals"). The caller holds the sweep directory's lock."""
    from sdp_cli.stopsignals import handling, signal_name

    env = dict(os.environ)
    # joblib's worker processes would otherwise start as many BLAS threads as cores each
    env.setdefault("OMP_NUM_THREADS", "1")
    received: list[int] = []
    marker = plan.sweep_dir / STOP_MARKER
    marker.unlink(missing_ok=True)
    with subprocess.Popen(plan.command(), env=env, start_new_session=True) as process:

        def forward(signum: int) -> None:
            received.append(signum)
            # a launcher with a pool (joblib) would start the next jobs
            os.close(open_fd_in_place(marker, os.O_WRONLY | os.O_CREAT))
            with suppress(ProcessLookupError):
                os.killpg(process.pid, signum)

        with handling(forward):
            code = process.wait()
    marker.unlink(missing_ok=True)
    if received:
        raise Interrupted(
            f"sweep stopped ({signal_name(received[0])}); its runs stopped at a step boundary with a "
            "checkpoint; run the same command again to resume the sweep",
            128 + received[0],
        )
    return code


# --------------------------------------------------------------- job side
@contextmanager
def _outside_hydra() -> Iterator[None]:
    """Hydra's compose API refuses to start inside a running Hydra app. A job composes its run
    config exactly as ``sdp train`` does, so the app's global state steps aside meanwhile."""
    from hydra.core.global_hydra import GlobalHydra

    instance = GlobalHydra.instance()
    saved = instance.hydra
    instance.clear()
    try:
        yield
    finally:
        # initialize_config_module restores a copy of the cleared instance on exit: put ours back
        GlobalHydra.set_instance(instance)
        instance.hydra = saved


def run_job(sweep_dir: Path, overrides: Sequence[str], source: ConfigSource = ConfigSource()) -> str:
    """Train (or resume, or skip) the run of one sweep job; returns what happened.

    Called inside the Hydra app with the job's task overrides. A run without a complete
    checkpoint has nothing to resume and starts again; a failure a user can fix is reported and
    returned, so that the other jobs of the sweep go on.
    """
    from sdp_cli.config.compose import compose_config
    from sdp_cli.stopsignals import StopRequest, handling
    from sdp_cli.train.session.run import run_training

    name = run_name(overrides)
    run_dir = Path(sweep_dir) / RUNS_SUBDIR / name
    job = Job(tuple(overrides), name, run_dir, run_state(run_dir))
    if (Path(sweep_dir) / STOP_MARKER).exists():
        print(f"ablate: {name}: not started, the sweep is stopping", flush=True)
        return "not started"
    if job.state == FINISHED:
        print(f"ablate: {name}: finished earlier, skipped", flush=True)
        return "skipped"
    if job.state == PARTIAL:
        shutil.rmtree(run_dir)
    train = [f"resume={quote(run_dir)}"] if job.state == RESUMABLE else job.train_overrides()
    print(f"ablate: {name}: {'resuming' if job.state == RESUMABLE else 'training'}", flush=True)
    # a signal forwarded by `sdp ablate` while this job sets up is kept for the run to act on
    stop = StopRequest()
    try:
        with handling(stop), _outside_hydra():
            cfg, raw = compose_config(train, source=source, accepted=train)  # judged by the plan
            run_training(cfg, raw, overrides=train, source=source, stop=stop)
    except UserError as err:
        print(f"ablate: {name}: failed: {err}", file=sys.stderr, flush=True)
        if no_room_behind(err) is not None:  # every run after it would fail the same way
            with suppress(OSError):  # a disk too full for an empty file: the next runs fail alone
                os.close(open_fd_in_place(Path(sweep_dir) / STOP_MARKER, os.O_WRONLY | os.O_CREAT))
            print(
                "ablate: the sweep starts no further runs (each would fail on the same write); fix "
                "the cause as the line above says and re-run the same command (finished runs are kept)",
                file=sys.stderr, flush=True,
            )  # fmt: skip
        return f"failed: {err}"
    except Interrupted as err:  # the sweep's stop marker keeps the next jobs from starting
        # returned, not raised: a pool launcher (joblib) would kill the other jobs mid-step
        print(f"ablate: {name}: {err}", file=sys.stderr, flush=True)
        return f"interrupted: {err}"
    return "resumed" if job.state == RESUMABLE else "trained"


def unfinished(plan: SweepPlan) -> list[Job]:
    """The planned jobs whose run directory has no summary.json (now)."""
    return [job for job in plan.jobs if run_state(job.run_dir) != FINISHED]


def prune_checkpoints(plan: SweepPlan) -> int:
    """Delete ``checkpoints/`` of the plan's finished runs (a finished run is never resumed; its
    results stay). Returns the number of run directories pruned."""
    pruned = 0
    for job in plan.jobs:
        folder = RunDir(job.run_dir).checkpoints
        if run_state(job.run_dir) == FINISHED and folder.is_dir():
            shutil.rmtree(folder)
            pruned += 1
    return pruned


def write_plan(plan: SweepPlan) -> Path:
    """Record how the sweep was run in ``<sweep>/ablate.json`` (name, overrides, axes, runs)."""
    path = plan.sweep_dir / "ablate.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {
        "sweep": plan.sweep,
        "overrides": [*plan.hydra_overrides, *plan.job_overrides],
        "config_dir": plan.source.config_dir,
        "config_name": plan.source.config_name,
        "axes": plan.axes,
        "runs": [job.name for job in plan.jobs],
    }
    atomic_write_text(path, json.dumps(data, indent=2) + "\n")  # a rename: never through a link
    return path


def check_sweep_dir(sweep_dir: Path) -> None:
    """Refuse, in one line, a sweep directory that holds a symbolic link or a special file
    anywhere (its runs included; W&B's own directories aside): sdp ablate and its runs would
    write through it (docs/reliability.md, "Links and special files in a run directory")."""
    if sweep_dir.is_dir():
        check_tree(sweep_dir, skip=(WANDB,))
