"""Running sums: ``6+6+0+4+8+7=`` → ``6,12,12,16,24,31``, a long answer with partial credit.

The prompt is ``digits`` decimal digits joined by ``+`` and closed by ``=``; the answer is the
comma-separated running sums of the digits (docs/tasks.md "Running sums"). The answer length grows
with ``digits`` (the length knob): with 6 digits it is 11-16 characters, i.e. 12-17 tokens of the
character-level tiny model with EOS.

About a fifth of the digit sequences (fixed by a hash of the sequence, the same in every run) are
held out: training never draws them and greedy evaluation uses only them.

Reward (partial credit): a completion passes ``digits + 1`` checks in order, each running sum and
then the stop right after the last one; the score is the share passed before the first failure,
so 1.0 means exactly the answer followed by EOS. The ``exact`` extra (logged as ``reward/exact``) is
1.0 for that case only, and greedy accuracy counts it rather than the partial score.
"""

from __future__ import annotations

import functools
import hashlib
import random
from itertools import accumulate, product
from typing import Any

from sdp_cli.errors import UserError
from sdp_cli.tasks.base import Task, TaskItem

#: a sequence is held out when the first byte of sha256(its digits) is below this (51/256 ≈ 20 %)
HELD_OUT_BELOW = 51
#: the range of the length knob: 2 digits still leave both sides of the split non-empty; past 12
#: a running sum can reach 3 digits and the answers outgrow what the tiny model is tuned for
MIN_DIGITS, MAX_DIGITS = 2, 12
#: up to this many digits the held-out side is listed (10^4 hashes); longer sequences are drawn
#: by rejection, at most 10^digits / 10 of them (half the held-out side) so that drawing stays fast
_LISTED_UP_TO = 4


def is_held_out(digits: tuple[int, ...]) -> bool:
    """Whether the problem with these digits belongs to the evaluation split."""
    return hashlib.sha256("".join(map(str, digits)).encode()).digest()[0] < HELD_OUT_BELOW


def running_sums(digits: tuple[int, ...]) -> list[int]:
    """``[d0, d0+d1, ...]``."""
    return list(accumulate(digits))


@functools.cache
def _listed_held_out(digits: int) -> list[tuple[int, ...]]:
    """Every held-out sequence of ``digits`` digits, in lexicographic order."""
    return [d for d in product(range(10), repeat=digits) if is_held_out(d)]


def _item(digits: tuple[int, ...]) -> TaskItem:
    sums = running_sums(digits)
    return TaskItem(
        prompt="+".join(map(str, digits)) + "=",
        answer=",".join(map(str, sums)),
        meta={"digits": list(digits), "sums": sums},
    )


def longest_answer(digits: int) -> int:
    """Characters of the longest answer: all nines, sums 9, 18, ..., 9·digits, and the commas."""
    return sum(len(str(9 * i)) for i in range(1, digits + 1)) + digits - 1


class RunningSumTask(Task):
    """Running sums of ``digits`` uniform decimal digits, held-out sequences excluded."""

    name = "runsum"
    charset = "arith"
    #: greedy accuracy averages this reward extra, not the partial-credit score
    accuracy_extra = "exact"

    def __init__(self, digits: int = 6, max_new_tokens: int | None = None):
        if isinstance(digits, bool) or not isinstance(digits, int) or not MIN_DIGITS <= digits <= MAX_DIGITS:
            raise UserError(
                f"task 'runsum': digits must be an integer in [{MIN_DIGITS}, {MAX_DIGITS}], got {digits!r}"
            )
        self.digits = digits
        # the longest answer + EOS, plus one token of slack
        self.max_new_tokens = max_new_tokens or longest_answer(digits) + 2
        self._held_out = _listed_held_out(digits) if digits <= _LISTED_UP_TO else None
        assert self._held_out is None or 0 < len(self._held_out) < 10**digits, "the split leaves a side empty"

    def _draw(self, rng: random.Random) -> tuple[int, ...]:
        return tuple(rng.randrange(10) for _ in range(self.digits))

    def sample(self, rng: random.Random, n: int) -> list[TaskItem]:
        items = []
        while len(items) < n:
            digits = self._draw(rng)
            if not is_held_out(digits):
                items.append(_item(digits))
        return items

    def eval_items(self, n: int, seed: int) -> list[TaskItem]:
        rng = random.Random(seed)
        if self._held_out is not None:
            return [_item(d) for d in rng.sample(self._held_out, min(n, len(self._held_out)))]
        chosen: dict[tuple[int, ...], None] = {}  # insertion-ordered set
        while len(chosen) < min(n, 10**self.digits // 10):
            digits = self._draw(rng)
            if is_held_out(digits):
                chosen[digits] = None
        return [_item(d) for d in chosen]

    def reward(self, completion: str, item: TaskItem, *, stopped: bool) -> dict[str, float]:
        """``{"score": passed / (digits + 1), "exact": 0 or 1}`` (module docstring)."""
        exact = stopped and completion == item.answer
        parts = completion.split(",")
        passed = 0
        for got, want in zip(parts, item.meta["sums"]):
            if got != str(want):
                break
            passed += 1
        # a run-on answer ("...,31,5") gets every sum but not the stop
        passed = self.digits + 1 if exact else min(passed, self.digits)
        return {"score": passed / (self.digits + 1), "exact": float(exact)}

    def params(self) -> dict[str, Any]:
        return {
            "digits": self.digits,
            "prompt_format": "d1+d2+...+dk=",
            "reward": "share of running sums right up to the first error, the stop counted last",
            "held_out": f"sha256(digits)[0] < {HELD_OUT_BELOW}",
        }

    def summary(self) -> str:
        return (
            f"task {self.name}: running sums of {self.digits} digits (answers up to "
            f"{longest_answer(self.digits)} characters); about 20% of the sequences held out for evaluation"
        )
