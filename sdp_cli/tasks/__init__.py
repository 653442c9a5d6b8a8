"""Verifiable tasks (prompts + rewards) and the ``build_task`` factory.

Pure Python: importing this package does not import torch.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

from sdp_cli.choices import DATA_TASKS
from sdp_cli.dataset_options import DATASET_OPTIONS, DatasetOptions
from sdp_cli.errors import UserError
from sdp_cli.tasks import gsm8k
from sdp_cli.tasks.arith import AdditionTask
from sdp_cli.tasks.base import RewardValue, Task, TaskItem
from sdp_cli.tasks.dataset import DatasetTask
from sdp_cli.tasks.gsm8k import Gsm8kTask
from sdp_cli.tasks.runsum import RunningSumTask


def _arith1(max_new_tokens: int = 4) -> Task:
    # answers are 0..18: at most 2 digits + EOS, plus one token of slack
    return AdditionTask("arith1", 0, 9, max_new_tokens)


def _arith2(max_new_tokens: int = 5) -> Task:
    # answers are 20..198: at most 3 digits + EOS, plus one token of slack
    return AdditionTask("arith2", 10, 99, max_new_tokens)


def _runsum(digits: int = 6, max_new_tokens: int | None = None) -> Task:
    # the default budget is the longest answer + EOS, plus one token of slack
    return RunningSumTask(digits, max_new_tokens)


def _gsm8k(**options: Any) -> Task:
    path = options.pop("path", None) or str(gsm8k.sample_path())
    return Gsm8kTask(DatasetOptions(path=path, **{**gsm8k.DEFAULTS, **options}))


def _dataset(**options: Any) -> Task:
    return DatasetTask(DatasetOptions(**options))


TASKS: dict[str, Callable[..., Task]] = {
    "arith1": _arith1,
    "arith2": _arith2,
    "runsum": _runsum,
    "gsm8k": _gsm8k,
    "dataset": _dataset,
}


def task_parameters(name: str) -> list[str]:
    """The keyword arguments ``build_task(name, ...)`` accepts."""
    if name in DATA_TASKS:
        return list(DATASET_OPTIONS)
    return list(inspect.signature(TASKS[name]).parameters)


def build_task(name: str, **kwargs: Any) -> Task:
    """The task called ``name`` with its parameters, e.g. ``build_task("gsm8k", path="train.jsonl")``.

    Raises UserError (one line) for an unknown name or parameter and for bad data.
    """
    factory = TASKS.get(name)
    if factory is None:
        raise UserError(f"unknown task {name!r}; choose one of {', '.join(sorted(TASKS))}")
    accepted = task_parameters(name)
    unknown = sorted(set(kwargs) - set(accepted))
    if unknown:
        raise UserError(
            f"task {name!r} has no parameter {unknown[0]!r}; it accepts {', '.join(accepted) or 'none'}"
        )
    if "max_new_tokens" in kwargs and (not isinstance(kwargs["max_new_tokens"], int) or kwargs["max_new_tokens"] < 1):
        raise UserError(f"task {name!r}: max_new_tokens must be a positive integer, got {kwargs['max_new_tokens']!r}")
    return factory(**kwargs)


__all__ = [
    "AdditionTask",
    "DATA_TASKS",
    "DatasetOptions",
    "DatasetTask",
    "Gsm8kTask",
    "RewardValue",
    "RunningSumTask",
    "TASKS",
    "Task",
    "TaskItem",
    "build_task",
    "task_parameters",
]
