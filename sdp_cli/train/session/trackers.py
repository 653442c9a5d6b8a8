"""Experiment trackers (``run.trackers``; docs/training.md, "Experiment trackers").

TensorBoard, Weights & Biases and MLflow each receive the scalars ``metrics.jsonl`` gets, at the
same steps, and the run's config once. W&B and MLflow are optional extras (``sdp-cli[wandb]``,
``sdp-cli[mlflow]``); where they send data and with which credentials is theirs to read from
their own environment variables (``WANDB_API_KEY``, ``WANDB_MODE``, ``MLFLOW_TRACKING_URI``, ...),
never from sdp's config. The config a tracker receives passes through ``redacted_config``:
values that may hold secrets (``engine.env``, passwords in URLs) are masked, since a tracker
sends them off the machine.

A resumed run continues the same W&B and MLflow runs: their ids are kept in ``trackers.json``
in the run directory. Steps a resume repeats (those after its checkpoint) are written again to
TensorBoard (which purges the old ones) and MLflow (which keeps both values of a step); W&B
refuses steps below its last one, so it keeps the values logged first.

A tracker that fails while training (a server gone) warns once and stops logging; the run goes
on, and ``metrics.jsonl`` keeps every step.
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
import sys
import time
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit, urlunsplit

from sdp_cli.errors import UserError
from sdp_cli.fileio import atomic_write_text
from sdp_cli.rundir import RunDir

#: tracker name → (module it imports, the extra that installs it)
OPTIONAL_PACKAGES = {"wandb": ("wandb", "wandb"), "mlflow": ("mlflow", "mlflow")}
#: what replaces a masked value
REDACTED = "<redacted>"
#: config sections whose values may be secrets (environment variables of a launched server)
_SECRET_SECTIONS = (("engine", "env"),)
#: characters MLflow accepts in a metric name; others (from a reward function's keys) become "_"
_MLFLOW_UNSAFE = re.compile(r"[^A-Za-z0-9_\-. /]")
#: MLflow's limits: entries per log_batch call, characters of a parameter value
_MLFLOW_BATCH = 100
_MLFLOW_PARAM_CHARS = 6000


def active_trackers(trackers: list[str], tensorboard: bool) -> list[str]:
    """``run.trackers`` without duplicates; ``run.tensorboard=false`` (the older switch) removes
    tensorboard."""
    names = list(dict.fromkeys(trackers))
    return [n for n in names if tensorboard or n != "tensorboard"]


def check_installed(trackers: list[str]) -> None:
    """One-line UserError naming the extra to install when a chosen tracker's package is missing."""
    for name in trackers:
        if name in OPTIONAL_PACKAGES:
            module, extra = OPTIONAL_PACKAGES[name]
            if importlib.util.find_spec(module) is None:
                raise UserError(
                    f"run.trackers includes {name}, but the {module} package is not installed; "
                    f"pip install 'sdp-cli[{extra}]', or remove {name} from run.trackers"
                )


def _mask_url(text: str) -> str:
    """``scheme://user:secret@host/...`` → ``scheme://user:<redacted>@host/...``; other text as is."""
    if "://" not in text or "@" not in text:
        return text
    try:
        parts = urlsplit(text)
    except ValueError:
        return text
    if parts.password is None:
        return text
    netloc = f"{parts.username}:{REDACTED}@{parts.netloc.rpartition('@')[2]}"
    return urlunsplit(parts._replace(netloc=netloc))


def redacted_config(config: dict[str, Any]) -> dict[str, Any]:
    """A copy of the config with every value of ``engine.env`` masked and passwords in URLs
    (anywhere) replaced by ``<redacted>``."""

    def walk(node: Any, path: tuple[str, ...]) -> Any:
        if isinstance(node, dict):
            if path in _SECRET_SECTIONS:
                return {key: REDACTED for key in node}
            return {key: walk(value, (*path, str(key))) for key, value in node.items()}
        if isinstance(node, list):
            return [walk(value, path) for value in node]
        return _mask_url(node) if isinstance(node, str) else node

    return walk(config, ())


def flatten(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"loss": {"mode": "x"}}`` → ``{"loss.mode": "x"}`` (lists and empty dicts stay leaves)."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


def finite_scalars(metrics: dict[str, Any]) -> dict[str, float]:
    """The numbers of a metrics row that a tracker can plot (NaN, inf and non-numbers dropped)."""
    return {
        key: float(value)
        for key, value in metrics.items()
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    }


class Tracker(Protocol):
    """One experiment tracker of a run."""

    name: str

    def log(self, step: int, metrics: dict[str, float]) -> None: ...

    def close(self, ok: bool) -> None: ...


class TensorBoardTracker:
    """Scalars to ``<run>/tensorboard`` and the config as text (tab TEXT, tag ``config``); a
    resume purges the steps after its checkpoint."""

    name = "tensorboard"

    def __init__(self, directory: Path, *, config: dict[str, Any], purge_step: int | None = None):
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=str(directory), purge_step=purge_step)
        if purge_step is None:
            # indented: TensorBoard renders the text as Markdown, and this keeps it a code block
            self._writer.add_text("config", "".join(f"    {line}\n" for line in _yaml(config).splitlines()), 0)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            self._writer.add_scalar(key, value, step)

    def close(self, ok: bool) -> None:
        self._writer.close()


class WandbTracker:
    """A W&B run named after the run directory, writing under ``<run>/wandb`` (``WANDB_MODE``
    decides online or offline); its console capture is off, so sdp's display stays intact."""

    name = "wandb"

    def __init__(self, run_dir: RunDir, *, project: str, config: dict[str, Any], run_id: str | None):
        import wandb

        self._run = wandb.init(
            project=project,
            name=run_dir.path.name,
            dir=str(run_dir.path),
            id=run_id,
            resume="allow" if run_id else None,
            config=config,
            settings=wandb.Settings(console="off", save_code=False, silent=True),
        )
        self.run_id = str(self._run.id)
        # a resumed W&B run refuses steps below its last one (with a warning per call)
        self._floor = int(self._run.step or 0)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if step >= self._floor:
            self._run.log(metrics, step=step)

    def close(self, ok: bool) -> None:
        self._run.finish(exit_code=0 if ok else 1)


class MlflowTracker:
    """An MLflow run in experiment ``project`` (the tracking server or store of
    ``MLFLOW_TRACKING_URI``, else MLflow's default): config keys as parameters (on the run's
    first session), config.yaml as an artifact, metrics per step."""

    name = "mlflow"

    def __init__(self, run_dir: RunDir, *, project: str, config: dict[str, Any], run_id: str | None):
        from mlflow import MlflowClient
        from mlflow.entities import Param

        self._client = MlflowClient()
        if run_id is None:
            experiment = self._client.get_experiment_by_name(project)
            experiment_id = experiment.experiment_id if experiment else self._client.create_experiment(project)
            run = self._client.create_run(experiment_id, run_name=run_dir.path.name)
            self.run_id = run.info.run_id
            # parameters are immutable in MLflow, so only the first session logs them
            params = [
                Param(key, _param_text(value)) for key, value in sorted(flatten(config).items())
            ]
            for start in range(0, len(params), _MLFLOW_BATCH):
                self._client.log_batch(self.run_id, params=params[start : start + _MLFLOW_BATCH])
        else:
            self.run_id = run_id
            self._client.update_run(run_id, status="RUNNING")
        self._client.log_text(self.run_id, _yaml(config), "config.yaml")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        stamp = int(time.time() * 1000)
        entries = [Metric(_MLFLOW_UNSAFE.sub("_", k), v, stamp, step) for k, v in sorted(metrics.items())]
        for start in range(0, len(entries), _MLFLOW_BATCH):
            self._client.log_batch(self.run_id, metrics=entries[start : start + _MLFLOW_BATCH])

    def close(self, ok: bool) -> None:
        self._client.set_terminated(self.run_id, status="FINISHED" if ok else "FAILED")


def _param_text(value: Any) -> str:
    from sdp_cli.config.schema import yaml_literal

    return yaml_literal(value)[:_MLFLOW_PARAM_CHARS]


def _yaml(config: dict[str, Any]) -> str:
    import yaml

    return yaml.safe_dump(config, sort_keys=False, allow_unicode=True)


class Trackers:
    """Every tracker of a run, written together. A tracker that raises is reported once on
    stderr and dropped; the others and the run go on."""

    def __init__(self, trackers: list[Tracker], *, stream: Any = None):
        self._trackers = trackers
        self._stream = stream or sys.stderr

    @property
    def names(self) -> list[str]:
        return [t.name for t in self._trackers]

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        scalars = finite_scalars(metrics)
        if scalars:
            self._each(lambda t: t.log(step, scalars), "logging")

    def close(self, ok: bool = True) -> None:
        self._each(lambda t: t.close(ok), "closing")
        self._trackers = []

    def _each(self, call: Any, doing: str) -> None:
        for tracker in list(self._trackers):
            try:
                call(tracker)
            except Exception as err:  # a tracker's failure must not stop training
                first = (str(err).strip().splitlines() or [type(err).__name__])[0]
                print(
                    f"warning: {tracker.name} failed while {doing} ({type(err).__name__}: {first}); "
                    "it logs nothing more in this run (metrics.jsonl has every step)",
                    file=self._stream,
                )
                self._trackers.remove(tracker)


def open_trackers(
    names: list[str],
    run_dir: RunDir,
    *,
    project: str,
    config: dict[str, Any],
    resume_step: int | None = None,
) -> Trackers:
    """Start the trackers ``names`` for ``run_dir``; ``resume_step`` (a resume) continues the
    W&B and MLflow runs recorded in ``trackers.json`` and purges TensorBoard after that step.
    A tracker that cannot start is a one-line UserError (nothing has been trained yet)."""
    check_installed(names)
    saved = saved_ids(run_dir.trackers) if resume_step is not None else {}
    safe = redacted_config(config)
    opened: list[Tracker] = []
    try:
        for name in names:
            try:
                if name == "tensorboard":
                    opened.append(
                        TensorBoardTracker(
                            run_dir.tensorboard,
                            config=safe,
                            purge_step=resume_step + 1 if resume_step is not None else None,
                        )
                    )
                elif name == "wandb":
                    opened.append(WandbTracker(run_dir, project=project, config=safe, run_id=saved.get("wandb")))
                elif name == "mlflow":
                    opened.append(MlflowTracker(run_dir, project=project, config=safe, run_id=saved.get("mlflow")))
                else:
                    raise AssertionError(f"unknown tracker {name!r}: config validation lets only known names through")
            except AssertionError:
                raise
            except Exception as err:
                lines = str(err).strip().splitlines()
                why = f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__
                raise UserError(f"run.trackers: {name} could not start ({why}); {_HINTS[name]}") from err
    except BaseException:
        Trackers(opened).close(ok=False)
        raise
    ids = {t.name: t.run_id for t in opened if hasattr(t, "run_id")}
    if ids:
        atomic_write_text(run_dir.trackers, json.dumps({**saved, **ids}, indent=2) + "\n")
    return Trackers(opened)


_HINTS = {
    "tensorboard": "check that the run directory is writable",
    "wandb": "log in with `wandb login`, or set WANDB_MODE=offline",
    "mlflow": "check MLFLOW_TRACKING_URI (unset: MLflow's local store in the current directory)",
}


def saved_ids(path: Path) -> dict[str, str]:
    """Tracker run ids saved by an earlier session ({} when there are none)."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as err:
        raise UserError(f"{path} is unreadable ({err}); delete it to start new tracker runs") from None
    if not isinstance(data, dict) or not all(isinstance(v, str) for v in data.values()):
        raise UserError(f"{path} is not a JSON object of run ids; delete it to start new tracker runs")
    return data
