"""Integer addition tasks: ``a+b=`` → the decimal sum, exact match, must stop on EOS.

About a fifth of the operand pairs (fixed by a hash of ``"a+b"``, the same in every run) are
held out: training never draws them and greedy evaluation uses only them, so evaluation
measures problems the policy never trained on (arith1: 21 of the 100 pairs).
"""

from __future__ import annotations

import hashlib
import random
from typing import Any

from sdp_cli.tasks.base import Task, TaskItem

#: a pair is held out when the first byte of sha256("a+b") is below this (51/256 ≈ 20 %)
HELD_OUT_BELOW = 51


def is_held_out(a: int, b: int) -> bool:
    """Whether the problem ``a+b=`` belongs to the evaluation split."""
    return hashlib.sha256(f"{a}+{b}".encode()).digest()[0] < HELD_OUT_BELOW


def _item(a: int, b: int) -> TaskItem:
    return TaskItem(prompt=f"{a}+{b}=", answer=str(a + b), meta={"a": a, "b": b})


class AdditionTask(Task):
    """Addition of two integers drawn uniformly from ``[low, high]``, held-out pairs excluded.

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
        operands = range(low, high + 1)
        self.held_out = [(a, b) for a in operands for b in operands if is_held_out(a, b)]
        self._held_out_set = frozenset(self.held_out)  # a draw looks it up instead of hashing
        assert 0 < len(self.held_out) < len(operands) ** 2, f"{name}: the split leaves a side empty"

    def sample(self, rng: random.Random, n: int) -> list[TaskItem]:
        items = []
        while len(items) < n:
            a = rng.randint(self.low, self.high)
            b = rng.randint(self.low, self.high)
            if (a, b) not in self._held_out_set:
                items.append(_item(a, b))
        return items

    def eval_items(self, n: int, seed: int) -> list[TaskItem]:
        pairs = random.Random(seed).sample(self.held_out, min(n, len(self.held_out)))
        return [_item(a, b) for a, b in pairs]

    def reward(self, completion: str, item: TaskItem, *, stopped: bool) -> float:
        return 1.0 if stopped and completion == item.answer else 0.0

    def params(self) -> dict[str, Any]:
        return {
            "low": self.low,
            "high": self.high,
            "prompt_format": "{a}+{b}=",
            "held_out": f"sha256(a+b)[0] < {HELD_OUT_BELOW}",
        }

    def summary(self) -> str:
        total = (self.high - self.low + 1) ** 2
        return (
            f"task {self.name}: {total - len(self.held_out)} training problems, "
            f"{len(self.held_out)} held out for evaluation"
        )
