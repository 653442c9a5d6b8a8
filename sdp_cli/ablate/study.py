"""A study: what a sweep's report tests, stated before the sweep runs (docs/ablate.md "The study").

A study file is a YAML mapping; every key is optional:

    metric: acc_end                   # the outcome: reward_last or acc_end (report columns)
    baseline: decoupled               # the fixed baseline of every contrast (a report mode label)
    primary:                          # the one pre-registered contrast: treatment − baseline
      treatment: segment_wise
      at: {rollout.max_head_offpolicyness: 8}    # its cell: a value of every swept key
    margin: 0.05                      # equivalence margin ±δ (no margin: no equivalence verdict)
    alpha: 0.05
    power: 0.8                        # of the minimum detectable effect

The study of a sweep is ``sdp_cli/conf/ablate/study/<sweep>.yaml`` (``--study FILE`` names
another). It cannot live in the sweep file: Hydra composes that file into every run's config,
whose schema is strict. ``sdp ablate`` checks the study against the plan (labels, cell) and
writes it to ``<sweep dir>/study.json`` before the first run; the report reads it from there, so
a study file edited later does not change what the sweep registered.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from importlib import resources
from pathlib import Path
from typing import Any

from sdp_cli.ablate.sweep import MAX_HEAD_OFFPOLICYNESS_KEY, MODE_KEY, SEED_KEY, SWEEP_GROUP, split_override
from sdp_cli.errors import UserError
from sdp_cli.fileio import atomic_write_text

#: where a sweep directory records its study
STUDY_FILE = "study.json"
#: the outcomes a study may test (report columns where higher is better) and what they are
METRICS = {"reward_last": "final reward", "acc_end": "greedy accuracy after training"}
_KEYS = ("metric", "baseline", "primary", "margin", "alpha", "power")
_PRIMARY_KEYS = ("treatment", "at")


def _same_value(a: str, b: str) -> bool:
    """Config values as Hydra and YAML spell them: ``8`` and ``8.0``, ``3e-4`` and ``0.0003``."""
    if a == b:
        return True
    try:
        return float(a) == float(b)
    except ValueError:
        return False


@dataclass(frozen=True)
class Primary:
    """The pre-registered contrast: ``treatment`` − the study's baseline at the cell ``at``
    ((config key, value) pairs, values as strings)."""

    treatment: str
    at: tuple[tuple[str, str], ...] = ()

    def matches(self, max_head_offpolicyness: int, overrides: Iterable[str]) -> bool:
        """Whether the cell with this η and these ``key=value`` overrides is the primary's."""
        given = dict(split_override(o) for o in overrides)
        for key, value in self.at:
            found = str(max_head_offpolicyness) if key == MAX_HEAD_OFFPOLICYNESS_KEY else given.get(key)
            if found is None or not _same_value(found, value):
                return False
        return True

    def describe(self, baseline: str) -> str:
        """``treatment − baseline at η = 8, key = value``."""
        cell = ", ".join(f"{'η' if k == MAX_HEAD_OFFPOLICYNESS_KEY else k} = {v}" for k, v in self.at)
        return f"{self.treatment} − {baseline}" + (f" at {cell}" if cell else "")


@dataclass(frozen=True)
class Study:
    """A study (module docstring); the defaults are the report's when none is registered."""

    metric: str = "reward_last"
    baseline: str = "decoupled"
    primary: Primary | None = None
    margin: float | None = None
    alpha: float = 0.05
    power: float = 0.8

    def to_dict(self) -> dict[str, Any]:
        primary = None
        if self.primary is not None:
            primary = {"treatment": self.primary.treatment, "at": dict(self.primary.at)}
        return {
            "metric": self.metric,
            "baseline": self.baseline,
            "primary": primary,
            "margin": self.margin,
            "alpha": self.alpha,
            "power": self.power,
        }

    @classmethod
    def from_mapping(cls, data: Any, where: str) -> Study:
        """A study from a parsed file; ``where`` names the file in one-line errors."""
        if data is None:
            data = {}
        if not isinstance(data, Mapping):
            raise UserError(f"{where}: a study is a mapping of {', '.join(_KEYS)}; fix the file")
        _no_unknown(data, _KEYS, where, "")
        metric = str(data.get("metric", cls.metric))
        if metric not in METRICS:
            raise UserError(f"{where}: metric {metric!r} is not one of {', '.join(METRICS)}; fix the file")
        baseline = data.get("baseline", cls.baseline)
        if not isinstance(baseline, str) or not baseline:
            raise UserError(f"{where}: baseline must be a mode label such as decoupled; fix the file")
        alpha = _number(data, "alpha", cls.alpha, where, 0.0, 0.5)
        power = _number(data, "power", cls.power, where, 0.0, 1.0)
        margin = None if data.get("margin") is None else _number(data, "margin", None, where, 0.0, math.inf)
        return cls(metric, baseline, _primary(data.get("primary"), baseline, where), margin, alpha, power)


def _no_unknown(data: Mapping[str, Any], keys: Sequence[str], where: str, prefix: str) -> None:
    unknown = [str(k) for k in data if k not in keys]
    if unknown:
        raise UserError(
            f"{where}: unknown key '{prefix}{unknown[0]}'; the keys are {', '.join(prefix + k for k in keys)}"
        )


def _number(data: Mapping[str, Any], key: str, default: float | None, where: str, low: float, high: float) -> float:
    value = data.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not low < value < high:
        bounds = f"> {low:g}" if math.isinf(high) else f"between {low:g} and {high:g} (exclusive)"
        raise UserError(f"{where}: {key} must be a number {bounds}, got {value!r}; fix the file")
    return float(value)


def _primary(data: Any, baseline: str, where: str) -> Primary | None:
    if data is None:
        return None
    if not isinstance(data, Mapping):
        raise UserError(f"{where}: primary is a mapping of treatment and at; fix the file")
    _no_unknown(data, _PRIMARY_KEYS, where, "primary.")
    treatment, at = data.get("treatment"), data.get("at") or {}
    if not isinstance(treatment, str) or not treatment:
        raise UserError(f"{where}: primary.treatment must be a mode label such as segment_wise; fix the file")
    if treatment == baseline:
        raise UserError(f"{where}: primary.treatment is the baseline {baseline}; name another mode")
    if not isinstance(at, Mapping) or any(isinstance(v, Mapping | list) for v in at.values()):
        raise UserError(
            f"{where}: primary.at maps swept keys to one value each, "
            "e.g. {rollout.max_head_offpolicyness: 8}; fix the file"
        )
    return Primary(treatment, tuple(sorted((str(k), str(v)) for k, v in at.items())))


# ------------------------------------------------------------------- files
def read_study_file(path: Path) -> Study:
    """A study file (YAML; module docstring)."""
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as err:
        raise UserError(f"--study {path}: cannot read ({err.strerror or err}); pass a study YAML file") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        line = f":{mark.line + 1}" if mark is not None else ""
        raise UserError(f"{path}{line}: not valid YAML; fix the file") from None
    return Study.from_mapping(data, str(path))


def builtin_study_path(sweep: str) -> Path | None:
    """``sdp_cli/conf/ablate/study/<sweep>.yaml``, when the sweep has one."""
    path = Path(str(resources.files("sdp_cli.conf").joinpath(SWEEP_GROUP, "study", f"{sweep}.yaml")))
    return path if path.is_file() else None


#: how to get past a study that does not fit a sweep about to run
RUN_HINT = "fix the study, pass another with --study FILE, or run without one (--no-study)"


def check_study(
    study: Study, modes: Iterable[str], axes: Mapping[str, Sequence[str]], where: str, hint: str = RUN_HINT
) -> None:
    """The study's labels are modes of the sweep and its primary names one of its cells: a value
    of every swept key (``axes``) but the mode and the seed. One-line UserError otherwise."""
    modes = sorted(set(modes))
    labels = [("baseline", study.baseline)]
    if study.primary is not None:
        labels.append(("primary.treatment", study.primary.treatment))
    for key, label in labels:
        if label not in modes:
            raise UserError(f"{where}: {key} {label!r} is not a mode of this sweep ({', '.join(modes)}); {hint}")
    if study.primary is None:
        return
    cell_axes = {k.lstrip("+~"): v for k, v in axes.items() if k not in (MODE_KEY, SEED_KEY)}
    at = dict(study.primary.at)
    for key, value in at.items():
        if key not in cell_axes:
            swept = ", ".join(cell_axes) or "none but the mode and the seed"
            raise UserError(f"{where}: primary.at names {key}, which this sweep does not sweep (its axes: {swept}); {hint}")
        if not any(_same_value(value, v) for v in cell_axes[key]):
            raise UserError(
                f"{where}: primary.at {key}={value} is not in this sweep ({key} ∈ {', '.join(cell_axes[key])}); {hint}"
            )
    missing = [k for k in cell_axes if k not in at]
    if missing:
        raise UserError(f"{where}: primary.at must give a value of every swept key; add {missing[0]} ({hint})")


@dataclass(frozen=True)
class Registration:
    """A study as a sweep directory recorded it (``study.json``): the study, where it came from,
    and when it was written (UTC, ISO 8601)."""

    study: Study
    source: str
    registered: str


def study_path(sweep_dir: Path) -> Path:
    return Path(sweep_dir) / STUDY_FILE


def read_registration(sweep_dir: Path) -> Registration | None:
    """The study ``sweep_dir/study.json`` records, or None where there is none."""
    path = study_path(sweep_dir)
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        study, source, registered = data["study"], str(data["source"]), str(data["registered"])
    except (OSError, ValueError, KeyError, TypeError):
        raise UserError(f"{path}: not a study record of sdp ablate; restore it or delete it") from None
    return Registration(Study.from_mapping(study, str(path)), source, registered)


def check_registration(sweep_dir: Path, study: Study) -> None:
    """A sweep directory keeps the study it registered first: another one is a one-line error."""
    existing = read_registration(sweep_dir)
    if existing is None or existing.study == study:
        return
    old, new = existing.study.to_dict(), study.to_dict()
    key = next(k for k in old if old[k] != new[k])
    raise UserError(
        f"{study_path(sweep_dir)} registered another study ({key}: {old[key]!r} → {new[key]!r}); "
        "a study is fixed before its sweep runs: pass a new --dir, or --no-study to keep the registered one"
    )


def register(sweep_dir: Path, study: Study, source: str) -> Path:
    """Write ``study.json`` unless the directory registered this study already (then its first
    registration, with its time, stays); another registered study is refused
    (``check_registration``, which the CLI also calls before it plans anything)."""
    path = study_path(sweep_dir)
    check_registration(sweep_dir, study)
    if path.is_file():
        return path
    data = {
        "study": study.to_dict(),
        "source": source,
        "registered": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    atomic_write_text(path, json.dumps(data, indent=2, ensure_ascii=False) + "\n")  # never through a link
    return path
