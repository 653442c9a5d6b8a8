"""Strict command-line overrides: what ``sdp train`` refuses before and after composing.

Before composing, every override is parsed: a sweep (``-m``, ``a,b``, ``range(...)``) belongs to
``sdp ablate``; ``~key`` cannot delete a schema key; ``hydra.run.dir`` becomes ``run.dir`` and
every other ``hydra.*`` key, which ``sdp train`` would silently ignore, is refused. After
composing, every key of the config must exist in the schema (``sdp_cli/config/schema.py``), so
``+train.stpes=5`` fails like ``train.stpes=5`` does, naming the nearest valid key. The check
walks the schema dataclasses, so a key added to the schema is accepted without a list to update.
"""

from __future__ import annotations

import difflib
import typing
from dataclasses import fields, is_dataclass
from typing import Any

from sdp_cli.config.limits import check_override_sizes
from sdp_cli.errors import UserError

HELP_HINT = "run `sdp train --help-config` for every key"
SWEEP_HINT = "sdp train runs one job; sweep with sdp ablate, e.g. `sdp ablate smoke seed=0,1`"
#: hydra.* keys with an sdp meaning
HYDRA_EQUIVALENTS = {"hydra.run.dir": "run.dir"}


def _parse(overrides: list[str]) -> list[Any]:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    parsed = []
    for override in overrides:
        try:
            parsed.append(parser.parse_override(override))
        except Exception as exc:  # Hydra's grammar errors: one line naming the override
            first = next((line.strip() for line in str(exc).splitlines() if line.strip()), str(exc))
            hint = " (quote a value with braces or commas: key=\"'...'\")" if any(c in override for c in "{},[]") else ""
            raise UserError(f"cannot parse override {override!r}: {first}{hint}; use key=value, e.g. loss.clip=0.3") from None
    return parsed


def check_overrides(overrides: list[str]) -> list[str]:
    """The overrides ``sdp train`` composes: sweeps, deletions, options and ``hydra.*`` keys
    without an sdp meaning are refused in one line; ``hydra.run.dir=D`` becomes ``run.dir=D``.
    Overrides too many, long or itemised to parse quickly are refused first (sdp_cli/config/limits.py)."""
    check_override_sizes(overrides)
    for override in overrides:
        if override in ("-m", "--multirun"):
            raise UserError(f"{override}: {SWEEP_HINT}")
        if override.startswith("-"):
            raise UserError(f"unknown option {override.partition('=')[0]!r}; see `sdp train --help` (config keys are key=value)")
    checked = []
    for override, parsed in zip(overrides, _parse(overrides)):
        key = parsed.key_or_group
        if parsed.is_sweep_override():
            raise UserError(f"{override} is a sweep; {SWEEP_HINT}")
        if parsed.is_delete():
            raise UserError(
                f"{override}: sdp train cannot delete a config key (every key has a default); "
                f"set it to the value you want instead: {key}=..."
            )
        if key == "hydra" or key.startswith(("hydra.", "hydra/")):
            if key in HYDRA_EQUIVALENTS and not parsed.is_add():
                checked.append(f"{HYDRA_EQUIVALENTS[key]}={override.partition('=')[2]}")
                continue
            if key == "hydra.searchpath":
                raise UserError(f"{override}: add your config directory with --config-dir DIR instead")
            if key.startswith("hydra/") or key.startswith(("hydra.sweep", "hydra.sweeper", "hydra.launcher")):
                raise UserError(f"{override} configures a sweep; {SWEEP_HINT}")
            raise UserError(
                f"{override} has no effect on sdp train (it does not run through @hydra.main); "
                "the run directory is run.dir, logging is run.progress/run.trackers"
            )
        checked.append(override)
    return checked


# ------------------------------------------------------------------ schema keys
def schema_keys(cls: type | None = None, prefix: str = "") -> list[str]:
    """Every dotted key of the schema, sections and leaves (``loss``, ``loss.mode``, ...)."""
    from sdp_cli.config.schema import SdpConfig

    cls = cls or SdpConfig
    keys: list[str] = []
    hints = typing.get_type_hints(cls)
    for f in fields(cls):
        key = f"{prefix}{f.name}"
        keys.append(key)
        if is_dataclass(hints[f.name]):
            keys.extend(schema_keys(hints[f.name], f"{key}."))
    return keys


def wrong_type_message(key: str, value: str) -> str | None:
    """``key=value`` where the schema wants a number or a boolean: what it wants, with the
    default as an example; None for a key that takes neither."""
    from sdp_cli.config.schema import SdpConfig, yaml_literal

    node: Any = SdpConfig()
    hint: Any = None
    for part in key.split("."):
        hints = typing.get_type_hints(type(node)) if is_dataclass(node) else {}
        if part not in hints:
            return None
        hint, node = hints[part], getattr(node, part)
    wanted = set(typing.get_args(hint) or (hint,))  # int | None → {int, NoneType}
    if bool in wanted:
        return f"{key}={value} is not true or false; pass {key}=true or false"
    kind = "a whole number" if int in wanted else "a number" if float in wanted else None
    if kind is None:
        return None
    example = f", e.g. {key}={yaml_literal(node)}" if node is not None else ""  # as --help-config shows it
    return f"{key}={value} is not {kind}; pass one{' or null' if type(None) in wanted else ''}{example}"


#: what the same section adds to a candidate's score in :func:`nearest_key`: a typo inside the
#: right group wins over a similar name elsewhere, a whole name elsewhere wins over a typo
SAME_SECTION_BONUS = 0.1


def nearest_key(key: str) -> str:
    """The valid key closest to ``key``, found by its last part in every section: a key set in
    the wrong group (``train.reward_workers``) names the group that has it (``task.``).

    Score = similarity of the last parts (difflib's ratio) + ``SAME_SECTION_BONUS`` for the same
    section; ties go to the key spelled most like the whole of ``key``."""
    section, _, leaf = key.rpartition(".")

    def score(candidate: str) -> tuple[float, float]:
        c_section, _, c_leaf = candidate.rpartition(".")
        near = difflib.SequenceMatcher(None, leaf, c_leaf).ratio() + SAME_SECTION_BONUS * (c_section == section)
        return near, difflib.SequenceMatcher(None, key, candidate).ratio()

    return max(schema_keys(), key=score)


def _mapping_keys(cls: type | None = None, prefix: str = "") -> list[str]:
    """Schema keys that hold a free-form mapping (``engine.env``, ``task.reward_kwargs``)."""
    from sdp_cli.config.schema import SdpConfig

    cls = cls or SdpConfig
    hints = typing.get_type_hints(cls)
    found: list[str] = []
    for f in fields(cls):
        hint = hints[f.name]
        if is_dataclass(hint):
            found.extend(_mapping_keys(hint, f"{prefix}{f.name}."))
        elif typing.get_origin(hint) is dict:
            found.append(f"{prefix}{f.name}")
    return found


def unknown_key_message(key: str) -> str:
    parent = key.rpartition(".")[0]
    if parent in _mapping_keys():
        return f"{key}: {parent} is a mapping; add a new key with '+': +{key}=..."
    return f"unknown config key '{key}'; the nearest valid key is {nearest_key(key)} ({HELP_HINT})"


def unknown_keys(cfg: Any, cls: type | None = None, prefix: str = "") -> list[str]:
    """Dotted keys of a composed DictConfig that the schema does not have."""
    from sdp_cli.config.schema import SdpConfig

    cls = cls or SdpConfig
    hints = typing.get_type_hints(cls)
    names = {f.name for f in fields(cls)}
    found: list[str] = []
    for name in cfg.keys():
        key = f"{prefix}{name}"
        if name not in names:
            found.append(key)
        elif is_dataclass(hints[name]):  # mappings such as engine.env hold the user's own keys
            found.extend(unknown_keys(cfg[name], hints[name], f"{key}."))
    return found
