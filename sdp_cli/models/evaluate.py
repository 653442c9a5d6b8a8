"""Greedy accuracy of a policy on a task: the mean reward of argmax completions on held-out problems."""

from __future__ import annotations

from typing import Callable

from sdp_cli.models.decode import greedy_decode
from sdp_cli.models.policy import Policy
from sdp_cli.tasks.base import RewardValue, Task
from sdp_cli.tasks.plugins import to_score

#: scores reward calls (one per completion, with a description of each), or gives up (None)
Scorer = Callable[[list[Callable[[], RewardValue]], list[str]], "list[float] | None"]


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
    """Mean ``task.reward`` (its score) over up to ``n`` held-out problems,
    ``task.eval_items(n, seed)`` (never training problems), decoding greedily for at most
    ``max_new_tokens`` (default: the task's) and stopping at ``policy.eos_token_id``; None when
    the task has no held-out problems. ``progress(done, total)`` follows every batch decoded.
    ``score`` runs the reward calls instead of this thread (a training run's reward pool, which
    gives up when the run is stopped: None then)."""
    assert n >= 1, f"n must be >= 1, got {n}"
    items = task.eval_items(n, seed)
    if not items:
        return None
    decoded = greedy_decode(
        policy.model,
        [policy.encode_prompt(item.prompt) for item in items],
        max_new_tokens=max_new_tokens or task.max_new_tokens,
        eos_id=policy.eos_token_id,
        pad_id=policy.pad_token_id,
        batch_size=batch_size,
        progress=progress,
    )
    completions = [(policy.decode(result.token_ids), item, result.stopped) for item, result in zip(items, decoded)]
    if score is None:
        rewards = [to_score(task.reward(text, item, stopped=stopped), task.name, item.prompt)[0]
                   for text, item, stopped in completions]  # fmt: skip
    else:
        scored = score([task.reward_call(text, item, stopped=stopped) for text, item, stopped in completions],
                       [f"the held-out prompt {item.prompt[:60]!r}" for _, item, _ in completions])  # fmt: skip
        if scored is None:
            return None
        rewards = scored
    return sum(rewards) / len(rewards)
