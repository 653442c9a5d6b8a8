"""build_task: names, parameters, one-line errors; tasks import without torch."""

import subprocess
import sys

import pytest

from sdp_cli.errors import UserError
from sdp_cli.tasks import TASKS, build_task
from sdp_cli.tasks.gsm8k import sample_path


def test_every_registered_task_builds_with_defaults():
    for name in TASKS:
        # the generic data-set task has no default data: it is given the gsm8k sample
        options = {"path": str(sample_path()), "prompt_key": "question", "reward": "final_number"}
        task = build_task(name, **options) if name == "dataset" else build_task(name)
        assert task.name == name
        assert task.max_new_tokens >= 1


def test_dataset_without_path_or_reward_says_which_key_to_set():
    with pytest.raises(UserError, match="needs task.path=FILE"):
        build_task("dataset")
    with pytest.raises(UserError, match="needs task.reward: final_number, boxed, regex"):
        build_task("dataset", path=str(sample_path()))


def test_unknown_name_lists_the_choices():
    with pytest.raises(UserError) as err:
        build_task("arith3")
    assert str(err.value) == "unknown task 'arith3'; choose one of arith1, arith2, dataset, gsm8k, runsum"


def test_unknown_parameter_names_what_is_accepted():
    with pytest.raises(UserError) as err:
        build_task("arith1", path="x.jsonl")
    assert str(err.value) == "task 'arith1' has no parameter 'path'; it accepts max_new_tokens"


@pytest.mark.parametrize("bad", [0, -3, "4"])
def test_bad_budget_is_a_user_error(bad):
    with pytest.raises(UserError, match="max_new_tokens must be a positive integer"):
        build_task("arith2", max_new_tokens=bad)


def test_budget_override():
    assert build_task("arith1", max_new_tokens=9).max_new_tokens == 9


def test_tasks_do_not_import_torch():
    code = "import sys, sdp_cli.tasks; sdp_cli.tasks.build_task('gsm8k'); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
