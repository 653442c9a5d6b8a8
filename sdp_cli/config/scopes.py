"""Which runs read which keys: a key set on the command line that the run never reads (another
model's, another engine's, LoRA's without LoRA) is refused in one line, instead of being accepted
and ignored.

A key's scope is the label its ``--help-config`` text opens with (``model.path`` is documented as
"hf: the model directory ..."), so the help a user reads and the check are one statement. Only
keys named in overrides are judged: sdp's own config files (``+debug=fast`` sets the tiny model's
size) may set keys a run then does not read, and a key set to its default asks for nothing.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from operator import attrgetter

from sdp_cli.config.schema import SdpConfig, field_docs
from sdp_cli.engines import ENGINES, EngineKind, engine_kind


@dataclass(frozen=True)
class KeyScope:
    """The runs that read the keys documented as ``<label>: ...``. ``missed_by(cfg)`` says what
    ``cfg`` runs instead (None: it reads them); ``text`` names the runs in a message
    (``{servers}``: the server engines registered), ``fix`` says what to do."""

    text: str
    missed_by: Callable[[SdpConfig], str | None]
    fix: str = "remove it"

    def describe(self) -> str:
        servers = ", ".join(f"engine={name}" for name, kind in ENGINES.items() if kind.server)
        return self.text.format(servers=servers)


def _model(kind: str) -> Callable[[SdpConfig], str | None]:
    return lambda cfg: None if cfg.model.kind == kind else f"model.kind={cfg.model.kind}"


def _engine(accepts: Callable[[EngineKind], bool], attached: bool | None = None) -> Callable[[SdpConfig], str | None]:
    """Engines ``accepts`` takes, with ``engine.urls`` (attached True), without (False) or either."""

    def missed_by(cfg: SdpConfig) -> str | None:
        kind = engine_kind(cfg.engine.kind)
        if not accepts(kind):
            return f"engine.kind={kind.name}"
        if attached is None or attached == bool(cfg.engine.urls):
            return None
        return "the servers of engine.urls, which sdp attaches to" if cfg.engine.urls else "a server sdp launches"

    return missed_by


def _is_server(kind: EngineKind) -> bool:
    return kind.server


def _is_vllm(kind: EngineKind) -> bool:
    return kind.name == "vllm"


KEY_SCOPES: dict[str, KeyScope] = {
    "tiny": KeyScope("model.kind=tiny", _model("tiny")),
    "hf": KeyScope("model.kind=hf", _model("hf"), fix="add model=hf to train the model it names, or remove it"),
    "LoRA": KeyScope(
        "LoRA (model.lora.r > 0)",
        lambda cfg: None if cfg.model.lora.r > 0 else f"model.lora.r={cfg.model.lora.r}",
        fix="set model.lora.r too, or remove it",
    ),
    "local engine": KeyScope("the local engine (engine=local)", _engine(lambda kind: not kind.server)),
    "remote engines": KeyScope("remote engines ({servers})", _engine(_is_server), fix="choose one of them, or remove it"),
    "launched servers": KeyScope("a server sdp launches ({servers} without engine.urls)", _engine(_is_server, False)),
    "launched vllm": KeyScope("a vLLM server sdp launches (engine=vllm without engine.urls)", _engine(_is_vllm, False)),
    "attached vllm": KeyScope("vLLM servers sdp attaches to (engine=vllm with engine.urls)", _engine(_is_vllm, True)),
    "reward_errors=zero": KeyScope(
        "task.reward_errors=zero",
        lambda cfg: None if cfg.task.reward_errors == "zero" else f"task.reward_errors={cfg.task.reward_errors}",
    ),
}


@functools.cache
def scoped_keys() -> dict[str, str]:
    """Every key whose help text opens with a scope's label, mapped to that label."""
    labels = {key: doc.partition(":")[0] for key, _, doc in field_docs()}
    return {key: label for key, label in labels.items() if label in KEY_SCOPES}


def unread_keys(cfg: SdpConfig, overrides: Sequence[str]) -> dict[str, str]:
    """Each key a ``key=value`` of ``overrides`` sets to other than its default that ``cfg``'s run
    does not read, with the one line that says so, in the order of ``overrides``."""
    if not overrides:  # the key table reads the schema's source: not for nothing
        return {}
    scoped, defaults = scoped_keys(), SdpConfig()
    found: dict[str, str] = {}
    for override in overrides:
        named = override.lstrip("+").partition("=")[0]  # `~key` is refused before (config/overrides.py)
        key = next((k for k in scoped if named == k or named.startswith(k + ".")), None)
        if key is None or key in found or attrgetter(key)(cfg) == attrgetter(key)(defaults):
            continue
        scope = KEY_SCOPES[scoped[key]]
        instead = scope.missed_by(cfg)
        if instead is not None:
            found[key] = f"{key} applies to {scope.describe()}, not {instead}; {scope.fix}"
    return found


def unread_key_problem(cfg: SdpConfig, overrides: Sequence[str]) -> str | None:
    """The first of ``unread_keys``, or None."""
    return next(iter(unread_keys(cfg, overrides).values()), None)
