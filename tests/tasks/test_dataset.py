"""The data-set task: field mapping, templates, chat templates, the held-out split, epochs and
the prompt-length limit, checked with small hand-made files."""

import json
import random
from collections import Counter

import pytest

from sdp_cli.errors import UserError
from sdp_cli.models.tokenizer import build_tokenizer
from sdp_cli.tasks import build_task
from sdp_cli.tasks.base import Context
from sdp_cli.tasks.dataset import SPLIT_SEED
from sdp_cli.tasks.templates import as_messages


def _data(tmp_path, records, name="d.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def _task(tmp_path, records, **options):
    options.setdefault("reward", "final_number")
    return build_task("dataset", path=_data(tmp_path, records), **options)


def _one_line(err) -> str:
    message = str(err.value)
    assert "\n" not in message
    return message


NUMBERS = [{"prompt": f"{i}+1=", "answer": str(i + 1), "level": i % 3} for i in range(10)]


def test_prompt_and_answer_keys(tmp_path):
    task = _task(tmp_path, [{"q": "2+2=", "sol": {"final": "4"}}], prompt_key="q", answer_key="sol.final")
    (item,) = task.items
    assert (item.prompt, item.answer) == ("2+2=", "4")
    assert task.reward("4", item, stopped=True) == 1.0


def test_the_template_fills_any_field_and_leaves_other_braces(tmp_path):
    records = [{"question": "What is {x}?", "meta": {"topic": "sets"}, "answer": "3"}]
    template = "[{meta.topic}] {question} {json: true} {{question}}\n"
    (item,) = _task(tmp_path, records, prompt_template=template).items
    # {meta.topic} and {question} are fields; "{json: true}" is text; "{{question}}" is a literal
    assert item.prompt == "[sets] What is {x}? {json: true} {question}\n"


def test_a_missing_template_field_names_the_record_and_the_fields(tmp_path):
    with pytest.raises(UserError) as err:
        _task(tmp_path, [{"question": "q", "answer": "1"}, {"answer": "2"}], prompt_template="Q: {question}")
    message = _one_line(err)
    assert "d.jsonl:2:" in message and "{question}" in message and "its fields: answer" in message


@pytest.mark.parametrize(
    ("records", "options", "fragment"),
    [
        ([{"answer": "1"}], {}, "d.jsonl:1: no field 'prompt' (task.prompt_key; the record has answer)"),
        ([{"prompt": 3, "answer": "1"}], {}, "field 'prompt' must be a string or a list of chat messages"),
        ([{"prompt": [{"role": "user", "content": "hi"}], "answer": "1"}], {}, "set task.chat_template=true"),
        ([{"prompt": "  ", "answer": "1"}], {}, "d.jsonl:1: the prompt is empty"),
        ([{"prompt": "p"}], {}, "d.jsonl:1: the record has no field 'answer' (task.answer_key)"),
        ([{"prompt": "p", "answer": "x"}], {}, "holds no number, which task.reward=final_number needs"),
        ([{"prompt": "p", "answer": "1"}], {"system_prompt": "s"}, "set task.chat_template=true too"),
    ],
)
def test_bad_records_and_options_are_one_line(tmp_path, records, options, fragment):
    with pytest.raises(UserError) as err:
        _task(tmp_path, records, **options)
    assert fragment in _one_line(err)


def test_eval_fraction_holds_out_the_same_records_for_every_run_seed(tmp_path):
    a = _task(tmp_path, NUMBERS, eval_fraction=0.3, seed=0)
    b = _task(tmp_path, NUMBERS, eval_fraction=0.3, seed=5)
    held = {i.prompt for i in a.eval_items(100, 0)}
    # round(10 * 0.3) = 3 records, chosen by random.Random(SPLIT_SEED), not by the run seed
    expected = {NUMBERS[i]["prompt"] for i in random.Random(SPLIT_SEED).sample(range(10), 3)}
    assert held == expected == {i.prompt for i in b.eval_items(100, 0)}
    assert len(a) == 7 and not held & {i.prompt for i in a.items}


@pytest.mark.parametrize("fraction", [0.01, 0.99])
def test_a_fraction_leaving_a_side_empty_is_refused(tmp_path, fraction):
    with pytest.raises(UserError) as err:
        _task(tmp_path, NUMBERS, eval_fraction=fraction)
    assert "leaves at least one record on each side" in _one_line(err)


def test_eval_path_and_eval_fraction_exclude_each_other(tmp_path):
    with pytest.raises(UserError, match="not both"):
        _task(tmp_path, NUMBERS, eval_fraction=0.2, eval_path=_data(tmp_path, NUMBERS[:2], "e.jsonl"))


def test_epochs_visit_every_prompt_once_in_a_seeded_order(tmp_path):
    task = _task(tmp_path, NUMBERS, seed=3)
    stream = task.stream(random.Random(0), 0, 30)
    epochs = [stream[0:10], stream[10:20], stream[20:30]]
    for epoch in epochs:
        assert Counter(i.prompt for i in epoch) == Counter(r["prompt"] for r in NUMBERS)
    assert [i.prompt for i in epochs[0]] != [i.prompt for i in epochs[1]]  # reshuffled per epoch
    # the same positions give the same prompts, whatever the chunking and the producer rng
    assert task.stream(random.Random(9), 13, 4) == stream[13:17]
    # a fresh task (a resumed run) whose first request starts inside epoch 1
    assert _task(tmp_path, NUMBERS, seed=3).stream(random.Random(0), 13, 4) == stream[13:17]
    assert [i.prompt for i in _task(tmp_path, NUMBERS, seed=4).stream(random.Random(0), 0, 10)] != [
        i.prompt for i in epochs[0]
    ]


@pytest.mark.parametrize(
    ("options", "needs"),
    [({}, False), ({"chat_template": True}, True), ({"max_prompt_tokens": 6}, True)],
)
def test_a_task_needs_the_tokenizer_for_a_chat_template_or_a_length_limit(tmp_path, options, needs):
    assert _task(tmp_path, NUMBERS, **options).needs_tokenizer is needs


def test_the_summary_names_where_the_held_out_prompts_come_from(tmp_path):
    by_path = _task(tmp_path, NUMBERS, eval_path=_data(tmp_path, [{"prompt": "a", "answer": "1"}], "e.jsonl"))
    assert f"1 held out for evaluation ({tmp_path / 'e.jsonl'})" in by_path.summary()
    by_fraction = _task(tmp_path, NUMBERS, eval_fraction=0.2)
    assert "2 held out for evaluation (task.eval_fraction=0.2)" in by_fraction.summary()


def test_shuffle_false_walks_the_file_in_order(tmp_path):
    task = _task(tmp_path, NUMBERS, shuffle=False)
    assert [i.prompt for i in task.stream(random.Random(0), 8, 4)] == ["8+1=", "9+1=", "0+1=", "1+1="]


def test_max_prompt_tokens_drops_long_prompts_and_counts_them(tmp_path):
    records = [{"prompt": "x" * n, "answer": "1"} for n in (3, 5, 9, 12)]
    task = _task(tmp_path, records, max_prompt_tokens=6, eval_fraction=0.25)
    assert not task.items  # prompts depend on the tokenizer: nothing to sample before prepare
    task.prepare(build_tokenizer("ascii"))
    # tokens = characters + the BOS the character tokenizer adds: 4, 6, 10, 13 -> only <= 6 stay
    kept = sorted(len(i.prompt) for i in [*task.items, *task.eval_items(10, 0)])
    assert kept == [3, 5]
    assert task.dropped["train"] + task.dropped["eval"] == 2
    assert "dropped (longer than task.max_prompt_tokens=6)" in task.summary()


def test_all_prompts_too_long_is_one_line(tmp_path):
    task = _task(tmp_path, [{"prompt": "xxxxxxx", "answer": "1"}, {"prompt": "xxxx", "answer": "1"}], max_prompt_tokens=2)
    with pytest.raises(UserError) as err:
        task.prepare(build_tokenizer("ascii"))
    assert "the shortest has 5 tokens" in _one_line(err)  # "xxxx" and the BOS


class ChatTokenizer:
    """A tokenizer with a ChatML-like template that writes a BOS the encoder adds as well."""

    bos_token, bos_token_id = "<s>", 1
    chat_template = "set"

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        body = "".join(f"<|{m['role']}|>{m['content']}\n" for m in messages)
        return "<s>" + body + ("<|assistant|>" if add_generation_prompt else "")

    def encode(self, text, add_special_tokens=True):
        return ([1] if add_special_tokens else []) + [ord(c) for c in text]


def test_chat_template_with_system_prompt_and_message_records(tmp_path):
    records = [
        {"prompt": "2+2?", "answer": "4"},
        {"prompt": [{"role": "system", "content": "own"}, {"role": "user", "content": "3+3?"}], "answer": "6"},
    ]
    task = _task(tmp_path, records, chat_template=True, system_prompt="Be brief.", shuffle=False)
    task.prepare(ChatTokenizer())
    first, second = task.items
    # the template's "<s>" is dropped because encoding adds the BOS id itself: exactly one BOS
    assert first.prompt == "<|system|>Be brief.\n<|user|>2+2?\n<|assistant|>"
    assert second.prompt == "<|system|>own\n<|user|>3+3?\n<|assistant|>"  # a record's own system message wins


class NoBosEncoder(ChatTokenizer):
    """Its template writes "<s>" but encoding adds no BOS: the template's is the prompt's only one."""

    def encode(self, text, add_special_tokens=True):
        return [ord(c) for c in text]


class NoBosTemplate(ChatTokenizer):
    """Its template writes no BOS (encoding adds one)."""

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        return super().apply_chat_template(messages, tokenize, add_generation_prompt).removeprefix("<s>")


class NoBosToken(ChatTokenizer):
    bos_token, bos_token_id = None, None


@pytest.mark.parametrize(
    ("tokenizer", "prompt"),
    [
        (NoBosEncoder(), "<s><|user|>2+2?\n<|assistant|>"),  # kept: encoding would not add it
        (NoBosTemplate(), "<|user|>2+2?\n<|assistant|>"),
        (NoBosToken(), "<s><|user|>2+2?\n<|assistant|>"),  # no BOS token: the text is the template's
    ],
)
def test_the_templates_bos_is_dropped_only_where_encoding_adds_it(tmp_path, tokenizer, prompt):
    task = _task(tmp_path, [{"prompt": "2+2?", "answer": "4"}], chat_template=True, shuffle=False)
    task.prepare(tokenizer)
    assert task.items[0].prompt == prompt


@pytest.mark.parametrize(
    "value",
    [
        {"role": "user", "content": "hi"},  # one message, not a list of them
        [],
        [{"role": "user"}],
        [{"role": "user", "content": 3}],
        [{"role": "user", "content": "hi"}, "and more"],
    ],
)
def test_a_prompt_field_that_is_neither_text_nor_chat_messages_is_one_line(value):
    with pytest.raises(UserError, match=r"^data.jsonl line 2: field 'prompt' must be a string or a list of chat messages"):
        as_messages(value, "data.jsonl line 2", "prompt")


def test_chat_messages_keep_only_their_role_and_content():
    messages = [{"role": "user", "content": "hi", "name": "x"}]
    assert as_messages(messages, "here", "prompt") == [{"role": "user", "content": "hi"}]
    assert as_messages("plain text", "here", "prompt") is None


def test_chat_template_needs_a_tokenizer_with_one(tmp_path):
    task = _task(tmp_path, NUMBERS, chat_template=True)

    class Plain(ChatTokenizer):
        chat_template = None

    with pytest.raises(UserError, match="the model's tokenizer has no chat template"):
        task.prepare(Plain())


def test_truncated_completions_score_zero_without_calling_the_reward(tmp_path):
    reward = tmp_path / "r.py"
    reward.write_text("calls = []\ndef score(p, c, r):\n    calls.append(c)\n    return 1.0\n")
    task = _task(tmp_path, NUMBERS, reward=f"{reward}:score")
    item = task.items[0]
    assert task.reward("x", item, stopped=False) == 0.0
    assert task.reward("x", item, stopped=True) == 1.0
    import sys

    (module,) = [m for name, m in sys.modules.items() if name.startswith("sdp_reward_r_")]
    assert module.calls == ["x"]
    relaxed = _task(tmp_path, NUMBERS, reward=f"{reward}:score", require_stop=False)
    assert relaxed.reward("y", relaxed.items[0], stopped=False) == 1.0


def test_the_reward_gets_the_rendered_prompt_and_the_whole_record(tmp_path):
    reward = tmp_path / "seen.py"
    reward.write_text("def score(p, c, r):\n    return {'score': 0.0, 'level': r['level'], 'plen': len(p)}\n")
    task = _task(tmp_path, NUMBERS, reward=f"{reward}:score", prompt_template="Q {prompt}", shuffle=False)
    item = task.items[4]  # NUMBERS[4]: prompt "4+1=", level 4 % 3 = 1
    assert task.reward("5", item, stopped=True) == {"score": 0.0, "level": 1.0, "plen": len("Q 4+1=")}
    assert task.where(item) == f"record 4 ({tmp_path / 'd.jsonl'}:5)"


def test_params_change_with_the_data_and_the_reward(tmp_path):
    base = _task(tmp_path, NUMBERS).params()
    assert _task(tmp_path, NUMBERS, reward="boxed").params() != base
    assert _task(tmp_path, NUMBERS[:5]).params() != base
    assert _task(tmp_path, NUMBERS, seed=9).params() == base  # the order does not change the data


def test_require_answers_names_the_record(tmp_path):
    task = _task(tmp_path, [{"prompt": "p"}, {"prompt": "q"}], reward="regex", reward_kwargs={"pattern": "a"})
    with pytest.raises(UserError) as err:
        task.require_answers("the warm start imitates")
    assert "d.jsonl:1: no field 'answer'" in _one_line(err)


def test_show_prompts_refuses_a_lone_surrogate_in_one_line(tmp_path, capsys, monkeypatch):
    """On main the record was accepted and the tokenizer raised a TypeError traceback in
    `sdp train --show-prompts` (and in the warm start); it is refused where the file is read."""
    from sdp_cli.cli.main import main

    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "q\\ud83d", "answer": "3"}\n')
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as done:
        main(["train", "task=dataset", f"task.path={path}", "task.reward=final_number", "--show-prompts", "2"])
    err = capsys.readouterr().err
    assert done.value.code == 2, err
    assert err.strip() == f"error: {path}:2: field 'prompt' holds a lone surrogate (\\ud83d), which is not text " \
        "(a UTF-16 half, e.g. from a cut emoji); fix or drop the record", err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.jsonl"]  # nothing written


# ---- the model's context (issue 24): prompts that leave no room for generation are dropped


def test_prompts_that_do_not_fit_the_context_beside_the_budget_are_dropped_and_counted(tmp_path):
    records = [{"prompt": "x" * n, "answer": "1"} for n in (3, 5, 9, 12, 20000)]
    task = _task(tmp_path, records)
    task.prepare(build_tokenizer("ascii"), context=Context(tokens=16, budget=6, budget_key="rollout.max_new_tokens=6"))
    # room = 16 - 6 = 10 tokens; tokens = characters + BOS: 4, 6, 10, 13, 20001 -> 3 stay
    assert sorted(len(i.prompt) for i in task.items) == [3, 5, 9]
    assert task.dropped["train"] == 2
    summary = task.summary()
    assert "2 training and 0 held-out prompts dropped" in summary
    assert "the 10 tokens the model's context (16) leaves beside rollout.max_new_tokens=6" in summary
    assert "task.max_prompt_tokens" in summary  # the fix is named


def test_a_smaller_max_prompt_tokens_wins_over_the_context(tmp_path):
    records = [{"prompt": "x" * n, "answer": "1"} for n in (3, 5, 9)]
    task = _task(tmp_path, records, max_prompt_tokens=6)
    task.prepare(build_tokenizer("ascii"), context=Context(tokens=16, budget=6, budget_key="rollout.max_new_tokens=6"))
    # limit min(6, 16 - 6) = 6: prompts of 4 and 6 tokens stay
    assert sorted(len(i.prompt) for i in task.items) == [3, 5]
    assert "(longer than task.max_prompt_tokens=6)" in task.summary()


def test_every_prompt_too_long_for_the_context_is_one_line(tmp_path):
    task = _task(tmp_path, [{"prompt": "x" * 20000, "answer": "1"}] * 3)
    with pytest.raises(UserError) as err:
        task.prepare(build_tokenizer("ascii"), context=Context(tokens=1024, budget=4, budget_key="rollout.max_new_tokens=4"))
    message = _one_line(err)
    # 20000 characters + BOS = 20001 tokens; room 1024 - 4 = 1020
    assert "longer than the 1020 tokens the model's context (1024) leaves beside rollout.max_new_tokens=4" in message
    assert "the shortest has 20001 tokens" in message and "rollout.max_new_tokens" in message


def test_the_warm_start_skips_and_counts_records_whose_prompt_and_answer_exceed_the_context(tmp_path):
    records = [{"prompt": "x" * 4, "answer": "1" * n} for n in (1, 6, 7, 30)]
    task = _task(tmp_path, records)
    task.prepare(build_tokenizer("ascii"), context=Context(tokens=12, budget=2, budget_key="rollout.max_new_tokens=2"))
    assert task.fit_warm_start(build_tokenizer("ascii"), 12) == 2
    # prompt 4 + BOS = 5 tokens, answer n, EOS 1: 5 + n + 1 <= 12 keeps n = 1 and 6 (12 tokens
    # exactly), skips 7 and 30
    pool = {item.answer for item in task.sft_sample(random.Random(0), 50)}
    assert pool == {"1", "1" * 6}
    for seed in range(10):  # as many as there are: each once
        assert sorted(item.answer for item in task.sft_sample(random.Random(seed), 2)) == ["1", "1" * 6]
    assert {item.answer for item in task.validation_items(10, 0)} == pool
    assert "the warm start skips 2 training records whose prompt + answer + EOS exceed the model's context of 12 tokens" in task.summary()
    with pytest.raises(UserError) as err:
        task.fit_warm_start(build_tokenizer("ascii"), 6)
    assert "model.warm_start_steps=0" in _one_line(err)
