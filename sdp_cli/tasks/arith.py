"""Integer addition tasks: ``a+b=`` → the decimal sum, exact match, must stop on EOS."""

from __future__ import annotations

import random
from typing import Any

from sdp_cli.tasks.base import Task, TaskItem


class AdditionTask(Task):
    """Addition of two integers drawn uniformly from ``[low, high]``.

    The reward is 1.0 only when the completion is exactly the digits of the sum *and* the policy
    stopped (emitted EOS) right after them; a correct answer that runs on is wrong.
    """

    charset = "arith"

    def __init__(self, name: str, low: int, high: int, max_new_tokens: int):
        assert 0 <= low <= high, f"bad operand range [{low}, {high}]"
        assert max_new_tokens >= 1, f"max_new_tokens must be >= 1, got {max_new_tokens}"
        self.name = name
        self.low = low
        self.high = high
        self.max_new_tokens = max_new_tokens

    def sample(self, rng: random.Random, n: int) -> list[TaskItem]:
        items = []
        for _ in range(n):
            a = rng.randint(self.low, self.high)
            b = rng.randint(self.low, self.high)
            items.append(TaskItem(prompt=f"{a}+{b}=", answer=str(a + b), meta={"a": a, "b": b}))
        return items

    def reward(self, completion: str, item: TaskItem, *, stopped: bool) -> float:
        return 1.0 if stopped and completion == item.answer else 0.0

    def params(self) -> dict[str, Any]:
        return {"low": self.low, "high": self.high, "prompt_format": "{a}+{b}="}
