"""Data files: JSON lines, JSON arrays, parquet; every bad file is one line naming file:line."""

import json

import pytest

from sdp_cli.errors import UserError
from sdp_cli.tasks.datafile import read_records


def _one_line(err) -> str:
    message = str(err.value)
    assert "\n" not in message
    return message


def test_jsonl_records_know_their_line_and_index(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"q": 1}\n\n{"q": 2}\n')  # a blank line 2 is skipped
    records = read_records(path)
    assert [(r.data, r.where, r.index) for r in records] == [
        ({"q": 1}, f"{path}:1", 0),
        ({"q": 2}, f"{path}:3", 1),
    ]


def test_a_json_array_gives_each_record_its_line(tmp_path):
    path = tmp_path / "d.json"
    path.write_text('[\n  {"q": 1},\n  {"q": 2,\n   "r": 3}\n]\n')
    assert [(r.data, r.where) for r in read_records(path)] == [({"q": 1}, f"{path}:2"), ({"q": 2, "r": 3}, f"{path}:3")]


def test_a_json_file_holding_json_lines_is_read_as_lines(tmp_path):
    # `datasets.Dataset.to_json` writes JSON lines with a .json name
    path = tmp_path / "d.json"
    path.write_text('{"q": 1}\n{"q": 2}\n')
    assert [r.data["q"] for r in read_records(path)] == [1, 2]


def test_parquet_rows(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"q": ["a", "b"], "n": [1, 2]}), path)
    assert [(r.data, r.where) for r in read_records(path)] == [
        ({"q": "a", "n": 1}, f"{path} row 1"),
        ({"q": "b", "n": 2}, f"{path} row 2"),
    ]


@pytest.mark.parametrize(
    ("name", "content", "fragments"),
    [
        ("d.jsonl", b'{"q": 1}\n{"q": \n', ["d.jsonl:2:", "not valid JSON"]),
        ("d.jsonl", b'{"q": 1} {"q": 2}\n', ["d.jsonl:1:", "more than one JSON value"]),
        ("d.jsonl", b'{"q": 1}\n[1, 2]\n', ["d.jsonl:2:", "must be a JSON object, got list"]),
        ("d.jsonl", b'{"q": 1}\n{"q": "\xff\xfe"}\n', ["d.jsonl:2:", "not UTF-8"]),
        ("d.jsonl", b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", ["d.jsonl", "binary file"]),
        ("d.jsonl", b"PAR1\x00\x00", ["d.jsonl", "is a parquet file", "d.parquet"]),
        ("d.jsonl", b"\n \n", ["holds no records"]),
        ("d.json", b'[{"q": 1},\n {"q": 2}\n', ["d.json:", "not valid JSON"]),
        ("d.json", b'[{"q": 1},\n "text"]\n', ["d.json:2:", "must be a JSON object, got str"]),
        ("d.json", b'[{"q": 1}] trailing', ["d.json:1:", "after the closing"]),
        ("d.json", b"[]", ["holds no records"]),
        ("d.parquet", b'{"q": 1}\n', ["d.parquet", "not a parquet file"]),
        ("d.csv", b"q\n1\n", ["'.csv'", "use a .jsonl, .json or .parquet file"]),
    ],
)
def test_bad_files_are_one_line_naming_the_place(tmp_path, name, content, fragments):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(UserError) as err:
        read_records(path)
    message = _one_line(err)
    for fragment in fragments:
        assert fragment in message, message


def test_missing_path_and_directory(tmp_path):
    with pytest.raises(UserError) as err:
        read_records(tmp_path / "none.jsonl", key="task.eval_path")
    assert _one_line(err).startswith(f"task.eval_path={tmp_path / 'none.jsonl'}: no such file")
    with pytest.raises(UserError) as err:
        read_records(tmp_path)
    assert "a directory" in _one_line(err)


def test_a_truncated_parquet_file_is_one_line(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"q": ["a"] * 100}), path)
    path.write_bytes(path.read_bytes()[:60])
    with pytest.raises(UserError) as err:
        read_records(path)
    assert "not a readable parquet file" in _one_line(err)


def test_unicode_and_nested_fields_survive(tmp_path):
    path = tmp_path / "d.jsonl"
    record = {"prompt": [{"role": "user", "content": "Grüße"}], "meta": {"x": [1, 2]}}
    path.write_text(json.dumps(record, ensure_ascii=False) + "\n", encoding="utf-8")
    assert read_records(path)[0].data == record


# ------------------------------------------------------ deep, huge and odd records (issue 24)
def _deep(depth: int) -> str:
    return '{"prompt": "q", "answer": "1", "x": ' + "[" * depth + "]" * depth + "}"


ODD = [
    # on main: RecursionError from the JSON parser
    ("d.jsonl", '{"prompt": "q", "answer": "1"}\n' + _deep(100_000) + "\n", ["d.jsonl:2:", "nested deeper than"]),
    ("d.json", '[{"prompt": "q", "answer": "1"},\n' + _deep(100_000) + "]\n", ["d.json:2:", "nested deeper than"]),
    # deep enough to parse, deeper than the documented limit (the parser's own limit is ~1000)
    ("d.jsonl", _deep(200) + "\n", ["d.jsonl:1:", "nested deeper than 64"]),
    # on main: ValueError (Python refuses to convert integers of more than 4300 digits)
    ("d.jsonl", '{"prompt": "q", "answer": ' + "9" * 5000 + "}\n", ["d.jsonl:1:", "more than 4300 digits"]),
    ("d.json", '[{"prompt": "q", "answer": ' + "9" * 5000 + "}]\n", ["d.json:1:", "more than 4300 digits"]),
    # on main: accepted, then a TypeError in the tokenizer (warm start, --show-prompts)
    ("d.jsonl", '{"prompt": "q\\ud800", "answer": "1"}\n', ["d.jsonl:1:", "field 'prompt'", "lone surrogate"]),
    ("d.jsonl", '{"prompt": "q", "answer": "1\\udc00"}\n', ["d.jsonl:1:", "field 'answer'", "lone surrogate"]),
    ("d.jsonl", '{"prompt": "q", "meta": {"\\udfff": 1}}\n', ["d.jsonl:1:", "field 'meta'", "lone surrogate"]),
    # on main: accepted, then an allocation error in the warm start; 13 characters × 800000
    # + "prompt" (6) + "answer" (6) + "2" (1) = 10400013 characters of text
    ("d.jsonl", json.dumps({"prompt": "What is 1+1? " * 800_000, "answer": "2"}) + "\n",
     ["d.jsonl:1:", "holds 10400013 characters", "over the 1000000"]),
]  # fmt: skip


@pytest.mark.parametrize(("name", "content", "fragments"), ODD, ids=[f"{n}-{f[-1]}" for n, _, f in ODD])
def test_deep_huge_and_odd_records_are_one_line(tmp_path, name, content, fragments):
    path = tmp_path / name
    path.write_text(content, encoding="utf-8", errors="surrogatepass")
    with pytest.raises(UserError) as err:
        read_records(path)
    message = _one_line(err)
    for fragment in fragments:
        assert fragment in message, message


def test_the_limits_themselves_are_accepted(tmp_path):
    """64 levels of nesting (the record's object is level 1) and 1,000,000 characters of strings
    in a record (keys included) are read."""
    from sdp_cli.tasks.datafile import MAX_DEPTH, MAX_RECORD_CHARS

    path = tmp_path / "d.jsonl"
    deep = {"p": "x"}
    for _ in range(MAX_DEPTH - 2):
        deep = {"p": deep}
    big = {"prompt": "y" * (MAX_RECORD_CHARS - len("prompt"))}
    path.write_text(json.dumps({"x": deep}) + "\n" + json.dumps(big) + "\n")
    assert [r.where for r in read_records(path)] == [f"{path}:1", f"{path}:2"]
    path.write_text(json.dumps({"x": {"p": deep}}) + "\n")
    with pytest.raises(UserError, match="nested deeper than 64"):
        read_records(path)
    path.write_text(json.dumps({"prompt": "y" * (MAX_RECORD_CHARS - len("prompt") + 1)}) + "\n")
    with pytest.raises(UserError, match="1000001 characters"):
        read_records(path)


def test_line_separators_inside_strings_are_text_not_line_breaks(tmp_path):
    """U+2028, U+2029 and U+0085 are valid inside a JSON string; only \\n ends a JSON line (on
    main, str.splitlines split the record there: refused, and later line numbers shifted)."""
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "a\u2028b", "answer": "1"}\r\n{"prompt": "c\u0085d\u2029"}\n\n{"q": 3}\n', encoding="utf-8")
    records = read_records(path)
    assert [(r.data, r.where) for r in records] == [
        ({"prompt": "a\u2028b", "answer": "1"}, f"{path}:1"),
        ({"prompt": "c\u0085d\u2029"}, f"{path}:2"),
        ({"q": 3}, f"{path}:4"),  # line 3 is blank; the line numbers are the file's
    ]
    path.write_text('{"q": 1}\n\u2028{"q": 2}\n', encoding="utf-8")  # outside a string: not JSON
    with pytest.raises(UserError, match="d.jsonl:2: not valid JSON"):
        read_records(path)
