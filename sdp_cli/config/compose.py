"""Compose a run config through Hydra's compose API and turn every failure into one line.

Hydra's ``@hydra.main`` owns ``sys.argv`` and cannot sit under a Typer sub-command, so sdp
composes explicitly: schema (ConfigStore) + ``sdp_cli/conf`` groups + command-line overrides.
"""

from __future__ import annotations

import re
from typing import Any

from sdp_cli.config.schema import ConfigValueError, SdpConfig, validate
from sdp_cli.errors import UserError

CONFIG_MODULE = "sdp_cli.conf"
HELP_HINT = "run `sdp train --help-config` for every key"


def _register_schema() -> None:
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="sdp_schema", node=SdpConfig)


def _first_line(text: str) -> str:
    return next((line.strip() for line in str(text).splitlines() if line.strip()), str(text))


def _explain(exc: BaseException) -> str:
    """A one-line explanation of a Hydra / OmegaConf composition error."""
    from hydra.errors import MissingConfigException, OverrideParseException
    from omegaconf.errors import ConfigKeyError, MissingMandatoryValue, ValidationError

    chain: list[BaseException] = []
    cur: BaseException | None = exc
    while cur is not None and cur not in chain:
        chain.append(cur)
        cur = cur.__cause__ or cur.__context__

    for err in chain:
        if isinstance(err, MissingConfigException):
            match = re.search(r"Could not find '([^']+)'", str(err))
            missing = match.group(1) if match else _first_line(err)
            group, _, option = missing.rpartition("/")
            options = sorted(getattr(err, "options", None) or [])
            if group and options:
                return f"{group}={option}: no such option; choose one of {', '.join(options)}"
            return f"config '{missing}' not found ({HELP_HINT})"
        if isinstance(err, OverrideParseException):
            return f"cannot parse override: {_first_line(err)} (use key=value, e.g. loss.clip=0.3)"
        if isinstance(err, ConfigKeyError):
            key = getattr(err, "full_key", None) or _first_line(err)
            match = re.search(r"Key '([^']+)'", str(err))
            name = match.group(1) if match else key
            where = f" under '{err.full_key.rsplit('.', 1)[0]}'" if getattr(err, "full_key", "") and "." in err.full_key else ""
            return f"unknown config key '{name}'{where}; {HELP_HINT}"
        if isinstance(err, MissingMandatoryValue):
            key = getattr(err, "full_key", "") or "a value"
            return f"{key} must be set, e.g. {key}=..."
        if isinstance(err, ValidationError):
            key = getattr(err, "full_key", "")
            return f"{key}: {_first_line(err)}" if key else _first_line(err)
    text = _first_line(exc)
    match = re.search(r"Could not override '([^']+)'", text)
    if match:
        return f"unknown config key '{match.group(1)}'; {HELP_HINT}"
    return text


def compose_dict(overrides: list[str], *, config_name: str = "config") -> Any:
    """Compose the raw ``DictConfig`` (schema-checked keys and types, values not yet validated)."""
    from hydra import compose, initialize_config_module

    _register_schema()
    try:
        with initialize_config_module(config_module=CONFIG_MODULE, version_base="1.3"):
            return compose(config_name=config_name, overrides=list(overrides))
    except Exception as exc:  # every Hydra/OmegaConf failure becomes one line
        raise UserError(_explain(exc)) from exc


def to_config(cfg: Any) -> SdpConfig:
    """Resolve interpolations, build the typed config and validate every value."""
    from omegaconf import OmegaConf

    try:
        obj = OmegaConf.to_object(cfg)
    except Exception as exc:
        raise UserError(_explain(exc)) from exc
    assert isinstance(obj, SdpConfig), f"composed config is {type(obj).__name__}, not SdpConfig"
    try:
        validate(obj)
    except ConfigValueError as exc:
        raise UserError(str(exc)) from exc
    return obj


def compose_config(overrides: list[str], *, config_name: str = "config") -> tuple[SdpConfig, Any]:
    """Compose, validate and return ``(typed config, DictConfig)``; errors are one-line UserErrors."""
    cfg = compose_dict(overrides, config_name=config_name)
    return to_config(cfg), cfg


def to_yaml(cfg: Any) -> str:
    """The resolved config as YAML (what a run directory stores as config.yaml)."""
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(cfg, resolve=True)
