"""Greedy evaluation never scores a prompt that training can draw (issue 14: evaluation sampled
the training data). The prompts evaluation decodes are captured at ``greedy_decode``."""

import json
import random
from types import SimpleNamespace

import pytest

import sdp_cli.models.evaluate as evaluate
from sdp_cli.tasks import build_task


class _TextPolicy:
    """Just enough of a Policy for greedy_accuracy: prompts stay text, completions are empty."""

    model = None
    eos_token_id = pad_token_id = 0

    def encode_prompt(self, text):
        return text

    def decode(self, ids):
        return ""


def _evaluated_prompts(task, n, seed, monkeypatch) -> set[str]:
    seen: list[str] = []

    def decode(model, prompts, **kwargs):
        seen.extend(prompts)
        return [SimpleNamespace(token_ids=[], stopped=True) for _ in prompts]

    monkeypatch.setattr(evaluate, "greedy_decode", decode)
    evaluate.greedy_accuracy(_TextPolicy(), task, n, seed=seed)
    return set(seen)


@pytest.mark.parametrize("name", ["arith1", "arith2"])
def test_arith_evaluation_prompts_are_never_drawn_for_training(name, monkeypatch):
    task = build_task(name)
    # 20,000 training draws cover every pair training can draw (arith1: 100 pairs at most;
    # arith2: 8,100, each missed with probability (1 - 1/8100)^20000 < 0.09 — the check below
    # is one-sided, so a missed pair can only hide an overlap, never invent one)
    trained = {item.prompt for item in task.sample(random.Random(1), 20_000)}
    evaluated = _evaluated_prompts(task, 200, 7, monkeypatch)
    assert evaluated, "evaluation scored nothing"
    assert not evaluated & trained, f"evaluation scored training prompts: {sorted(evaluated & trained)[:5]}"


def test_gsm8k_evaluation_uses_only_the_held_out_records(monkeypatch):
    task = build_task("gsm8k", eval_fraction=0.2)
    trained = {item.prompt for item in task.items}
    evaluated = _evaluated_prompts(task, 200, 7, monkeypatch)
    # 21 records, round(21 * 0.2) = 4 held out
    assert len(trained) == 17 and len(evaluated) == 4
    assert not evaluated & trained


def test_a_data_set_without_a_split_is_not_evaluated_on_training_prompts(monkeypatch):
    task = build_task("gsm8k")
    assert _evaluated_prompts(task, 200, 7, monkeypatch) == set()
    assert evaluate.greedy_accuracy(_TextPolicy(), task, 10) is None


def test_a_held_out_file_repeating_training_prompts_is_cut_to_the_new_ones(tmp_path, monkeypatch):
    records = [{"question": f"q{i}", "answer": f"#### {i}"} for i in range(6)]
    train, held = tmp_path / "train.jsonl", tmp_path / "eval.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in records[:4]))
    held.write_text("".join(json.dumps(r) + "\n" for r in records[2:]))  # q2, q3 are training prompts
    task = build_task("gsm8k", path=str(train), eval_path=str(held))
    evaluated = _evaluated_prompts(task, 200, 0, monkeypatch)
    assert evaluated == {"Question: q4\nAnswer: ", "Question: q5\nAnswer: "}
    assert task.eval_overlap == 2 and "2 held-out prompts left out" in task.summary()


@pytest.mark.parametrize(
    ("name", "options", "expected"),
    [
        ("arith1", {}, 79),  # 100 pairs, 21 held out: the 79 training pairs, all of them
        ("arith2", {}, 256),  # 8,100 pairs: n = 256 of the training ones
        ("runsum", {"digits": 2}, 100 - 15),  # 100 sequences of 2 digits, 15 held out (counted by the hash)
        ("gsm8k", {"eval_fraction": 0.2}, 17),  # 21 records, 4 held out
    ],
)
def test_validation_items_are_distinct_training_problems(name, options, expected):
    """The warm start selects on these (issue 24 item 2), so they never include a held-out one."""
    task = build_task(name, **options)
    held = {item.prompt for item in task.eval_items(10**6, 0)}
    items = task.validation_items(256, 3)
    prompts = [item.prompt for item in items]
    assert len(prompts) == len(set(prompts)) == expected
    assert not set(prompts) & held
    assert items == task.validation_items(256, 3)
