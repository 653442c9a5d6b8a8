"""Greedy accuracy of a policy on a task: the mean reward of argmax completions on held-out problems
(the mean of the reward extra ``Task.accuracy_extra`` instead, for a partial-credit task)."""

from __future__ import annotations

from typing import Callable

from sdp_cli.models.decode import greedy_decode
from sdp_cli.models.policy import Policy
from sdp_cli.tasks.base import RewardValue, Task, TaskItem
from sdp_cli.tasks.plugins import to_score

#: scores reward calls (one per completion, with a description of each) as ``(score, extras)``,
#: or gives up (None)
Scorer = Callable[[list[Callable[[], RewardValue]], list[str]], "list[tuple[float, dict[str, float]]] | None"]


def greedy_accuracy(
    policy: Policy,
    task: Task,
    n: int,
    *,
    seed: int = 0,
    batch_size: int = 64,
    max_new_tokens: int | None = None,
    progress: Callable[[int, int], None] | None = None,
    score: Scorer | None = None,
) -> float | None:
    """Greedy accuracy on up to ``n`` held-out problems, ``task.eval_items(n, seed)`` (never
    training problems); None when the task has no held-out problems. See ``accuracy_on``."""
    assert n >= 1, f"n must be >= 1, got {n}"
    return accuracy_on(
        policy, task, task.eval_items(n, seed), batch_size=batch_size, max_new_tokens=max_new_tokens,
        progress=progress, score=score,
    )  # fmt: skip


def accuracy_on(
    policy: Policy,
    task: Task,
    items: list[TaskItem],
    *,
    batch_size: int = 64,
    max_new_tokens: int | None = None,
    progress: Callable[[int, int], None] | None = None,
    score: Scorer | None = None,
) -> float | None:
    """Mean ``task.reward`` (its score, or its ``task.accuracy_extra``) of greedy completions of
    ``items``, decoding for at most ``max_new_tokens`` (default: the task's) and stopping at
    ``policy.eos_token_id``; None for no items. ``progress(done, total)`` follows every batch.
    ``score`` runs the reward calls instead of this thread (a training run's reward pool, which
    gives up when the run is stopped: None then)."""
    if not items:
        return None
    decoded = greedy_decode(
        policy.model,
        [policy.encode_prompt(item.prompt) for item in items],
        max_new_tokens=max_new_tokens or task.max_new_tokens,
        eos_id=policy.eos_token_id,
        pad_id=policy.pad_token_id,
        batch_size=batch_size,
        # no sequence past the model's context (issue 24), whatever the budget
        max_length=getattr(getattr(policy.model, "config", None), "max_position_embeddings", None),
        progress=progress,
    )
    completions = [(policy.decode(result.token_ids), item, result.stopped) for item, result in zip(items, decoded)]
    if score is None:
        rewards = [to_score(task.reward(text, item, stopped=stopped), task.name, item.prompt)
                   for text, item, stopped in completions]  # fmt: skip
    else:
        scored = score([task.reward_call(text, item, stopped=stopped) for text, item, stopped in completions],
                       [f"the held-out prompt {item.prompt[:60]!r}" for _, item, _ in completions])  # fmt: skip
        if scored is None:
            return None
        rewards = scored
    key = task.accuracy_extra
    # a call that failed and scored 0 (task.reward_errors=zero) reports no extras: 0 then too
    return sum(value if key is None else extras.get(key, 0.0) for value, extras in rewards) / len(rewards)
