"""The options of a data-set task (``task=dataset``, ``task=gsm8k``; docs/tasks.md): the one list
of its keys. The task takes them (``sdp_cli/tasks/dataset.py``); ``sdp train`` hands it the
``task.*`` keys of these names that the config sets (``sdp_cli/train/session/task_setup.py``); config
validation refuses them for the other tasks. Standard library only, so that the config layer
reads it without importing the tasks.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any


@dataclass
class DatasetOptions:
    """The ``task.*`` keys of a data-set task (documented in ``sdp_cli.config.schema.TaskConfig``),
    plus what ``sdp train`` takes from elsewhere: ``seed`` (the run's) and ``max_new_tokens``."""

    path: str | None = None
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    prompt_template: str | None = None
    chat_template: bool = False
    system_prompt: str | None = None
    reward: str | None = None
    reward_kwargs: dict[str, Any] = field(default_factory=dict)
    require_stop: bool = True
    eval_path: str | None = None
    eval_fraction: float | None = None
    max_prompt_tokens: int | None = None
    shuffle: bool = True
    seed: int = 0
    max_new_tokens: int = 256


#: the names of the options, in order
DATASET_OPTIONS = tuple(f.name for f in fields(DatasetOptions))
