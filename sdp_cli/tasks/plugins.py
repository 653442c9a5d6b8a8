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
import hashlib
import importlib
import importlib.util
import inspect
import math
import numbers
import re
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from sdp_cli.errors import UserError, describe_exception
from sdp_cli.stopsignals import Abort
from sdp_cli.tasks.rewards import BUILTINS, NEEDS_ANSWER


class RewardError(UserError):
    """User reward code failed or returned something unusable; ``details`` holds the traceback
    and ``key`` tells distinct errors apart (the message names the record, which varies)."""

    def __init__(self, message: str, details: str = "", *, key: str | None = None):
        super().__init__(message)
        self.details = details
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


def _where_in(exc: BaseException, path: Path | None) -> str:
    """``file:line`` of the deepest traceback frame in ``path`` (or the deepest frame at all)."""
    frames = traceback.extract_tb(exc.__traceback__)
    if path is not None:
        inside = [f for f in frames if Path(f.filename).resolve() == path.resolve()]
        frames = inside or frames
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else str(path or "")


def _import_file(path: Path, spec: str) -> Any:
    if not path.is_file():
        raise UserError(f"task.reward={spec}: {path} does not exist; give path/to/file.py:function")
    # one module per file version: an edited file is imported afresh, never a stale copy
    stat = path.stat()
    digest = hashlib.sha256(f"{path.resolve()}:{stat.st_mtime_ns}:{stat.st_size}".encode()).hexdigest()[:12]
    name = f"sdp_reward_{path.stem}_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    module_spec = importlib.util.spec_from_file_location(name, path)
    assert module_spec is not None and module_spec.loader is not None, f"no import spec for {path}"
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module  # dataclasses and process pools look the module up by name
    try:
        module_spec.loader.exec_module(module)
    except SyntaxError as err:
        del sys.modules[name]
        raise UserError(f"{err.filename}:{err.lineno}: SyntaxError: {err.msg} (task.reward={spec}); fix the file") from None
    except Exception as err:
        del sys.modules[name]
        raise UserError(
            f"{_where_in(err, path)}: {type(err).__name__}: {err} while importing task.reward={spec}; fix the file"
        ) from None
    return module


def _import_module(module_name: str, spec: str) -> Any:
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name and module_name.startswith(err.name):
            raise UserError(
                f"task.reward={spec}: no module {err.name!r} on the Python path; install it, "
                "add its directory to PYTHONPATH, or give a file: task.reward=path/to/file.py:function"
            ) from None
        raise UserError(f"{_where_in(err, None)}: {err} while importing task.reward={spec}; fix the import") from None
    except SyntaxError as err:
        raise UserError(f"{err.filename}:{err.lineno}: SyntaxError: {err.msg} (task.reward={spec}); fix the file") from None
    except Exception as err:
        raise UserError(
            f"{_where_in(err, None)}: {type(err).__name__}: {err} while importing task.reward={spec}; fix the module"
        ) from None


def _resolve(spec: str) -> tuple[Callable[..., Any], str]:
    """(function, display name) for a ``task.reward`` value."""
    if ":" not in spec or spec.startswith(("http:", "https:")):
        if spec in BUILTINS:
            return BUILTINS[spec], spec
        near = difflib.get_close_matches(spec, list(BUILTINS), n=1)
        hint = f"did you mean {near[0]}? " if near else ""
        raise UserError(
            f"task.reward={spec}: not a built-in reward ({', '.join(BUILTINS)}); {hint}"
            "for your own function give package.module:function or path/to/file.py:function"
        )
    target, _, attr = spec.rpartition(":")
    if not target or not attr.isidentifier():
        raise UserError(f"task.reward={spec}: expected package.module:function or path/to/file.py:function")
    is_file = target.endswith(".py") or "/" in target or "\\" in target
    module = _import_file(Path(target).expanduser(), spec) if is_file else _import_module(target, spec)
    fn = getattr(module, attr, None)
    if fn is None:
        defined = sorted(n for n, v in vars(module).items() if inspect.isfunction(v) and not n.startswith("_"))
        near = difflib.get_close_matches(attr, defined, n=1)
        hint = f"did you mean {near[0]}?" if near else f"it defines {', '.join(defined) or 'no functions'}"
        raise UserError(f"task.reward={spec}: {target} has no function {attr!r}; {hint}")
    if not callable(fn):
        raise UserError(f"task.reward={spec}: {target}.{attr} is a {type(fn).__name__}, not a function")
    return fn, f"{Path(target).name if is_file else target}:{attr}"


def _file_target(spec: str) -> Path | None:
    """The file of a ``path/to/file.py:function`` spec (None for other forms)."""
    target = spec.rpartition(":")[0]
    if ":" not in spec or not (target.endswith(".py") or "/" in target or "\\" in target):
        return None
    return Path(target).expanduser()


def _canonical(spec: str) -> str:
    """The spec with an absolute file path, the same from any working directory or worker."""
    path = _file_target(spec)
    return spec if path is None else f"{path.resolve()}:{spec.rpartition(':')[2]}"


@functools.lru_cache(maxsize=16)
def _resolve_version(spec: str, stamp: tuple[int, int]) -> tuple[Callable[..., Any], str]:
    return _resolve(spec)


def _cached(spec: str) -> tuple[Callable[..., Any], str]:
    """``_resolve`` once per spec and file version (size and modification time)."""
    path = _file_target(spec)
    stat = path.stat() if path is not None and path.is_file() else None
    return _resolve_version(spec, (stat.st_mtime_ns, stat.st_size) if stat else (0, 0))


def load_reward(spec: str, kwargs: Mapping[str, Any], *, answer_key: str) -> RewardSpec:
    """Import and check a reward function now (before a run writes anything).

    Built-ins that compare with the reference get ``answer_key`` unless ``kwargs`` sets it.
    Raises a one-line UserError when the function cannot be imported or called as
    ``fn(prompt, completion, record, **kwargs)``.
    """
    given, spec = spec, _canonical(spec)
    try:
        fn, name = _cached(spec)
    except UserError as err:  # name the file as the user wrote it
        path = _file_target(given)
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
