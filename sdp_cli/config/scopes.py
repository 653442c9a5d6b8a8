"""Which runs read which keys: a key set on the command line that the run's model or engine never
reads is refused in one line, instead of being accepted and ignored.

A key's scope is the label its ``--help-config`` text opens with (``model.path`` is documented as
"hf: the model directory ..."), so the help a user reads and the check are one statement. Only
keys named in overrides are judged: sdp's own config files (``+debug=fast`` sets the tiny model's
size) may set keys a run then does not read, and a key set to its default asks for nothing.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from sdp_cli.config.schema import SdpConfig, field_docs
from sdp_cli.engines import ENGINES, EngineKind, engine_kind


@dataclass(frozen=True)
class KeyScope:
    """The runs that read the keys documented as ``<label>: ...``: a model kind, or engines (with
    or without ``engine.urls``). ``text`` names them in a message (``{servers}``: the server
    engines registered), ``fix`` says what to do."""

    text: str
    model_kind: str | None = None
    engine: Callable[[EngineKind], bool] = lambda kind: True
    attached: bool | None = None  # reads the key only with engine.urls (True) or without (False)
    fix: str = "remove it"

    def missed_by(self, cfg: SdpConfig) -> str | None:
        """What ``cfg`` runs instead of this scope, or None when it reads the scope's keys."""
        if self.model_kind is not None:
            return None if cfg.model.kind == self.model_kind else f"model.kind={cfg.model.kind}"
        kind = engine_kind(cfg.engine.kind)
        if not self.engine(kind):
            return f"engine.kind={kind.name}"
        if self.attached is None or self.attached == bool(cfg.engine.urls):
            return None
        return "the servers of engine.urls, which sdp attaches to" if cfg.engine.urls else "a server sdp launches"

    def describe(self) -> str:
        servers = ", ".join(f"engine={name}" for name, kind in ENGINES.items() if kind.server)
        return self.text.format(servers=servers)


def _is_server(kind: EngineKind) -> bool:
    return kind.server


def _is_vllm(kind: EngineKind) -> bool:
    return kind.name == "vllm"


KEY_SCOPES: dict[str, KeyScope] = {
    "tiny": KeyScope("model.kind=tiny", model_kind="tiny"),
    "hf": KeyScope("model.kind=hf", model_kind="hf", fix="add model=hf to train the model it names, or remove it"),
    "local engine": KeyScope("the local engine (engine=local)", engine=lambda kind: not kind.server),
    "remote engines": KeyScope("remote engines ({servers})", engine=_is_server, fix="choose one of them, or remove it"),
    "launched servers": KeyScope(
        "a server sdp launches ({servers} without engine.urls)", engine=_is_server, attached=False
    ),
    "launched vllm": KeyScope(
        "a vLLM server sdp launches (engine=vllm without engine.urls)", engine=_is_vllm, attached=False
    ),
    "attached vllm": KeyScope(
        "vLLM servers sdp attaches to (engine=vllm with engine.urls)", engine=_is_vllm, attached=True
    ),
}


@functools.cache
def scoped_keys() -> dict[str, str]:
    """Every key whose help text opens with a scope's label, mapped to that label."""
    labels = {key: doc.partition(":")[0] for key, _, doc in field_docs()}
    return {key: label for key, label in labels.items() if label in KEY_SCOPES}


def _value(cfg: Any, key: str) -> Any:
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def unread_key_problem(cfg: SdpConfig, overrides: Sequence[str]) -> str | None:
    """One line for the first ``key=value`` of ``overrides`` that sets a key ``cfg``'s run does
    not read to something other than its default; None when there is none."""
    scoped, defaults = scoped_keys(), SdpConfig()
    for override in overrides:
        if override.startswith("~"):
            continue
        named = override.lstrip("+").partition("=")[0]
        key = next((k for k in scoped if named == k or named.startswith(k + ".")), None)
        if key is None or _value(cfg, key) == _value(defaults, key):
            continue
        scope = KEY_SCOPES[scoped[key]]
        instead = scope.missed_by(cfg)
        if instead is not None:
            return f"{key} applies to {scope.describe()}, not {instead}; {scope.fix}"
    return None
