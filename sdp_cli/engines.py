"""The inference engines, declared once (docs/design.md §6 "Adding an engine"; torch-free).

An engine's entry here is everything the rest of sdp knows about it:

- ``build``: the function ``fn(cfg, policy, run_dir, *, device, threads) -> InferenceEngine`` that
  makes the run's engine at version 0 (``device`` and ``threads``: where a local engine computes) (a built-in names it as ``"module:function"``, imported at first use,
  so that validating a config never imports torch);
- ``server``: the engine is another project's inference server (vLLM, SGLang), reached over HTTP
  and started from its own virtualenv or attached to by URL: the ``engine.urls``, ``launch``,
  ``python``, ``host``, ``port``, ``api_key_env``, ``extra_args`` and ``env`` keys apply to it, and
  weight pushes are safetensors directories in the run directory. Otherwise sdp runs the model with
  its own torch code (the local engine), so its bfloat16 is this CPU's;
- ``dtypes``: the ``engine.dtype`` values it takes besides null, and ``default_dtype``: what null
  means (None: ``train.dtype``, the local engine's copy follows the trainer);
- ``prepare`` and ``start`` (optional, both ``"module:function"``): the build in two halves, so
  that ``sdp train`` runs the rollout side in a process of its own (docs/training.md "Three
  processes"): ``prepare(cfg, policy, run_dir, *, device, threads, scratch) -> dict`` in sdp's
  process, where the policy is (it writes what the engine starts from into ``scratch``, a
  directory the rollout process made and removes when it ends, and returns the rest as plain
  data), and ``start(cfg, recipe, run_dir, *, warm) -> InferenceEngine`` in the rollout process.
  ``engine.in_process=true`` builds the engine in sdp's process instead (``build``);
- ``warm`` (optional, ``"module:function"``, with ``prepare`` and ``start``): what the rollout
  process starts as soon as it runs, before its recipe, so that the engine's imports overlap
  sdp's: ``warm(scratch, *, threads, model_type) -> object`` (its ``discard()`` ends it if
  unused); ``start`` gets it as ``warm`` (None when there is none).

What an engine *object* can do (take an in-memory state dict, compute in the caller's threads)
is declared by its class (``sdp_cli/engine/base.py`` ``InferenceEngine``). The config validates
``engine.kind`` against this registry and ``sdp train`` builds the engine from it; nothing under
``sdp_cli/train/`` names an engine.
"""

from __future__ import annotations

import difflib
import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sdp_cli.choices import TRAIN_DTYPES
from sdp_cli.errors import UserError

#: engine.dtype values a local engine takes (the trainer's dtypes)
LOCAL_DTYPES = TRAIN_DTYPES
#: engine.dtype values a launched server takes (``auto``: the weights' own)
SERVER_DTYPES = (*TRAIN_DTYPES, "float16", "auto")


@dataclass(frozen=True)
class EngineKind:
    """One registered engine (see the module docstring)."""

    name: str
    build: Callable[..., Any] | str = field(repr=False)
    server: bool = False
    dtypes: tuple[str, ...] = LOCAL_DTYPES
    default_dtype: str | None = None
    doc: str = ""
    prepare: str | None = None
    start: str | None = None
    warm: str | None = None

    def builder(self) -> Callable[..., Any]:
        """The build function, imported at first use when named as ``module:function``."""
        if callable(self.build):
            return self.build
        return _import(self.build)

    def own_process(self, cfg: Any) -> bool:
        """Whether ``sdp train`` runs the rollout side, and this engine's client, in the rollout
        process: the engine builds in two halves and ``engine.in_process`` is off."""
        return self.prepare is not None and self.start is not None and not cfg.engine.in_process

    def preparer(self) -> Callable[..., Any]:
        assert self.prepare is not None, f"engine {self.name!r} has no prepare half"
        return _import(self.prepare)

    def starter(self) -> Callable[..., Any]:
        assert self.start is not None, f"engine {self.name!r} has no start half"
        return _import(self.start)

    def warmer(self) -> Callable[..., Any] | None:
        return None if self.warm is None else _import(self.warm)

    def weight_dtype(self, cfg: Any) -> str:
        """``engine.dtype`` resolved: as set, or null's meaning for this engine."""
        if cfg.engine.dtype is not None:
            return cfg.engine.dtype
        return self.default_dtype or cfg.train.dtype

    def attaches(self, cfg: Any) -> bool:
        """Whether the run attaches to running servers (``engine.urls``) instead of starting one."""
        return self.server and bool(cfg.engine.urls)

    def launches(self, cfg: Any) -> bool:
        """Whether sdp starts another project's server (a server engine without ``engine.urls``)."""
        return self.server and not cfg.engine.urls


@functools.lru_cache(maxsize=None)
def _import(reference: str) -> Callable[..., Any]:
    module, _, name = reference.partition(":")
    return getattr(importlib.import_module(module), name)


#: every registered engine, in registration order
ENGINES: dict[str, EngineKind] = {}


def register(kind: EngineKind) -> EngineKind:
    """Add ``kind`` to the registry (a name is registered once)."""
    assert kind.name not in ENGINES, f"engine {kind.name!r} is registered already"
    assert kind.default_dtype is None or kind.default_dtype in kind.dtypes, (
        f"engine {kind.name!r}: default_dtype {kind.default_dtype!r} is not among its dtypes {kind.dtypes}"
    )
    ENGINES[kind.name] = kind
    return kind


def register_engine(
    name: str, *, server: bool = False, dtypes: tuple[str, ...] = LOCAL_DTYPES, default_dtype: str | None = None
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: register ``build(cfg, policy, run_dir, *, device, threads) -> InferenceEngine`` as
    engine ``name``."""

    def decorate(build: Callable[..., Any]) -> Callable[..., Any]:
        register(EngineKind(name, build, server, tuple(dtypes), default_dtype, (build.__doc__ or "").strip()))
        return build

    return decorate


def unregister(name: str) -> None:
    """Remove engine ``name`` (tests that register toy engines leave the registry as they found it)."""
    del ENGINES[name]


def engine_names() -> tuple[str, ...]:
    return tuple(ENGINES)


def engine_dtypes(*, servers: bool = False) -> tuple[str, ...]:
    """Every ``engine.dtype`` value some registered engine takes (``servers``: a server engine)."""
    return tuple(dict.fromkeys(d for k in ENGINES.values() if k.server or not servers for d in k.dtypes))


def engine_kind(name: str) -> EngineKind:
    """The registered engine ``name``; one-line UserError naming the registered ones otherwise."""
    if name in ENGINES:
        return ENGINES[name]
    near = difflib.get_close_matches(name, list(ENGINES), n=1)
    hint = f" (did you mean {near[0]}?)" if near else ""
    raise UserError(f"engine.kind={name!r} is not an engine; choose one of {', '.join(ENGINES)}{hint}")


register(EngineKind(
    "local", "sdp_cli.engine.factory:build_local",
    doc="sdp's own engine: a transformers copy of the policy with its own sampling loop, in its own "
    "process (engine.in_process=true: in sdp's process)",
    prepare="sdp_cli.engine.factory:prepare_local", start="sdp_cli.engine.factory:start_local",
    warm="sdp_cli.engine.factory:warm_local",
))  # fmt: skip
register(EngineKind(
    "vllm", "sdp_cli.engine.factory:build_vllm", server=True, dtypes=SERVER_DTYPES, default_dtype="float32",
    doc="vLLM's OpenAI-compatible server in development mode",
))  # fmt: skip
register(EngineKind(
    "sglang", "sdp_cli.engine.factory:build_sglang", server=True, dtypes=SERVER_DTYPES, default_dtype="float32",
    doc="SGLang's native HTTP server",
))  # fmt: skip
