"""GSM8K task: file parsing (JSONL and parquet), one-line errors, prompt template, reward."""

import json
import random
import sys

import pytest

from sdp_cli.errors import UserError
from sdp_cli.tasks import build_task
from sdp_cli.tasks.gsm8k import sample_path


def _write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _assert_one_line(err: UserError, *fragments: str) -> None:
    message = str(err)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message, message


def test_shipped_sample_loads_and_every_solution_is_self_consistent():
    task = build_task("gsm8k")
    assert len(task) >= 20
    assert task.path == sample_path()
    for item in task.items:
        assert item.prompt.startswith("Question: ") and item.prompt.endswith("\nAnswer: ")
        # SFT target is the full solution; it must earn reward 1 when generated verbatim.
        assert task.reward(item.answer, item, stopped=True) == 1.0
        assert all(32 <= ord(c) < 127 or c == "\n" for c in item.prompt + item.answer)


def test_reward_compares_final_numbers_by_value(tmp_path):
    path = _write_jsonl(tmp_path / "p.jsonl", [{"question": "How many?", "answer": "1000 - 0 = 1000\n#### 1,000"}])
    task = build_task("gsm8k", path=str(path))
    (item,) = task.items
    assert item.meta["final"] == "1,000"
    assert task.reward("so 1000", item, stopped=True) == 1.0
    assert task.reward("#### 1000.0", item, stopped=True) == 1.0
    assert task.reward("1,000 apples", item, stopped=True) == 1.0
    assert task.reward("#### 1000 then 7", item, stopped=True) == 1.0  # after '####' the first number counts
    assert task.reward("1000 apples, then 7", item, stopped=True) == 0.0  # without '####' the last number counts
    assert task.reward("#### 1000", item, stopped=False) == 0.0  # truncated
    assert task.reward("no idea", item, stopped=True) == 0.0


def test_require_stop_false_scores_truncated_completions(tmp_path):
    path = _write_jsonl(tmp_path / "p.jsonl", [{"question": "q", "answer": "#### 3"}])
    task = build_task("gsm8k", path=path, require_stop=False)
    assert task.reward("it is 3", task.items[0], stopped=False) == 1.0


def test_prompt_template_is_applied_literally(tmp_path):
    path = _write_jsonl(tmp_path / "p.jsonl", [{"question": "What is {x}?", "answer": "#### 3"}])
    task = build_task("gsm8k", path=path, prompt_template="<{question}> {json: true}\n")
    assert task.items[0].prompt == "<What is {x}?> {json: true}\n"


def test_template_without_placeholder_is_a_user_error():
    with pytest.raises(UserError) as err:
        build_task("gsm8k", prompt_template="Q: ")
    _assert_one_line(err.value, "{question}")


def test_sample_draws_distinct_items_when_possible():
    task = build_task("gsm8k")
    assert task.num_problems == len(task) == 21 and build_task("arith1").num_problems is None
    items = task.sample(random.Random(0), len(task))
    assert sorted(i.meta["index"] for i in items) == list(range(len(task)))
    assert len(task.sample(random.Random(0), 3 * len(task))) == 3 * len(task)


def test_params_track_file_content(tmp_path):
    path = _write_jsonl(tmp_path / "p.jsonl", [{"question": "q", "answer": "#### 3"}])
    before = build_task("gsm8k", path=path).params()
    _write_jsonl(path, [{"question": "q", "answer": "#### 4"}])
    assert build_task("gsm8k", path=path).params() != before


def test_blank_lines_are_skipped(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('\n{"question": "q", "answer": "#### 3"}\n\n')
    (item,) = build_task("gsm8k", path=path).items
    assert (item.prompt, item.answer, item.meta["final"]) == ("Question: q\nAnswer: ", "#### 3", "3")


@pytest.mark.parametrize(
    ("content", "fragments"),
    [
        ('{"question": "q", "answer": "#### 3"}\n{"question": "q", "answer": \n', ["p.jsonl:2", "not valid JSON"]),
        ('["q", "#### 3"]\n', ["p.jsonl:1", "must be a JSON object"]),
        ('{"answer": "#### 3"}\n', ["p.jsonl:1", "{question}", "does not have"]),
        ('{"question": "q", "answer": 3}\n', ["p.jsonl:1", "'answer'"]),
        ('{"question": "  ", "answer": "#### 3"}\n', ["p.jsonl:1", "'question'"]),
        ('{"question": "q", "answer": "it is 3"}\n', ["p.jsonl:1", "####"]),
        ('{"question": "q", "answer": "#### three"}\n', ["p.jsonl:1", "no number"]),
        ('{"question": "q"}\n', ["p.jsonl:1", "no field 'answer'"]),
        ("\n\n", ["no records"]),
    ],
)
def test_malformed_jsonl_is_a_one_line_user_error(tmp_path, content, fragments):
    path = tmp_path / "p.jsonl"
    path.write_text(content)
    with pytest.raises(UserError) as err:
        build_task("gsm8k", path=path)
    _assert_one_line(err.value, *fragments)


def test_missing_file_and_unknown_extension(tmp_path):
    with pytest.raises(UserError) as err:
        build_task("gsm8k", path=tmp_path / "nope.jsonl")
    _assert_one_line(err.value, "nope.jsonl", "no such file")
    csv = tmp_path / "p.csv"
    csv.write_text("question,answer\n")
    with pytest.raises(UserError) as err:
        build_task("gsm8k", path=csv)
    _assert_one_line(err.value, "'.csv'", "use a .jsonl, .json or .parquet file")


def test_parquet_round_trip_and_errors(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    good = tmp_path / "g.parquet"
    pq.write_table(pa.table({"question": ["q1", "q2"], "answer": ["1+1=2\n#### 2", "#### 1,500"], "extra": [1, 2]}), good)
    task = build_task("gsm8k", path=good)
    assert [i.meta["final"] for i in task.items] == ["2", "1,500"]

    no_column = tmp_path / "n.parquet"
    pq.write_table(pa.table({"question": ["q1"]}), no_column)
    with pytest.raises(UserError) as err:
        build_task("gsm8k", path=no_column)
    _assert_one_line(err.value, "n.parquet row 1", "no field 'answer'")

    bad_row = tmp_path / "b.parquet"
    pq.write_table(pa.table({"question": ["q1", None], "answer": ["#### 1", "#### 2"]}), bad_row)
    with pytest.raises(UserError) as err:
        build_task("gsm8k", path=bad_row)
    _assert_one_line(err.value, "b.parquet row 2", "'question'")

    garbage = tmp_path / "x.parquet"
    garbage.write_bytes(b"not parquet at all")
    with pytest.raises(UserError) as err:
        build_task("gsm8k", path=garbage)
    _assert_one_line(err.value, "x.parquet", "not a parquet file")


def test_parquet_without_pyarrow_is_a_user_error(tmp_path, monkeypatch):
    path = tmp_path / "g.parquet"
    path.write_bytes(b"PAR1")
    # A None entry in sys.modules makes `import pyarrow.parquet` raise ImportError.
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(UserError) as err:
        build_task("gsm8k", path=path)
    _assert_one_line(err.value, "needs pyarrow", "sdp-cli[parquet]")
