"""Running sums (task=runsum): answers, the partial-credit reward, the length knob, the held-out
split and exact-match greedy accuracy (docs/tasks.md "Running sums")."""

import hashlib
import random
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import sdp_cli.models.evaluate as evaluate
from sdp_cli.config.compose import compose_config
from sdp_cli.errors import UserError
from sdp_cli.tasks import build_task
from sdp_cli.tasks.runsum import MAX_DIGITS, MIN_DIGITS, _item, is_held_out, longest_answer
from sdp_cli.train.session.task_setup import build_task_from

# 6+6+0+4+8+7: running sums 6, 6+6=12, 12+0=12, 12+4=16, 16+8=24, 24+7=31
ITEM = _item((6, 6, 0, 4, 8, 7))


def test_prompt_and_answer_of_the_issue_example():
    assert ITEM.prompt == "6+6+0+4+8+7="
    assert ITEM.answer == "6,12,12,16,24,31"


@pytest.mark.parametrize(
    ("completion", "stopped", "score", "exact"),
    [
        # 7 checks for 6 digits: the six sums in order, then the stop; score = checks passed / 7
        ("6,12,12,16,24,31", True, 7 / 7, 1.0),  # exact, then EOS
        ("6,12,12,16,24,31", False, 6 / 7, 0.0),  # every sum but ran out of budget: no stop
        ("6,12,12,16,24,31,5", True, 6 / 7, 0.0),  # runs on past the answer
        ("6,12,12,16,24,3", True, 5 / 7, 0.0),  # last sum truncated: 5 sums right
        ("6,12,12,16,24,310", True, 5 / 7, 0.0),  # last sum with a digit too many
        ("6,12,13,16,24,31", True, 2 / 7, 0.0),  # third sum wrong: the later right ones do not count
        ("6,12,1", False, 2 / 7, 0.0),  # cut off by the budget mid-number
        ("7,13,13,17,25,32", True, 0.0, 0.0),  # first sum wrong
        (" 6,12,12,16,24,31", True, 0.0, 0.0),  # no whitespace tolerance
        ("", True, 0.0, 0.0),  # immediate EOS
    ],
)
def test_reward_by_hand(completion, stopped, score, exact):
    reward = build_task("runsum").reward(completion, ITEM, stopped=stopped)
    assert reward == {"score": pytest.approx(score), "exact": exact}


@pytest.mark.parametrize(
    ("digits", "longest"),
    [
        (2, 4),  # "9,18": 1 + 2 digits, 1 comma
        (6, 16),  # "9,18,27,36,45,54": 1 + 5·2 digits, 5 commas
        (12, 35),  # 9, 18..99 (10 sums of 2 digits), 108: 1 + 20 + 3 digits, 11 commas
    ],
)
def test_longest_answer_by_hand(digits, longest):
    assert longest_answer(digits) == longest
    assert _item((9,) * digits).answer.__len__() == longest
    # the default budget holds the longest answer and EOS
    assert build_task("runsum", digits=digits).max_new_tokens >= longest + 1


@pytest.mark.parametrize("digits", range(MIN_DIGITS, MAX_DIGITS + 1))
def test_answer_length_follows_the_knob(digits):
    task = build_task("runsum", digits=digits)
    for item in task.sample(random.Random(digits), 200):
        # k sums need k - 1 commas and at least one digit each
        assert item.answer.count(",") == digits - 1
        assert 2 * digits - 1 <= len(item.answer) <= longest_answer(digits)


def test_default_answers_are_12_to_32_tokens_with_eos():
    # 6 digits: the shortest answer is "0,0,0,0,0,0" (11 characters), the longest 16; + EOS
    task = build_task("runsum")
    lengths = {len(item.answer) + 1 for item in task.sample(random.Random(0), 2000)}
    assert min(lengths) >= 12 and max(lengths) <= 32


@settings(max_examples=40, deadline=None)
@given(st.integers(MIN_DIGITS, MAX_DIGITS), st.integers(0, 2**32), st.integers(0, 2**32))
def test_split_is_disjoint(digits, train_seed, eval_seed):
    task = build_task("runsum", digits=digits)
    trained = task.sample(random.Random(train_seed), 100)
    held = task.eval_items(50, eval_seed)
    assert not any(is_held_out(tuple(item.meta["digits"])) for item in trained)
    assert all(is_held_out(tuple(item.meta["digits"])) for item in held)
    assert not {item.prompt for item in trained} & {item.prompt for item in held}


@pytest.mark.parametrize("n", [0, 1, 7])
def test_sample_draws_exactly_n(n):
    assert len(build_task("runsum").sample(random.Random(n), n)) == n


def test_the_split_holds_out_a_first_byte_below_51_and_not_51_itself():
    sequences = [tuple(int(c) for c in f"{k:04d}") for k in range(10_000)]
    first = {d: hashlib.sha256("".join(map(str, d)).encode()).digest()[0] for d in sequences}
    assert is_held_out(next(d for d in sequences if first[d] == 50))
    assert not is_held_out(next(d for d in sequences if first[d] == 51))


@pytest.mark.parametrize("digits", [2, 6])
def test_eval_items_are_distinct_and_fixed_by_the_seed(digits):
    task = build_task("runsum", digits=digits)
    items = task.eval_items(300, 5)
    assert len({item.prompt for item in items}) == len(items)
    assert items == task.eval_items(300, 5) and items != task.eval_items(300, 6)
    if digits == 2:
        # 100 sequences; the held-out ones (about a fifth) are all there is to return
        assert len(items) == sum(is_held_out((a, b)) for a in range(10) for b in range(10)) < 300


class _FixedAnswerPolicy:
    """Just enough of a Policy for greedy_accuracy: the prompts stay text and every completion
    is ``answer(prompt)``."""

    model = None
    eos_token_id = pad_token_id = 0

    def __init__(self, answer):
        self.answer = answer

    def encode_prompt(self, text):
        return text

    def decode(self, completion):
        return completion


def _accuracy_and_prompts(task, policy, monkeypatch):
    seen = []

    def decode(model, prompts, **kwargs):
        seen.extend(prompts)
        return [SimpleNamespace(token_ids=policy.answer(p), stopped=True) for p in prompts]

    monkeypatch.setattr(evaluate, "greedy_decode", decode)
    return evaluate.greedy_accuracy(policy, task, 200, seed=7), seen


def test_held_out_items_are_never_sampled_and_only_they_are_evaluated(monkeypatch):
    task = build_task("runsum")
    by_prompt = {item.prompt: item for item in task.eval_items(200, 7)}
    _, evaluated = _accuracy_and_prompts(task, _FixedAnswerPolicy(lambda p: by_prompt[p].answer), monkeypatch)
    trained = {item.prompt for item in task.sample(random.Random(1), 20_000)}
    assert len(evaluated) == 200 and set(evaluated) == set(by_prompt)
    assert not set(evaluated) & trained


def test_greedy_accuracy_is_exact_match_not_partial_credit(monkeypatch):
    task = build_task("runsum")
    answers = {item.prompt: item.answer for item in task.eval_items(200, 7)}
    # every answer with its last sum dropped: partial credit 5/7 each, exact 0
    partial = _FixedAnswerPolicy(lambda p: answers[p].rsplit(",", 1)[0])
    accuracy, _ = _accuracy_and_prompts(task, partial, monkeypatch)
    assert accuracy == 0.0
    # the right answer for every other prompt (sorted order): exactly half are exact
    half = set(sorted(answers)[::2])
    mixed = _FixedAnswerPolicy(lambda p: answers[p] if p in half else "")
    accuracy, _ = _accuracy_and_prompts(task, mixed, monkeypatch)
    assert accuracy == 0.5


@pytest.mark.parametrize("bad", [1, 13, "6", True, 6.0])
def test_bad_digits_are_a_user_error(bad):
    with pytest.raises(UserError, match=r"digits must be an integer in \[2, 12\]"):
        build_task("runsum", digits=bad)


def test_digits_reach_the_task_from_the_config():
    cfg, _ = compose_config(["task=runsum", "task.digits=9"])
    task = build_task_from(cfg)
    assert task.digits == 9 and task.params()["digits"] == 9
    assert build_task_from(compose_config(["task=runsum"])[0]).digits == 6


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["task=arith1", "task.digits=4"], "task.digits applies to task=runsum, not task=arith1; remove it"),
        (["task=runsum", "task.digits=13"], r"task.digits=13 must be in \[2, 12\]"),
    ],
)
def test_digits_in_the_config_are_checked(overrides, message):
    with pytest.raises(UserError, match=message):
        compose_config(overrides)
