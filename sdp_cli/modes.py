"""The correction modes, declared once (docs/design.md §4 "Adding a mode"; torch-free).

A mode is the behavioural importance weight of the PPO loss, given by its log ratio
(docs/math.md §1). Its entry here is everything the rest of sdp knows about it:

- ``needs``: the log-probs its weight reads besides π_behav (``proximal_logprobs`` = π_prox,
  ``proximal_logprobs_t`` = π_prox_t = π_{v+1}). A mode that reads π_prox_t makes the run keep
  the engine's recompute pass; a mode that reads neither has no weight (bypass).
- ``anchor``: the policy the PPO ratio is taken against (``proximal``: π_prox, ``behav``: π_behav).
- ``params``: the ``loss.*`` keys its kernel takes (segment_wise: ``drift_clip``).
- ``kernel``: the function ``fn(old, proximal, proximal_t, mask, **params)`` returning the detached
  log ratio (a [B, T] tensor, or None for no weight); a built-in names it as ``"module:function"``
  and it is imported at first use, so validating a config never imports torch.

The config validates ``loss.mode`` against this registry, the trainer reads a mode's needs and
anchor from it, and its shadow metrics, ``sdp inspect-weights`` rows, ``sdp recompute --mode``
and the ablate report's columns all iterate over it. A mode of your own is one function:
``register_mode`` from Python, or ``loss.mode=path/to/file.py:function`` (a function decorated
with ``@mode(...)``, see ``load_user_mode``), which is checked on a small batch before a run
writes anything.
"""

from __future__ import annotations

import functools
import importlib
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sdp_cli.errors import UserCodeError, UserError, describe_exception
from sdp_cli.stopsignals import Abort
from sdp_cli.user_code import canonical, file_target, is_code_spec, load_function, where_in

#: the log-probs a mode's weight may read besides π_behav
INPUTS = ("proximal_logprobs", "proximal_logprobs_t")
#: what the PPO ratio is anchored at: π_prox or π_behav
ANCHORS = ("proximal", "behav")
#: the suffix of a mode's drift-clipped weight (inspect-weights row, shadow metrics)
DRIFT_SUFFIX = "_drift"
#: the attribute ``@mode`` sets on a function of yours
_DECLARATION = "sdp_mode"


@dataclass(frozen=True)
class Mode:
    """One correction mode (see the module docstring)."""

    name: str
    needs: tuple[str, ...]
    anchor: str
    kernel: Callable[..., Any] | str = field(repr=False)
    params: tuple[str, ...] = ()
    doc: str = ""
    #: the ``loss.mode`` value a mode of yours was loaded from (None: built in or registered in Python)
    source: str | None = None

    @property
    def reads_proximal(self) -> bool:
        return "proximal_logprobs" in self.needs

    @property
    def reads_proximal_t(self) -> bool:
        """Its weight reads π_prox_t, so the run keeps the engine's recompute pass."""
        return "proximal_logprobs_t" in self.needs

    @property
    def has_weight(self) -> bool:
        """A weight reads π_prox or π_prox_t; bypass reads neither (w ≡ 1)."""
        return bool(self.needs)

    @property
    def takes_drift_clip(self) -> bool:
        return "drift_clip" in self.params

    def function(self) -> Callable[..., Any]:
        """The kernel, imported at first use when named as ``module:function``."""
        if callable(self.kernel):
            return self.kernel
        return _import_kernel(self.kernel)

    def log_ratio(self, old: Any, proximal: Any, proximal_t: Any, mask: Any, **params: Any) -> Any:
        """The detached log ratio of this mode's weight ([B, T], or None for no weight). Inputs are
        detached here; the result of a mode of yours is checked (shape, finite where ``mask``,
        no gradient), and a bad one or a raise is a ``UserCodeError``: one line naming its
        source, its traceback kept."""
        detached = [None if x is None else x.detach() for x in (old, proximal, proximal_t)]
        if self.source is None:
            return self.function()(*detached, mask, **params)
        try:
            result = self.function()(*detached, mask, **params)
        except Abort:  # a second Ctrl-C
            raise
        except BaseException as err:  # your code (its sys.exit too): one line, its traceback kept
            raise _failed(self, err) from err
        _check_result(self, result, old, mask)
        return result


@functools.lru_cache(maxsize=None)
def _import_kernel(reference: str) -> Callable[..., Any]:
    module, _, name = reference.partition(":")
    return getattr(importlib.import_module(module), name)


#: every registered mode, in registration order (the order of help texts and reports)
MODES: dict[str, Mode] = {}


def register(mode: Mode) -> Mode:
    """Add ``mode`` to the registry (a name is registered once)."""
    assert mode.name not in MODES, f"mode {mode.name!r} is registered already"
    assert set(mode.needs) <= set(INPUTS), f"mode {mode.name!r}: needs must be among {INPUTS}, got {mode.needs}"
    assert mode.anchor in ANCHORS, f"mode {mode.name!r}: anchor must be one of {ANCHORS}, got {mode.anchor!r}"
    MODES[mode.name] = mode
    return mode


def register_mode(
    name: str, *, needs: tuple[str, ...], anchor: str, params: tuple[str, ...] = (), doc: str = ""
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: register ``fn(old, proximal, proximal_t, mask, **params)`` as mode ``name``."""

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        register(Mode(name, tuple(needs), anchor, fn, tuple(params), doc or (fn.__doc__ or "").strip()))
        return fn

    return decorate


def unregister(name: str) -> None:
    """Remove mode ``name`` (tests that register toy modes leave the registry as they found it)."""
    del MODES[name]


register(Mode(
    "bypass", (), "behav", "sdp_cli.core.weights:bypass_log_ratio",
    doc="no behavioural weight, the PPO ratio taken against π_behav",
))
register(Mode(
    "decoupled", ("proximal_logprobs",), "proximal", "sdp_cli.core.weights:decoupled_log_ratio",
    doc="w = π_prox/π_behav (AReaL's decoupled PPO)",
))
register(Mode(
    "segment_wise", ("proximal_logprobs_t",), "proximal", "sdp_cli.core.weights:segment_wise_log_ratio",
    params=("drift_clip",),
    doc="w = π_{v+1}/π_v, the one-step weight (with drift_clip κ, times the drift factor π_prox/π_{v+1} clipped into [1/κ, κ])",
))


# ---------------------------------------------------------------- names of weights
def mode_names() -> tuple[str, ...]:
    """Every registered mode's name."""
    return tuple(MODES)


def weight_names() -> tuple[str, ...]:
    """Every weight a report can name: each mode, followed by ``<mode>_drift``, its
    drift-clipped weight, when it takes ``drift_clip`` (the rows of ``sdp inspect-weights``;
    built in: bypass, decoupled, segment_wise, segment_wise_drift)."""
    names: list[str] = []
    for mode in MODES.values():
        names.append(mode.name)
        if mode.takes_drift_clip:
            names.append(mode.name + DRIFT_SUFFIX)
    return tuple(names)


def drift_clipped_mode(name: str) -> str | None:
    """The mode whose drift-clipped weight ``name`` is (``segment_wise_drift`` → segment_wise);
    None for a mode's own weight."""
    base = name.removesuffix(DRIFT_SUFFIX)
    return base if base != name and name not in MODES and base in MODES and MODES[base].takes_drift_clip else None


def weight_mode(name: str) -> Mode:
    """The mode behind weight ``name`` (a mode, or a drift-clipped ``<mode>_drift``)."""
    return MODES[drift_clipped_mode(name) or name]


def shadow_weights() -> tuple[str, ...]:
    """The weights a run measures besides the one it trains with (``shadow/<name>/*`` metrics,
    the ablate report's columns): ``weight_names`` less the modes without a weight. Built in:
    decoupled, segment_wise, segment_wise_drift."""
    return tuple(n for n in weight_names() if weight_mode(n).has_weight)


# ---------------------------------------------------------------- loss.mode values
def resolve_mode(value: str) -> Mode:
    """The mode a ``loss.mode`` value names: a registered name, or a function of yours
    (``path/to/file.py:function`` or ``package.module:function``, loaded by ``load_user_mode``).
    One-line UserError for anything else."""
    if value in MODES:
        return MODES[value]
    if is_code_spec(value):
        return load_user_mode(value)
    import difflib

    near = difflib.get_close_matches(value, list(MODES), n=1)
    hint = f"did you mean {near[0]}? " if near else ""
    raise UserError(
        f"loss.mode={value!r} is not valid; choose one of {', '.join(MODES)}, {hint}"
        "or give your own weight as path/to/file.py:function"
    )


def mode(
    *, needs: tuple[str, ...], anchor: str = "proximal", name: str | None = None
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Declare a function of yours as a correction mode, for ``loss.mode=file.py:function``::

        from sdp_cli.modes import mode

        @mode(needs=("proximal_logprobs",), anchor="proximal")
        def half_decoupled(old, proximal, proximal_t, mask):
            return 0.5 * (proximal - old)

    ``name`` (default: the function's name) is what shadow metrics, inspect-weights rows and
    report columns call it. Nothing is registered until a config names the function."""

    def declare(fn: Callable[..., Any]) -> Callable[..., Any]:
        setattr(fn, _DECLARATION, {"needs": tuple(needs), "anchor": anchor, "name": name or fn.__name__})
        return fn

    return declare


#: modes loaded from your code: canonical spec → (file version, mode)
_LOADED: dict[str, tuple[tuple[int, int], Mode]] = {}


def load_user_mode(spec: str) -> Mode:
    """Import the function ``spec`` names, register it as a mode (once per file version) and
    check it on a small batch: it must return a detached tensor of its inputs' shape, finite at
    every valid token. One-line UserError naming the file otherwise."""
    key = canonical(spec)
    path = file_target(spec)
    stamp = (path.stat().st_mtime_ns, path.stat().st_size) if path is not None and path.is_file() else (0, 0)
    loaded = _LOADED.get(key)
    if loaded is not None and loaded[0] == stamp:
        if MODES.get(loaded[1].name) is not loaded[1]:
            _claim(loaded[1].name, key, spec)
            register(loaded[1])
        return loaded[1]
    fn, display = load_function(spec, "loss.mode", module_prefix="sdp_mode")
    declared = getattr(fn, _DECLARATION, None)
    if declared is None:
        raise UserError(
            f"loss.mode={spec}: {display} is not declared as a mode; decorate it with "
            "@sdp_cli.modes.mode(needs=(...), anchor='proximal') (docs/design.md \"Adding a mode\")"
        )
    name, needs, anchor = declared["name"], declared["needs"], declared["anchor"]
    bad_needs = [n for n in needs if n not in INPUTS]
    if bad_needs or anchor not in ANCHORS or not name.isidentifier():
        raise UserError(
            f"loss.mode={spec}: @mode(needs={needs!r}, anchor={anchor!r}, name={name!r}) is not valid; needs "
            f"are among {', '.join(INPUTS)}, anchor one of {', '.join(ANCHORS)}, name an identifier"
        )
    _claim(name, key, spec)
    user_mode = register(Mode(name, needs, anchor, fn, doc=(fn.__doc__ or "").strip(), source=key))
    try:
        _try_on_a_small_batch(user_mode)
    except UserError:
        unregister(name)
        raise
    _LOADED[key] = (stamp, user_mode)
    return user_mode


def _claim(name: str, key: str, spec: str) -> None:
    """Free ``name`` for the mode loaded from ``key``: refused when a built-in mode or another
    file holds it; an older version of the same file gives it up."""
    taken = MODES.get(name)
    if taken is None:
        return
    if taken.source != key:
        raise UserError(
            f"loss.mode={spec}: the name {name!r} is taken by "
            f"{'a built-in mode' if taken.source is None else taken.source}; pass name=... to @mode"
        )
    unregister(name)


def _try_on_a_small_batch(user_mode: Mode) -> None:
    """Call the mode once on 2 × 3 made-up log-probs (one padding token) before a run starts."""
    import torch

    old = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.2, 0.0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    try:
        user_mode.log_ratio(old, old - 0.1, old + 0.1, mask)
    except UserCodeError as err:
        raise UserError(f"{err} (on a small batch, before the run)") from None


def _failed(user_mode: Mode, err: BaseException) -> UserCodeError:
    """The one line of a mode of yours that raised ``err``: where in your file, and what."""
    return UserCodeError(
        f"{where_in(err, file_target(user_mode.source or ''))}: {describe_exception(err)} "
        f"in loss.mode={user_mode.source}; fix the function",
        "".join(traceback.format_exception(err)),
    )


def _check_result(user_mode: Mode, result: Any, old: Any, mask: Any) -> None:
    """The contract of a mode's result (a boundary: this is your code's output)."""
    where = f"loss.mode={user_mode.source}"
    if result is None:
        if user_mode.has_weight:
            raise UserCodeError(f"{where} returned None although it declares needs={user_mode.needs}; return a tensor")
        return
    shape = getattr(result, "shape", None)
    if shape is None or tuple(shape) != tuple(old.shape) or not result.is_floating_point():
        raise UserCodeError(
            f"{where} returned {type(result).__name__} of shape {None if shape is None else tuple(shape)}; "
            f"return a float tensor of the log-probs' shape {tuple(old.shape)}"
        )
    if result.requires_grad:
        raise UserCodeError(f"{where} returned a tensor that requires a gradient; the weight is a fixed number: detach it")
    valid = result[mask.bool()] if mask is not None else result
    if valid.numel() and not bool(valid.isfinite().all()):
        bad = float(valid[~valid.isfinite()][0])
        raise UserCodeError(f"{where} returned {bad} at a valid token; return a finite log ratio (0 = weight 1)")
