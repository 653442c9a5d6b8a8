"""Compose a run config through Hydra's compose API and turn every failure into one line.

Hydra's ``@hydra.main`` owns ``sys.argv`` and cannot sit under a Typer sub-command, so sdp
composes explicitly: schema (ConfigStore) + ``sdp_cli/conf`` groups + the user's config
directory (``--config-dir``, its YAML files are more options of the same groups) +
command-line overrides, checked strictly (``sdp_cli/config/overrides.py``). ``--config-name``
picks a primary config of the user's directory instead of sdp's ``config``; it builds on sdp's
by listing ``config`` first in its defaults (docs/tasks.md). The user's YAML files, the
overrides and the interpolations are held to the budgets of ``sdp_cli/config/limits.py``
before Hydra or OmegaConf reads or resolves them.
"""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from sdp_cli.config.limits import (
    check_config_dir,
    check_interpolations,
    config_files,
    load_yaml_file,
    read_yaml_file,
    yaml_error_line,
)
from sdp_cli.config.overrides import (
    HELP_HINT,
    check_overrides,
    schema_keys,
    unknown_key_message,
    unknown_keys,
    wrong_type_message,
)
from sdp_cli.config.schema import SdpConfig
from sdp_cli.config.scopes import unread_key_problem
from sdp_cli.config.validation import ConfigValueError, validate
from sdp_cli.errors import UserError

CONFIG_MODULE = "sdp_cli.conf"
PRIMARY = "config"

__all__ = [
    "HELP_HINT",
    "ConfigSource",
    "compose_config",
    "compose_dict",
    "config_source",
    "hydra_initialized",
    "to_config",
    "to_yaml",
]


@dataclass(frozen=True)
class ConfigSource:
    """Where a run's config comes from: sdp's groups, plus a user directory and primary config."""

    config_dir: str | None = None
    config_name: str = PRIMARY

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str, where: str) -> "ConfigSource":
        try:
            data = json.loads(text)
            return cls(config_dir=data["config_dir"], config_name=str(data["config_name"]))
        except (ValueError, KeyError, TypeError, RecursionError):
            raise UserError(f"{where} is not what sdp wrote there; restore it or start a new run") from None


def builtin_dir() -> Path:
    """sdp's own config groups (``sdp_cli/conf``)."""
    return Path(str(resources.files(CONFIG_MODULE)))


def config_source(config_dir: str | Path | None, config_name: str | None) -> ConfigSource:
    """The checked ``--config-dir``/``--config-name`` pair (one-line UserError otherwise).

    A user YAML with the name of one of sdp's (``task/arith1.yaml``, ``config.yaml``) is refused:
    Hydra would silently use only one of the two.
    """
    if config_dir is None:
        if config_name not in (None, PRIMARY):
            raise UserError(f"--config-name {config_name} needs --config-dir DIR, the directory that holds {config_name}.yaml")
        return ConfigSource()
    directory = Path(config_dir).expanduser().resolve()
    if not directory.is_dir():
        raise UserError(f"--config-dir {config_dir}: no such directory; pass the directory that holds your YAML configs")
    if "'" in str(directory) or "," in str(directory):
        raise UserError(f"--config-dir {directory}: the path may not contain quotes or commas; move or rename it")
    builtin = builtin_dir()
    for path in config_files(directory):
        relative = path.relative_to(directory)
        if (builtin / relative).is_file():
            group = relative.parent.as_posix()
            what = "sdp's primary config" if group == "." else f"sdp's {group}={relative.stem}"
            raise UserError(f"{path} has the name of {what}, so one of the two would be ignored; rename your file")
    name = config_name or PRIMARY
    if name != PRIMARY and not (directory / f"{name}.yaml").is_file():
        found = ", ".join(sorted(p.stem for p in directory.glob("*.yaml"))) or "none"
        raise UserError(f"--config-name {name}: no {directory / (name + '.yaml')} (primary configs there: {found})")
    return ConfigSource(str(directory), name)


def _register_schema() -> None:
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="sdp_schema", node=SdpConfig)


def _first_line(text: str) -> str:
    return next((line.strip() for line in str(text).splitlines() if line.strip()), str(text))


def _config_file(config_path: str, source: ConfigSource) -> Path | None:
    """The YAML file behind a config path such as ``task/my_task``."""
    roots = [Path(source.config_dir)] if source.config_dir else []
    for root in [*roots, builtin_dir()]:
        candidate = root / f"{config_path}.yaml"
        if candidate.is_file():
            return candidate
    return None


def _line_of(path: Path, key: str) -> int | None:
    """The first line of ``path`` that sets ``key`` (its last dotted part)."""
    name = re.escape(key.rpartition(".")[2])
    for number, line in enumerate(path.read_text(errors="replace").splitlines(), start=1):
        if re.match(rf"\s*['\"]?{name}['\"]?\s*:", line):
            return number
    return None


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and the exceptions it was raised from or during, outermost first."""
    chain: list[BaseException] = []
    cur: BaseException | None = exc
    while cur is not None and cur not in chain:
        chain.append(cur)
        cur = cur.__cause__ or cur.__context__
    return chain


def _explain(exc: BaseException, source: ConfigSource) -> str:
    """A one-line explanation of a Hydra / OmegaConf / YAML composition error."""
    import yaml
    from hydra.errors import MissingConfigException
    from omegaconf.errors import ConfigKeyError, MissingMandatoryValue, ValidationError

    chain = _chain(exc)
    match = re.search(r"In '([^']+)'", str(exc))
    origin = _config_file(match.group(1), source) if match else None

    for err in chain:
        if isinstance(err, yaml.YAMLError):
            return yaml_error_line(err)
        if isinstance(err, MissingConfigException):
            found = re.search(r"Could not find '([^']+)'", str(err))
            missing = found.group(1) if found else _first_line(err)
            group, _, option = missing.rpartition("/")
            options = sorted(getattr(err, "options", None) or [])
            if group and options:
                near = difflib.get_close_matches(option, options, n=1)
                guess = f"did you mean {near[0]}? Choose" if near else "choose"
                return f"{group}={option}: no such option; {guess} one of {', '.join(options)}"
            return f"config '{missing}' not found ({HELP_HINT})"
        if isinstance(err, ConfigKeyError):
            key = getattr(err, "full_key", "") or _first_line(err)
            if origin is None:
                return unknown_key_message(key)
            group = match.group(1).rpartition("/")[0] if match else ""
            if group and key.split(".")[0] == group and group not in schema_keys():
                return (
                    f"{origin}: its keys land under '{key.split('.')[0]}.' ({key}); "
                    "add '# @package _global_' as its first line to set top-level keys"
                )
            line = _line_of(origin, key)
            return f"{origin}{f':{line}' if line else ''}: {unknown_key_message(key)}"
        if isinstance(err, MissingMandatoryValue):
            key = getattr(err, "full_key", "") or "a value"
            return f"{key} must be set, e.g. {key}=..."
        if isinstance(err, ValidationError):
            key = getattr(err, "full_key", "")
            where = ""
            if origin is not None:
                line = _line_of(origin, key) if key else None
                where = f"{origin}{f':{line}' if line else ''}: "
            # OmegaConf's "Value 'x' of type 'str' could not be converted to Integer" names
            # neither the type wanted in our words nor a fix
            value = re.match(r"Value '(.*)' (?:of type|is not a valid)", _first_line(err))
            wrong_type = wrong_type_message(key, value.group(1)) if key and value else None
            if wrong_type is not None:
                return f"{where}{wrong_type}"
            return f"{where}{key}: {_first_line(err)}" if key else f"{where}{_first_line(err)}"
    text = _first_line(exc)
    found = re.search(r"Could not override '([^']+)'", text)
    if found:
        return unknown_key_message(found.group(1))
    found = re.search(r"An item is already at '([^']+)'", str(exc))
    if found:
        return f"+{found.group(1)}: the key exists already; set it without '+': {found.group(1)}=..."
    return text


@contextmanager
def hydra_initialized(source: ConfigSource) -> Iterator[list[str]]:
    """Hydra's compose API set up for ``source`` (schema registered); yields the search-path
    override to put first. The primary config is ``source.config_name``: a user primary comes
    from the user's directory with sdp's groups searched too, else sdp's ``config`` with the
    user's directory searched too."""
    from hydra import initialize_config_dir, initialize_config_module

    _register_schema()
    if source.config_dir is None:
        with initialize_config_module(config_module=CONFIG_MODULE, version_base="1.3"):
            yield []
        return
    check_config_dir(Path(source.config_dir))  # before Hydra reads any of its files
    if source.config_name == PRIMARY:
        with initialize_config_module(config_module=CONFIG_MODULE, version_base="1.3"):
            yield [f"hydra.searchpath=['file://{source.config_dir}']"]
    else:
        with initialize_config_dir(config_dir=source.config_dir, version_base="1.3"):
            yield [f"hydra.searchpath=['pkg://{CONFIG_MODULE}']"]


def compose_dict(overrides: list[str], *, source: ConfigSource = ConfigSource()) -> Any:
    """Compose the raw ``DictConfig`` (schema-checked keys and types, values not yet validated)."""
    from hydra import compose
    from omegaconf import OmegaConf

    overrides = check_overrides(list(overrides))
    try:
        with hydra_initialized(source) as search:
            cfg = compose(config_name=source.config_name, overrides=[*search, *overrides])
    except UserError:
        raise
    except Exception as exc:  # every Hydra/OmegaConf failure becomes one line
        if any(isinstance(e, RecursionError) for e in _chain(exc)):  # Hydra follows a defaults cycle
            raise UserError(_defaults_cycle(source)) from None  # until the interpreter stops it
        if not _builds_on_sdp(source):  # the failure was the user primary's, whatever it said
            raise UserError(_not_sdp_primary(source)) from exc
        raise UserError(_explain(exc, source)) from exc
    if OmegaConf.get_type(cfg) is not SdpConfig:
        raise UserError(_not_sdp_primary(source))
    unknown = unknown_keys(cfg)
    if unknown:
        raise UserError(unknown_key_message(unknown[0]))
    check_interpolations(OmegaConf.to_container(cfg, resolve=False))
    return cfg


def _not_sdp_primary(source: ConfigSource) -> str:
    primary = Path(source.config_dir or "") / f"{source.config_name}.yaml"
    return f"{primary} does not build on sdp's config; make its first defaults entry `- config`"


def _builds_on_sdp(source: ConfigSource) -> bool:
    """Whether the primary config composes, alone, to sdp's schema (True when it does not
    compose at all: its own error then says more)."""
    if source.config_name == PRIMARY:
        return True
    from hydra import compose
    from omegaconf import OmegaConf

    try:
        with hydra_initialized(source) as search:
            return OmegaConf.get_type(compose(config_name=source.config_name, overrides=search)) is SdpConfig
    except Exception:
        return True


def _defaults_entries(path: Path, group: str) -> list[str]:
    """The config paths (``task/x``) that the defaults list of ``path``, a config of ``group``,
    names: plain entries relative to the group, ``/abs`` ones absolute, ``{group: option}``."""
    data = load_yaml_file(path)
    defaults = data.get("defaults") if isinstance(data, dict) else None
    found: list[str] = []

    def joined(name: str) -> str:
        name = name.split("@")[0].strip()
        return name.lstrip("/") if name.startswith("/") or not group else f"{group}/{name}"

    for entry in defaults if isinstance(defaults, list) else []:
        if isinstance(entry, str) and entry != "_self_":
            found.append(joined(entry))
        elif isinstance(entry, dict):
            for key, options in entry.items():
                key = str(key).split()[-1]  # "override task", "optional task"
                for option in options if isinstance(options, list) else [options]:
                    if isinstance(option, str):
                        found.append(f"{joined(key)}/{option}")
    return found


def _defaults_cycle(source: ConfigSource) -> str:
    """One line naming a cycle of the defaults lists of the user's configs (Hydra reports one as
    "maximum recursion depth exceeded")."""
    if source.config_dir is None:
        return "sdp's config groups include each other in a cycle; reinstall sdp"
    root = Path(source.config_dir)
    graph = {}
    for path in config_files(root):
        group = path.parent.relative_to(root).as_posix().strip(".")
        graph[path.relative_to(root).with_suffix("").as_posix()] = _defaults_entries(path, group)

    def walk(node: str, trail: list[str]) -> list[str] | None:
        if node in trail:
            return [*trail[trail.index(node):], node]
        for nxt in graph.get(node, []):
            cycle = walk(nxt, [*trail, node])
            if cycle:
                return cycle
        return None

    for start in [source.config_name, *sorted(graph)]:
        cycle = walk(start, [])
        if cycle:
            return (
                f"{root}: the defaults lists include each other in a cycle ({' → '.join(cycle)}); "
                "remove one of the entries"
            )
    return f"{root}: a defaults list includes itself through others (a cycle); remove the cycle"


def _raw_value(cfg: Any, key: str) -> Any:
    """``key`` of a composed config as written, interpolations unresolved (None when absent)."""
    from omegaconf import OmegaConf

    node: Any = OmegaConf.to_container(cfg, resolve=False)
    for part in key.split("."):
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _file_line_setting(source: ConfigSource, key: str, text: str) -> str | None:
    """``file:line`` of the config file line that sets ``key`` (its last part) to ``text``; the
    files of the group named by the key's first part are searched first."""
    roots = [Path(source.config_dir)] if source.config_dir else []
    files = [path for root in roots for path in config_files(root)] + sorted(builtin_dir().rglob("*.yaml"))
    files.sort(key=lambda path: path.parent.name != key.split(".")[0])
    name = re.escape(key.rpartition(".")[2])
    for path in files:
        for number, line in enumerate(read_yaml_file(path).splitlines(), start=1):
            if text in line and re.match(rf"\s*['\"]?{name}['\"]?\s*:", line):
                return f"{path}:{number}"
    return None


def _explain_resolution(exc: BaseException, cfg: Any, source: ConfigSource, overrides: list[str]) -> str:
    """One line for an interpolation that does not resolve: the file and line that set it (or
    the key, when an override did), the key and what is wrong."""
    from omegaconf.errors import InterpolationResolutionError

    err = next((e for e in _chain(exc) if isinstance(e, InterpolationResolutionError) and getattr(e, "full_key", None)), None)
    if err is None:
        return _explain(exc, source)
    key = str(err.full_key)
    env = re.search(r"Environment variable '([^']+)' not found", str(err))
    if env:
        var = env.group(1)
        problem = f"environment variable {var} is not set; export it or give a default, ${{oc.env:{var},default}}"
    else:
        problem = _first_line(err)
    text = _raw_value(cfg, key)
    set_here = any(o.lstrip("+~").partition("=")[0] == key for o in overrides)
    where = None if set_here or not isinstance(text, str) else _file_line_setting(source, key, text)
    return f"{where + ': ' if where else ''}{key}: {problem}"


def to_config(
    cfg: Any, source: ConfigSource = ConfigSource(), overrides: Sequence[str] = (), *, judged: Sequence[str] = ()
) -> SdpConfig:
    """Resolve interpolations, build the typed config and validate every value; ``source`` and
    ``overrides`` (what ``cfg`` was composed from) locate an interpolation that does not resolve.
    A key of the ``judged`` overrides that the run does not read is refused (config/scopes.py)."""
    from omegaconf import OmegaConf

    try:
        obj = OmegaConf.to_object(cfg)
    except Exception as exc:
        raise UserError(_explain_resolution(exc, cfg, source, list(overrides))) from exc
    assert isinstance(obj, SdpConfig), f"composed config is {type(obj).__name__}, not SdpConfig"
    try:
        validate(obj)
    except ConfigValueError as exc:
        raise UserError(str(exc)) from exc
    unread = unread_key_problem(obj, judged)
    if unread:
        raise UserError(unread)
    return obj


def config_from_dict(data: dict[str, Any]) -> SdpConfig:
    """The typed config whose ``dataclasses.asdict`` is ``data`` (the rollout process is sent its
    run's config so). Trusted: it was validated where it was composed."""
    from omegaconf import OmegaConf

    obj = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(SdpConfig), data))
    assert isinstance(obj, SdpConfig), f"the config rebuilt is {type(obj).__name__}, not SdpConfig"
    return obj


def compose_config(
    overrides: list[str], *, source: ConfigSource = ConfigSource(), accepted: Sequence[str] = ()
) -> tuple[SdpConfig, Any]:
    """Compose, validate and return ``(typed config, DictConfig)``; errors are one-line UserErrors.
    Every override but the ``accepted`` ones (a resumed run's saved overrides, accepted when the
    run began; a sweep's jobs, judged as a whole when it was planned) must set only keys the run
    reads (config/scopes.py)."""
    cfg = compose_dict(overrides, source=source)
    saved = set(accepted)
    judged = [o for o in overrides if o not in saved]
    return to_config(cfg, source, overrides, judged=judged), cfg


def to_yaml(cfg: Any) -> str:
    """The resolved config as YAML (what a run directory stores as config.yaml)."""
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(cfg, resolve=True)
