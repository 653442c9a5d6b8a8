"""Reward plug-ins: ``task.reward`` names a built-in or a function of yours, loaded and checked
before a run starts.

Forms: ``final_number`` | ``boxed`` | ``regex`` (``sdp_cli.tasks.rewards``),
``package.module:function`` (importable from the Python path) or ``path/to/file.py:function``.
The function is called as ``fn(prompt, completion, record, **task.reward_kwargs)`` and returns a
float or a mapping with a float ``"score"`` and other floats, logged as ``reward/<key>``
(docs/tasks.md). Every failure is one line: an import error names ``file:line``; an exception
while scoring names the function, the record and the exception, ``SystemExit`` and
``KeyboardInterrupt`` included (``RewardError`` keeps the full traceback for ``run.debug=true``
and ``events.jsonl``); a non-finite or non-numeric result is an error too.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import math
import numbers
import re
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from sdp_cli.errors import UserCodeError, UserError, describe_exception
from sdp_cli.stopsignals import Abort
from sdp_cli.tasks.rewards import BUILTINS, NEEDS_ANSWER
from sdp_cli.user_code import canonical, file_target, is_code_spec, load_function


class RewardError(UserCodeError):
    """User reward code failed or returned something unusable; ``details`` holds the traceback
    and ``key`` tells distinct errors apart (the message names the record, which varies)."""

    def __init__(self, message: str, details: str = "", *, key: str | None = None):
        super().__init__(message, details)
        self.key = key or str(self)

    def __reduce__(self) -> tuple[Any, ...]:  # keep ``details`` and ``key`` across a process pool
        return (_rebuild_reward_error, (str(self), self.details, self.key))


def _rebuild_reward_error(message: str, details: str, key: str) -> RewardError:
    return RewardError(message, details, key=key)


def reward_failure(name: str, where: str, err: BaseException) -> RewardError:
    """The RewardError of a reward function ``name`` that raised ``err`` on ``where``; errors
    raised at the same place of the same type are one distinct error."""
    frames = traceback.extract_tb(err.__traceback__)
    place = f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""
    return RewardError(
        f"reward function {name} failed on {where}: {describe_exception(err)}",
        "".join(traceback.format_exception(err)),
        key=f"{type(err).__name__}{place}",
    )


@dataclass(frozen=True)
class RewardSpec:
    """A resolvable, picklable reference to a reward function and its keyword arguments."""

    spec: str
    kwargs: tuple[tuple[str, Any], ...] = ()


def _resolve(spec: str) -> tuple[Callable[..., Any], str]:
    """(function, display name) for a ``task.reward`` value."""
    if not is_code_spec(spec):
        if spec in BUILTINS:
            return BUILTINS[spec], spec
        near = difflib.get_close_matches(spec, list(BUILTINS), n=1)
        hint = f"did you mean {near[0]}? " if near else ""
        raise UserError(
            f"task.reward={spec}: not a built-in reward ({', '.join(BUILTINS)}); {hint}"
            "for your own function give package.module:function or path/to/file.py:function"
        )
    return load_function(spec, "task.reward", module_prefix="sdp_reward")


@functools.lru_cache(maxsize=16)
def _resolve_version(spec: str, stamp: tuple[int, int]) -> tuple[Callable[..., Any], str]:
    return _resolve(spec)


def _cached(spec: str) -> tuple[Callable[..., Any], str]:
    """``_resolve`` once per spec and file version (size and modification time)."""
    path = file_target(spec)
    stat = path.stat() if path is not None and path.is_file() else None
    return _resolve_version(spec, (stat.st_mtime_ns, stat.st_size) if stat else (0, 0))


def load_reward(spec: str, kwargs: Mapping[str, Any], *, answer_key: str) -> RewardSpec:
    """Import and check a reward function now (before a run writes anything).

    Built-ins that compare with the reference get ``answer_key`` unless ``kwargs`` sets it.
    Raises a one-line UserError when the function cannot be imported or called as
    ``fn(prompt, completion, record, **kwargs)``.
    """
    given, spec = spec, canonical(spec)
    try:
        fn, name = _cached(spec)
    except UserError as err:  # name the file as the user wrote it
        path = file_target(given)
        text = str(err) if path is None else str(err).replace(str(path.resolve()), str(path))
        raise UserError(text) from None
    kwargs = dict(kwargs)
    if spec in NEEDS_ANSWER:
        kwargs.setdefault("answer_key", answer_key)
    try:
        inspect.signature(fn).bind("prompt", "completion", {}, **kwargs)
    except TypeError as err:
        raise UserError(
            f"task.reward={spec}: {name} cannot be called as fn(prompt, completion, record"
            f"{''.join(f', {k}=...' for k in kwargs)}) ({err}); fix its signature or task.reward_kwargs"
        ) from None
    except ValueError:
        pass  # builtins implemented in C have no signature; the first call reports problems
    if spec == "regex":
        from sdp_cli.tasks.rewards import compile_pattern

        try:
            compile_pattern(str(kwargs["pattern"]))
        except re.error as err:
            raise UserError(f"task.reward_kwargs.pattern={kwargs['pattern']!r} is not a valid regex ({err})") from None
    return RewardSpec(spec, tuple(sorted(kwargs.items())))


def to_score(value: Any, name: str, where: str) -> tuple[float, dict[str, float]]:
    """``(score, extras)`` of a reward function's result; RewardError for anything unusable."""
    extras: dict[str, float] = {}
    if isinstance(value, Mapping):
        if "score" not in value:
            raise RewardError(
                f"reward function {name} returned a mapping without 'score' for {where} "
                f"(keys: {', '.join(map(str, value)) or 'none'}); return {{'score': float, ...}}",
                key="a mapping without 'score'",
            )
        for key, extra in value.items():
            if key != "score":
                extras[str(key)] = _finite(extra, name, where, f"{key!r}")
        value = value["score"]
    return _finite(value, name, where, "score"), extras


def _finite(value: Any, name: str, where: str, what: str) -> float:
    # bool is a Real: `return answer == expected` scores 1.0 or 0.0
    if not isinstance(value, numbers.Real):
        raise RewardError(
            f"reward function {name} returned {type(value).__name__} {value!r:.40} as its {what} for {where}; "
            "return a float (or {'score': float, ...})",
            key=f"a {type(value).__name__} as its {what}",
        )
    value = float(value)
    if not math.isfinite(value):
        raise RewardError(
            f"reward function {name} returned {value} as its {what} for {where}; rewards must be finite",
            key=f"{value} as its {what}",
        )
    return value


def call_reward(
    reward: RewardSpec, prompt: str, completion: str, record: Mapping[str, Any], where: str
) -> float | dict[str, float]:
    """Score one completion: the score, or ``{"score": ..., **extras}``, checked; RewardError
    names the function and the record.

    A module-level function of plain data, so that a process pool can run it. A ``sys.exit`` or
    ``KeyboardInterrupt`` of the function is its failure too; only a second Ctrl-C's
    :class:`~sdp_cli.stopsignals.Abort` passes through.
    """
    fn, name = _cached(reward.spec)
    try:
        value = fn(prompt, completion, record, **dict(reward.kwargs))
    except Abort:
        raise
    except BaseException as err:
        raise reward_failure(name, where, err) from None
    score, extras = to_score(value, name, where)
    return {"score": score, **extras} if extras else score
