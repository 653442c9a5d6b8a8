"""Reward plug-ins: every way a reward spec or a reward function can be wrong is one line that
names the file:line (or the key) — at load time, before a run writes anything — or the
function, the record and the exception when it fails while scoring."""

import math
import sys

import pytest

from sdp_cli.errors import UserError
from sdp_cli.tasks.plugins import RewardError, call_reward, load_reward, to_score


def _one_line(err) -> str:
    message = str(err.value)
    assert "\n" not in message
    return message


def _write(tmp_path, text, name="reward.py"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_a_file_function_loads_and_scores(tmp_path):
    path = _write(tmp_path, "def score(prompt, completion, record, bonus=0.0):\n    return len(completion) + bonus\n")
    spec = load_reward(f"{path}:score", {"bonus": 0.5}, answer_key="answer")
    # len("abc") + 0.5 = 3.5
    assert call_reward(spec, "p", "abc", {}, "record 0 (d.jsonl:1)") == 3.5


def test_a_module_function_loads(tmp_path, monkeypatch):
    (tmp_path / "my_rewards").mkdir()
    (tmp_path / "my_rewards" / "__init__.py").write_text("")
    (tmp_path / "my_rewards" / "math.py").write_text("def exact(prompt, completion, record):\n    return {'score': 1.0, 'len': 2}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = load_reward("my_rewards.math:exact", {}, answer_key="answer")
    assert call_reward(spec, "p", "c", {}, "r") == {"score": 1.0, "len": 2.0}
    sys.modules.pop("my_rewards.math", None)
    sys.modules.pop("my_rewards", None)


def test_builtins_get_the_answer_key():
    spec = load_reward("final_number", {}, answer_key="solution")
    assert dict(spec.kwargs) == {"answer_key": "solution"}
    assert call_reward(spec, "p", "#### 4", {"solution": "2+2=4"}, "r") == 1.0


@pytest.mark.parametrize(
    ("source", "spec_tail", "fragments"),
    [
        ("def score(p, c, r):\n    return (\n", ":score", ["reward.py:2", "SyntaxError", "fix the file"]),
        ("import no_such_module_xyz\n", ":score", ["reward.py:1", "ModuleNotFoundError", "while importing"]),
        ("x = 1\nraise RuntimeError('boom')\n", ":score", ["reward.py:2", "RuntimeError: boom"]),
        ("def scor(p, c, r):\n    return 1\n", ":score", ["has no function 'score'", "did you mean scor?"]),
        ("score = 3\n", ":score", ["is a int, not a function"]),
        ("def score(completion):\n    return 1\n", ":score", ["cannot be called as fn(prompt, completion, record)"]),
    ],
)
def test_bad_reward_files_are_one_line_naming_the_place(tmp_path, source, spec_tail, fragments):
    path = _write(tmp_path, source, name=f"reward_{abs(hash(source))}.py")
    with pytest.raises(UserError) as err:
        load_reward(f"{path}{spec_tail}", {}, answer_key="answer")
    message = _one_line(err)
    for fragment in fragments:
        assert fragment.replace("reward.py", path.name) in message, message


@pytest.mark.parametrize(
    ("spec", "kwargs", "fragment"),
    [
        ("final_numbr", {}, "not a built-in reward (final_number, boxed, regex); did you mean final_number?"),
        ("nowhere/reward.py:score", {}, "does not exist"),
        ("no_such_package_xyz.rewards:score", {}, "no module 'no_such_package_xyz' on the Python path"),
        ("reward.py:", {}, "expected package.module:function or path/to/file.py:function"),
        ("regex", {}, "cannot be called as fn(prompt, completion, record)"),
        ("regex", {"pattern": "(unclosed"}, "task.reward_kwargs.pattern='(unclosed' is not a valid regex"),
        ("boxed", {"unknown": 1}, "unknown=..."),
    ],
)
def test_bad_specs_and_kwargs_are_one_line(spec, kwargs, fragment):
    with pytest.raises(UserError) as err:
        load_reward(spec, kwargs, answer_key="answer")
    assert fragment in _one_line(err)


def test_an_exception_while_scoring_names_function_record_and_exception(tmp_path):
    path = _write(tmp_path, "def score(prompt, completion, record):\n    return 1 / 0\n")
    spec = load_reward(f"{path}:score", {}, answer_key="answer")
    with pytest.raises(RewardError) as err:
        call_reward(spec, "p", "c", {}, "record 17 (data.jsonl:18)")
    assert _one_line(err) == (
        "reward function reward.py:score failed on record 17 (data.jsonl:18): ZeroDivisionError: division by zero"
    )
    assert "Traceback" in err.value.details and "return 1 / 0" in err.value.details


@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        (math.nan, "returned nan as its score"),
        (math.inf, "returned inf as its score"),
        ("1.0", "returned str '1.0' as its score"),
        (None, "returned NoneType None as its score"),
        ({"format": 1.0}, "a mapping without 'score'"),
        ({"score": 1.0, "len": "long"}, "returned str 'long' as its 'len'"),
        ({"score": 1.0, "kl": math.nan}, "returned nan as its 'kl'"),
    ],
)
def test_unusable_results_are_errors(value, fragment):
    with pytest.raises(RewardError) as err:
        to_score(value, "reward.py:score", "record 2 (d.jsonl:3)")
    message = _one_line(err)
    assert fragment in message and "reward.py:score" in message and "record 2 (d.jsonl:3)" in message


def test_usable_results():
    assert to_score(True, "f", "r") == (1.0, {})  # `return answer == expected` scores 1.0
    assert to_score(0, "f", "r") == (0.0, {})
    assert to_score({"score": 0.5, "format": 1}, "f", "r") == (0.5, {"format": 1.0})


def test_reward_error_keeps_its_details_across_pickling():
    import pickle

    err = pickle.loads(pickle.dumps(RewardError("one line", "trace\nback")))
    assert str(err) == "one line" and err.details == "trace\nback"
