"""Addition tasks: sampling ranges, determinism, exact-match-with-EOS reward."""

import hashlib
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sdp_cli.tasks import build_task
from sdp_cli.tasks.arith import is_held_out
from sdp_cli.tasks.base import TaskItem


def test_arith1_prompt_and_answer_format():
    task = build_task("arith1")
    for item in task.sample(random.Random(0), 200):
        a, b = item.meta["a"], item.meta["b"]
        assert 0 <= a <= 9 and 0 <= b <= 9
        assert item.prompt == f"{a}+{b}="
        assert item.answer == str(a + b)


def test_arith2_operands_are_two_digit_and_cover_the_range():
    task = build_task("arith2")
    items = task.sample(random.Random(1), 2000)
    operands = [item.meta["a"] for item in items] + [item.meta["b"] for item in items]
    assert min(operands) >= 10 and max(operands) <= 99
    # 4000 uniform draws over 90 values: each value is expected ~44 times, so both ends show up.
    assert min(operands) == 10 and max(operands) == 99


def test_sampling_is_deterministic_in_the_rng():
    task = build_task("arith2")
    assert task.sample(random.Random(7), 50) == task.sample(random.Random(7), 50)
    assert task.sample(random.Random(7), 50) != task.sample(random.Random(8), 50)


@given(st.integers(min_value=0, max_value=2**32), st.sampled_from(["arith1", "arith2"]))
def test_draws_are_those_of_the_hash_rule(seed, name):
    # the split is sha256's (is_held_out); the task looks it up in a set, and must draw exactly
    # the problems, in the order, that rejecting by the hash itself draws: runs stay reproducible
    task = build_task(name)
    rng, expected = random.Random(seed), []
    while len(expected) < 40:
        a, b = rng.randint(task.low, task.high), rng.randint(task.low, task.high)
        if not is_held_out(a, b):
            expected.append(f"{a}+{b}=")
    assert [item.prompt for item in task.sample(random.Random(seed), 40)] == expected


def _first_byte(text):
    return hashlib.sha256(text.encode()).digest()[0]


def test_the_split_holds_out_a_first_byte_below_51_and_not_51_itself():
    # the rule is part of the task's definition (the same split in every run and version of sdp):
    # a pair whose hash starts with byte 50 is held out, one starting with 51 is trained on
    pairs = [(a, b) for a in range(100) for b in range(100)]
    at_50 = next(p for p in pairs if _first_byte(f"{p[0]}+{p[1]}") == 50)
    at_51 = next(p for p in pairs if _first_byte(f"{p[0]}+{p[1]}") == 51)
    assert is_held_out(*at_50) and not is_held_out(*at_51)


@pytest.mark.parametrize(("name", "low", "high"), [("arith1", 0, 9), ("arith2", 10, 99)])
def test_the_summary_counts_both_sides_of_the_split(name, low, high):
    task = build_task(name)
    held = sum(is_held_out(a, b) for a in range(low, high + 1) for b in range(low, high + 1))
    total = (high - low + 1) ** 2
    assert task.summary() == f"task {name}: {total - held} training problems, {held} held out for evaluation"
    if name == "arith1":
        assert (total - held, held) == (79, 21)  # as the module's docstring and the docs say


@pytest.mark.parametrize(
    ("completion", "stopped", "expected"),
    [
        ("12", True, 1.0),  # exact digits, then EOS
        ("12", False, 0.0),  # right digits but never stopped: ran out of budget
        ("123", True, 0.0),  # runs on past the answer
        ("1", True, 0.0),  # truncated answer
        (" 12", True, 0.0),  # exact match: no whitespace tolerance
        ("12 ", True, 0.0),
        ("", True, 0.0),  # immediate EOS
        ("21", True, 0.0),
    ],
)
def test_arith_reward_cases(completion, stopped, expected):
    task = build_task("arith1")
    item = TaskItem(prompt="5+7=", answer="12", meta={"a": 5, "b": 7})
    assert task.reward(completion, item, stopped=stopped) == expected


@given(st.integers(10, 99), st.integers(10, 99))
def test_arith2_reward_accepts_exactly_the_sum(a, b):
    task = build_task("arith2")
    item = TaskItem(prompt=f"{a}+{b}=", answer=str(a + b))
    assert task.reward(str(a + b), item, stopped=True) == 1.0
    assert task.reward(str(a + b + 1), item, stopped=True) == 0.0


def test_default_budget_fits_the_longest_answer_plus_eos():
    # arith1: the longest answer is "18" (2 chars) + EOS = 3 tokens; arith2: "198" + EOS = 4.
    assert build_task("arith1").max_new_tokens >= 3
    assert build_task("arith2").max_new_tokens >= 4


def test_params_differ_between_tasks():
    assert build_task("arith1").params() != build_task("arith2").params()
