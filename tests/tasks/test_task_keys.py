"""The ``task.*`` keys from the config to the task: a data task's keys are one list
(``sdp_cli/dataset_options.py``) that ``sdp train`` hands over and validation refuses elsewhere."""

from dataclasses import fields

import pytest

from sdp_cli.config.compose import compose_config
from sdp_cli.config.schema import TaskConfig
from sdp_cli.dataset_options import DATASET_OPTIONS
from sdp_cli.errors import UserError
from sdp_cli.tasks import TASKS, build_task, task_parameters
from sdp_cli.tasks.gsm8k import sample_path
from sdp_cli.train.session.task_setup import build_task_from, task_kwargs


def test_a_data_task_gets_the_keys_the_config_sets_and_the_run_seed():
    cfg, _ = compose_config(
        ["task=dataset", "task.path=d.jsonl", "task.reward=final_number", "task.prompt_key=q",
         "task.eval_fraction=0.25", "+task.reward_kwargs={tol: 1}", "task.shuffle=false", "seed=3"]
    )  # fmt: skip
    assert task_kwargs(cfg) == {
        # set on the command line
        "path": "d.jsonl",
        "reward": "final_number",
        "prompt_key": "q",
        "eval_fraction": 0.25,
        "reward_kwargs": {"tol": 1},
        "shuffle": False,
        # never null in the schema: always handed over, at their defaults
        "chat_template": False,
        "require_stop": True,
        # the run's, not a task.* key
        "seed": 3,
        # left out (null: the task's own default): answer_key, prompt_template, system_prompt,
        # eval_path, max_prompt_tokens; max_new_tokens is rollout.max_new_tokens's business
    }


def test_the_config_keys_reach_the_data_task():
    cfg, _ = compose_config(
        ["task=gsm8k", f"task.path={sample_path()}", "task.prompt_template='Q: {question} A:'", "task.max_prompt_tokens=50",
         "task.require_stop=false", "seed=11"]
    )  # fmt: skip
    options = build_task_from(cfg).options
    assert (options.prompt_template, options.max_prompt_tokens, options.require_stop) == ("Q: {question} A:", 50, False)
    assert options.seed == 11
    # unset keys keep gsm8k's defaults (sdp_cli/tasks/gsm8k.py DEFAULTS), not the schema's nulls
    assert (options.prompt_key, options.reward, options.max_new_tokens) == ("question", "final_number", 400)


@pytest.mark.parametrize(
    ("name", "overrides", "expected"),
    [
        ("arith1", [], {}),
        ("runsum", [], {}),  # digits null: the task's own 6
        ("runsum", ["task.digits=9"], {"digits": 9}),
        ("arith2", ["task.reward_workers=2", "task.reward_errors=zero"], {}),  # the reward pool's keys
    ],
)
def test_a_generated_task_gets_only_its_own_parameters(name, overrides, expected):
    cfg, _ = compose_config([f"task={name}", *overrides])
    assert task_kwargs(cfg) == expected
    build_task(name, **task_kwargs(cfg))


@pytest.mark.parametrize(
    "override",
    ["task.path=d.jsonl", "task.prompt_key=q", "task.shuffle=false", "task.chat_template=true",
     "task.reward=boxed", "task.eval_fraction=0.5", "+task.reward_kwargs={a: 1}"],
)  # fmt: skip
def test_a_data_key_on_a_generated_task_is_one_line(override):
    key = override.lstrip("+").split("=")[0]
    with pytest.raises(UserError) as err:
        compose_config(["task=runsum", override])
    assert str(err.value) == f"{key} applies to data tasks (task=dataset, task=gsm8k), not task=runsum; remove it"


def test_every_task_key_has_a_reader():
    # A task.* key is the task's name, a data-set option, a parameter of a generated task, or one
    # of the keys of how rewards run (read by the loop's RewardPool and RewardRules.of for every
    # task, docs/tasks.md "How rewards run"). A new key outside these is read by nothing.
    parameters = {p for name in TASKS for p in task_parameters(name)}
    rest = {f.name for f in fields(TaskConfig)} - {"name"} - set(DATASET_OPTIONS) - parameters
    assert rest == {"reward_workers", "reward_pool", "reward_errors", "reward_timeout_s", "reward_max_error_rate",
                    "reward_error_window"}  # fmt: skip
    # and every data-set option but the two sdp train takes from elsewhere is a task.* key
    assert set(DATASET_OPTIONS) - {f.name for f in fields(TaskConfig)} == {"seed", "max_new_tokens"}
