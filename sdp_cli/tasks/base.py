"""The task contract: prompts to sample, a reward for a completion, and what warm-start SFT fits.

Tasks are pure Python (no torch): the rollout loop, the warm start and the evaluation all talk to
this interface. A completion is the decoded text of the generated tokens *without* the stop token;
``stopped`` says whether generation ended on the stop token (True) or ran out of budget (False).
"""

from __future__ import annotations

import abc
import random
from dataclasses import dataclass, field
from typing import Any, Mapping


@dataclass(frozen=True)
class TaskItem:
    """One problem.

    Attributes:
        prompt: text the policy is conditioned on.
        answer: reference answer text; warm-start SFT trains on ``prompt + answer``.
        meta: task data needed to score a completion (e.g. the final number of a solution).
    """

    prompt: str
    answer: str
    meta: Mapping[str, Any] = field(default_factory=dict)


class Task(abc.ABC):
    """A verifiable task: sample problems, score completions."""

    #: registry name, e.g. ``"arith1"``
    name: str
    #: character set a character-level tiny model needs (see ``sdp_cli.models.tokenizer.CHARSETS``)
    charset: str
    #: default generation budget per completion, in tokens
    max_new_tokens: int

    @abc.abstractmethod
    def sample(self, rng: random.Random, n: int) -> list[TaskItem]:
        """Draw ``n`` problems; the same ``rng`` state gives the same problems."""

    @abc.abstractmethod
    def reward(self, completion: str, item: TaskItem, *, stopped: bool) -> float:
        """Score one completion of ``item.prompt`` (1.0 correct, 0.0 wrong)."""

    @abc.abstractmethod
    def params(self) -> dict[str, Any]:
        """JSON-serialisable description of everything that changes the task's data or scoring
        (part of the warm-start cache key: a change here must retrain)."""

    @property
    def num_problems(self) -> int | None:
        """How many distinct problems a finite data set holds; None for a generated task."""
        return None

    def sft_example(self, item: TaskItem) -> tuple[str, str]:
        """``(prompt, target)`` for supervised warm start; the loss covers the target and EOS."""
        return item.prompt, item.answer
