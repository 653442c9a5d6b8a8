"""The task contract: prompts to sample, a reward for a completion, and what warm-start SFT fits.

Tasks are pure Python (no torch): the rollout loop, the warm start and the evaluation all talk to
this interface. A completion is the decoded text of the generated tokens *without* the stop token;
``stopped`` says whether generation ended on the stop token (True) or ran out of budget (False).

Training problems and held-out problems are disjoint: ``sample``/``stream`` never return a
problem that ``eval_items`` can return, so evaluation measures problems the policy never
trained on.
"""

from __future__ import annotations

import abc
import functools
import random
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Union

#: what a reward returns: a float, or a mapping with a float "score" and other floats to log
RewardValue = Union[float, Mapping[str, float]]


@dataclass(frozen=True)
class Context:
    """The model's context window and the generation budget a prompt must leave room for
    (docs/tasks.md, "Limits on a record").

    Attributes:
        tokens: the longest sequence the model takes (prompt + completion), in tokens.
        budget: the most tokens generated after a prompt.
        budget_key: the config key and value that set ``budget``, named in messages.
    """

    tokens: int
    budget: int
    budget_key: str

    @property
    def prompt_room(self) -> int:
        """The longest prompt that leaves room for the budget."""
        return self.tokens - self.budget


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
    #: greedy accuracy averages this extra of the reward instead of its score (a partial-credit
    #: task's exact match, e.g. ``"exact"``); None: the score
    accuracy_extra: str | None = None

    @abc.abstractmethod
    def sample(self, rng: random.Random, n: int) -> list[TaskItem]:
        """Draw ``n`` training problems; the same ``rng`` state gives the same problems."""

    @abc.abstractmethod
    def eval_items(self, n: int, seed: int) -> list[TaskItem]:
        """At most ``n`` distinct held-out problems (never training ones), chosen by ``seed``;
        empty when the task has no held-out split."""

    def validation_items(self, n: int, seed: int) -> list[TaskItem]:
        """At most ``n`` distinct training problems chosen by ``seed``, for model selection (the
        tiny model's warm start stops on their greedy accuracy), so that held-out problems are
        touched by evaluation only. A generated task draws them as it draws training problems."""
        chosen: dict[str, TaskItem] = {}
        # four draws per problem: a small problem space (arith1 trains on 79 pairs) is covered whole
        for item in self.sample(random.Random(seed), 4 * n):
            chosen.setdefault(item.prompt, item)
        return list(chosen.values())[:n]

    @abc.abstractmethod
    def reward(self, completion: str, item: TaskItem, *, stopped: bool) -> RewardValue:
        """Score one completion of ``item.prompt`` (e.g. 1.0 correct, 0.0 wrong)."""

    def stream(self, rng: random.Random, start: int, n: int) -> list[TaskItem]:
        """Training problems ``start .. start + n - 1`` of a run, in order: a data set walks
        seeded-shuffled epochs; a generated task draws ``n`` from ``rng``."""
        return self.sample(rng, n)

    def reward_call(self, completion: str, item: TaskItem, *, stopped: bool) -> Callable[[], RewardValue]:
        """The reward of one completion as a call without arguments, to run on a worker; a task
        whose rewards run in a process pool returns one of plain data that pickles cheaply."""
        return functools.partial(self.reward, completion, item, stopped=stopped)

    @abc.abstractmethod
    def params(self) -> dict[str, Any]:
        """JSON-serialisable description of everything that changes the task's data or scoring
        (part of the warm-start cache key: a change here must retrain)."""

    @property
    def num_problems(self) -> int | None:
        """How many distinct training problems a finite data set holds; None for a generated task."""
        return None

    def summary(self) -> str:
        """One line about the task's problems (shown at the start of a run)."""
        return f"task {self.name}: generated problems"

    def fit_warm_start(self, tokenizer: Any, context: int) -> int:
        """Keep for the warm start only the training problems whose ``prompt + answer + EOS`` fit
        in ``context`` tokens, and say how many were left out. A generated task's problems are a
        few dozen characters: none."""
        return 0

    def sft_sample(self, rng: random.Random, n: int) -> list[TaskItem]:
        """Draw ``n`` warm-start problems (``sample`` restricted by ``fit_warm_start``)."""
        return self.sample(rng, n)

    def sft_example(self, item: TaskItem) -> tuple[str, str]:
        """``(prompt, target)`` for supervised warm start; the loss covers the target and EOS."""
        return item.prompt, item.answer
