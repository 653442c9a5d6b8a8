"""Prompts longer than the model's context leaves beside the generation budget never reach
training (issue 24): ``prepare_task`` drops and counts them for the tiny model (context 1024)
and for a Hugging Face model (its config's max_position_embeddings), refuses when none fits,
and counts the records the tiny model's warm start skips."""

import json

import pytest

from sdp_cli.config.compose import compose_config
from sdp_cli.errors import UserError
from sdp_cli.models import load_policy, save_policy
from sdp_cli.models.context import model_context
from sdp_cli.train.session.task_setup import prepare_task


def _data(tmp_path, lengths, answer="1"):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"prompt": "x" * n, "answer": answer}) + "\n" for n in lengths))
    return path


def _cfg(path, *overrides):
    cfg, _ = compose_config(["task=dataset", f"task.path={path}", "task.reward=final_number", *overrides])
    return cfg


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A tiny model saved as a Hugging Face directory with max_position_embeddings 64."""
    policy = load_policy("tiny", task="gsm8k", warm_start_steps=0, charset="ascii", max_positions=64,
                         hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=2, intermediate_size=64)  # fmt: skip
    target = tmp_path_factory.mktemp("hf") / "model"
    save_policy(policy, target)
    return target


def test_the_tiny_models_context_drops_long_prompts_and_says_so(tmp_path):
    path = _data(tmp_path, [5, 7, 20000, 1100, 1019])
    task = prepare_task(_cfg(path, "rollout.max_new_tokens=4"))
    # room 1024 - 4 = 1020 tokens; a prompt of n characters is n + 1 tokens (BOS):
    # 6, 8 and 1020 stay, 20001 and 1101 go
    assert sorted(len(i.prompt) for i in task.items) == [5, 7, 1019]
    summary = task.summary()
    assert "2 training and 0 held-out prompts dropped" in summary
    assert "the 1020 tokens the model's context (1024) leaves beside rollout.max_new_tokens=4" in summary


def test_the_budget_is_the_larger_of_the_rollout_and_the_evaluation_budget(tmp_path):
    path = _data(tmp_path, [5, 1000])
    task = prepare_task(_cfg(path, "rollout.max_new_tokens=4", "train.eval_max_new_tokens=100"))
    # room 1024 - max(4, 100) = 924: the 1001-token prompt goes
    assert [len(i.prompt) for i in task.items] == [5]
    assert "leaves beside train.eval_max_new_tokens=100" in task.summary()


def test_engine_max_model_len_is_the_context_when_smaller(tmp_path):
    path = _data(tmp_path, [5, 40])
    task = prepare_task(_cfg(path, "rollout.max_new_tokens=4", "engine.max_model_len=32"))
    # room 32 - 4 = 28: the 41-token prompt goes
    assert [len(i.prompt) for i in task.items] == [5]


def test_every_prompt_too_long_refuses_in_one_line(tmp_path):
    path = _data(tmp_path, [20000, 30000])
    with pytest.raises(UserError) as err:
        prepare_task(_cfg(path, "rollout.max_new_tokens=4"))
    message = str(err.value)
    assert "\n" not in message and "the shortest has 20001 tokens" in message


def test_a_budget_the_context_cannot_hold_refuses_for_any_task():
    cfg, _ = compose_config(["task=arith1", "rollout.max_new_tokens=1024"])
    with pytest.raises(UserError) as err:
        prepare_task(cfg)
    assert "rollout.max_new_tokens=1024 leaves no room for a prompt in the model's context of 1024 tokens" in str(err.value)


def test_the_warm_start_skips_are_counted_before_the_run(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"prompt": "ab", "answer": "1"}) + "\n" + json.dumps({"prompt": "cd", "answer": "2" * 1100}) + "\n")
    task = prepare_task(_cfg(path, "rollout.max_new_tokens=4", "model.warm_start_steps=3"))
    # 2 + 1 (BOS) + 1100 + 1 (EOS) = 1104 > 1024: the second record is skipped by the warm start only
    assert len(task.items) == 2
    assert "the warm start skips 1 training records" in task.summary()


def test_a_hugging_face_models_context_comes_from_its_config(tmp_path, hf_dir):
    assert model_context(_cfg(tmp_path / "d.jsonl", "model.kind=hf", f"model.path={hf_dir}")) == 64
    path = _data(tmp_path, [5, 50, 60, 5000])
    task = prepare_task(_cfg(path, "model.kind=hf", f"model.path={hf_dir}", "rollout.max_new_tokens=8"))
    # room 64 - 8 = 56; its character tokenizer adds BOS: 6 and 51 stay, 61 and 5001 go
    assert sorted(len(i.prompt) for i in task.items) == [5, 50]
    assert "the 56 tokens the model's context (64) leaves beside rollout.max_new_tokens=8" in task.summary()
    with pytest.raises(UserError) as err:
        prepare_task(_cfg(_data(tmp_path, [60, 70]), "model.kind=hf", f"model.path={hf_dir}", "rollout.max_new_tokens=8"))
    assert "the shortest has 61 tokens" in str(err.value)
