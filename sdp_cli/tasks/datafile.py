"""Read task data files: JSON lines, a JSON array, or parquet, each record with its location.

Every record is a JSON object (a Python dict). Its location (``data.jsonl:12``, ``data.parquet
row 3``) goes into every error message about it, so a bad record is found in one look. A file
that is not what its extension says (binary bytes in a .jsonl, a text file named .parquet) is
refused in one line before anything else happens. Parquet needs pyarrow, the optional extra
``sdp-cli[parquet]``.

Every record is checked where it enters, so that no record reaches the tokenizer or the warm
start that would fail there (docs/tasks.md, "Limits on a record"): nesting at most
``MAX_DEPTH`` deep, at most ``MAX_RECORD_CHARS`` characters of strings, no lone UTF-16
surrogate (``"\ud800"`` is valid JSON but not text), and integers that Python converts (at most
4300 digits). JSON lines end at ``\n`` only: U+2028 or U+0085 inside a string is text.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sdp_cli.errors import UserError

JSONL_SUFFIXES = (".jsonl", ".ndjson")
SUFFIXES = (*JSONL_SUFFIXES, ".json", ".parquet")
_PARQUET_MAGIC = b"PAR1"
#: how deep a record may nest (the record's object is level 1): real records are a few levels
#: deep, and Python's JSON parser and the reward pool's pickling recurse per level
MAX_DEPTH = 64
#: characters of strings (keys included) a record may hold: a prompt is tokenized whole and a
#: warm start trains on it, so a 10 MB prompt failed there with an allocation error
MAX_RECORD_CHARS = 1_000_000
#: the characters of JSON's own whitespace; str.strip() would also take U+2028, U+0085, ...
_JSON_SPACE = " \t\r"
_SURROGATE = re.compile("[\ud800-\udfff]")


@dataclass(frozen=True)
class Record:
    """One record of a data file: its fields, where it is (``file:line`` or ``file row N``) and
    its position among the file's records (0-based)."""

    data: dict[str, Any]
    where: str
    index: int = 0


def read_records(path: str | Path, *, key: str = "task.path", fix: str = "") -> list[Record]:
    """Every record of ``path`` (``.jsonl``/``.ndjson``, ``.json`` or ``.parquet``).

    ``key`` names the config key the path came from and ``fix`` is appended to record-level
    errors. Raises a one-line UserError naming the file (and line or row) for anything else.
    """
    path = Path(path).expanduser()
    hint = f"; {fix}" if fix else ""
    if not path.is_file():
        what = "a directory" if path.is_dir() else "no such file"
        raise UserError(f"{key}={path}: {what}; pass a .jsonl, .json or .parquet file")
    suffix = path.suffix.lower()
    if suffix not in SUFFIXES:
        raise UserError(
            f"{key}={path} has the extension {suffix!r}; use a .jsonl, .json or .parquet file "
            "(convert CSV with e.g. pandas: df.to_json(path, orient='records', lines=True))"
        )
    if suffix == ".parquet":
        records = _read_parquet(path, hint)
    else:
        records = _read_json(path, hint, lines=suffix in JSONL_SUFFIXES)
    if not records:
        raise UserError(f"{key}={path} holds no records{hint}")
    return [Record(r.data, r.where, i) for i, r in enumerate(records)]


def _check_text(path: Path, data: bytes) -> str:
    if data.startswith(_PARQUET_MAGIC):
        raise UserError(f"{path} is a parquet file, not JSON; rename it to {path.stem}.parquet")
    if b"\x00" in data[:65536]:
        raise UserError(f"{path} is a binary file, not JSON text; pass a .jsonl, .json or .parquet data file")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        line = data[: err.start].count(b"\n") + 1
        raise UserError(f"{path}:{line}: not UTF-8 text; save the file as UTF-8") from None


def _unreadable(where: str, err: ValueError | RecursionError, hint: str) -> UserError:
    """Valid JSON that Python's parser cannot hold: nesting past its recursion limit, or an
    integer past its digit limit (``sys.get_int_max_str_digits``)."""
    if isinstance(err, RecursionError):
        return UserError(f"{where}: the record is nested deeper than {MAX_DEPTH} levels; flatten it{hint}")
    return UserError(
        f"{where}: a number has more than {sys.get_int_max_str_digits()} digits, more than sdp reads; "
        f"write it as a string{hint}"
    )


def _object(value: Any, where: str, hint: str) -> Record:
    if not isinstance(value, dict):
        raise UserError(f"{where}: a record must be a JSON object, got {type(value).__name__}{hint}")
    check_values(value, where, hint)
    return Record(value, where)


def check_values(record: dict[str, Any], where: str, hint: str = "") -> None:
    """Refuse, in one line naming the top-level field: nesting deeper than ``MAX_DEPTH``, a
    string (value or key) with a lone surrogate, more than ``MAX_RECORD_CHARS`` characters of
    strings in all. Iterative, so a deep record costs no recursion."""
    chars = 0
    stack: list[tuple[Any, int, str]] = [(record, 1, "")]
    while stack:
        value, depth, field = stack.pop()
        if depth > MAX_DEPTH and isinstance(value, (dict, list)):
            raise UserError(f"{where}: field {field!r} is nested deeper than {MAX_DEPTH} levels; flatten it{hint}")
        if isinstance(value, dict):
            for key, item in value.items():
                name = field or str(key)
                if isinstance(key, str):
                    chars += len(key)
                    _refuse_surrogates(key, where, name, hint)
                stack.append((item, depth + 1, name))
        elif isinstance(value, list):
            stack.extend((item, depth + 1, field) for item in value)
        elif isinstance(value, str):
            chars += len(value)
            _refuse_surrogates(value, where, field, hint)
    if chars > MAX_RECORD_CHARS:
        raise UserError(
            f"{where}: the record holds {chars} characters of text, over the {MAX_RECORD_CHARS} a record may "
            f"have (docs/tasks.md); shorten or drop it (task.max_prompt_tokens drops long prompts only after "
            f"they were read and tokenized){hint}"
        )


def _refuse_surrogates(text: str, where: str, field: str, hint: str) -> None:
    found = _SURROGATE.search(text)
    if found is not None:
        raise UserError(
            f"{where}: field {field!r} holds a lone surrogate (\\u{ord(found.group()):04x}), which is not text "
            f"(a UTF-16 half, e.g. from a cut emoji); fix or drop the record{hint}"
        )


def _read_json(path: Path, hint: str, *, lines: bool) -> list[Record]:
    text = _check_text(path, path.read_bytes())
    decoder = json.JSONDecoder()
    start = len(text) - len(text.lstrip())
    if not lines and text[start : start + 1] == "[":
        return _read_array(path, text, start, decoder, hint)
    # JSON lines (also a .json file that is not an array: `datasets` writes JSON lines as .json)
    records = []
    for lineno, line in enumerate(text.split("\n"), start=1):
        if not line.strip(_JSON_SPACE):
            continue
        where = f"{path}:{lineno}"
        try:
            value, end = decoder.raw_decode(line, len(line) - len(line.lstrip(_JSON_SPACE)))
        except json.JSONDecodeError as err:
            raise UserError(f"{where}: not valid JSON ({err.msg}, column {err.colno}){hint}") from None
        except (ValueError, RecursionError) as err:
            raise _unreadable(where, err, hint) from None
        if line[end:].strip(_JSON_SPACE):
            raise UserError(f"{where}: more than one JSON value on the line; put one record per line")
        records.append(_object(value, where, hint))
    return records


def _read_array(path: Path, text: str, start: int, decoder: json.JSONDecoder, hint: str) -> list[Record]:
    """A top-level JSON array, element by element so that each record knows its line."""

    def line_of(index: int) -> int:
        return text.count("\n", 0, index) + 1

    def skip(index: int) -> int:
        while index < len(text) and text[index] in " \t\r\n":
            index += 1
        return index

    records = []
    index = skip(start + 1)
    if text[index : index + 1] == "]":
        index += 1
    else:
        while True:
            try:
                value, end = decoder.raw_decode(text, index)
            except json.JSONDecodeError as err:
                raise UserError(f"{path}:{err.lineno}: not valid JSON ({err.msg}){hint}") from None
            except (ValueError, RecursionError) as err:
                raise _unreadable(f"{path}:{line_of(index)}", err, hint) from None
            records.append(_object(value, f"{path}:{line_of(index)}", hint))
            index = skip(end)
            if text[index : index + 1] == ",":
                index = skip(index + 1)
                continue
            if text[index : index + 1] == "]":
                index += 1
                break
            raise UserError(f"{path}:{line_of(index)}: not valid JSON (expected ',' or ']' after a record){hint}")
    if text[index:].strip():
        raise UserError(f"{path}:{line_of(skip(index))}: not valid JSON (text after the closing ']'){hint}")
    return records


def _read_parquet(path: Path, hint: str) -> list[Record]:
    with path.open("rb") as fh:
        head = fh.read(4)
    if head != _PARQUET_MAGIC:
        raise UserError(f"{path}: not a parquet file (it does not start with PAR1); pass a real .parquet file")
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise UserError(
            f"reading {path} needs pyarrow, which is not installed; "
            "pip install 'sdp-cli[parquet]' or convert the file to JSONL"
        ) from None
    try:
        rows = pq.read_table(path).to_pylist()
    except Exception as err:  # pyarrow raises several unrelated types for a bad file
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise UserError(f"{path}: not a readable parquet file ({first}); re-write it, e.g. with pandas.to_parquet") from None
    return [_object(row, f"{path} row {i + 1}", hint) for i, row in enumerate(rows)]
