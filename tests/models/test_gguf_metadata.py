"""``gguf_metadata``: sdp's own reader of a GGUF file's header (the context length and weight
type it needs) agrees with the gguf package's full reader on every value it returns, in either
byte order, and a header cut short or malformed is a one-line UserError, never a wrong value."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sdp_cli.errors import UserError
from sdp_cli.models.gguf import gguf_metadata

pytestmark = pytest.mark.skipif(importlib.util.find_spec("gguf") is None, reason="needs the gguf extra")

#: (gguf value type name, values of it)
_SCALARS = {
    "UINT8": st.integers(0, 2**8 - 1),
    "INT8": st.integers(-(2**7), 2**7 - 1),
    "UINT16": st.integers(0, 2**16 - 1),
    "INT16": st.integers(-(2**15), 2**15 - 1),
    "UINT32": st.integers(0, 2**32 - 1),
    "INT32": st.integers(-(2**31), 2**31 - 1),
    "UINT64": st.integers(0, 2**64 - 1),
    "INT64": st.integers(-(2**63), 2**63 - 1),
    "FLOAT32": st.floats(width=32, allow_nan=False),
    "FLOAT64": st.floats(allow_nan=False),
    "BOOL": st.booleans(),
    "STRING": st.text(st.characters(exclude_categories=["Cs"]), max_size=12),  # encodable in UTF-8
}


def _entry() -> st.SearchStrategy:
    """(type name, value, array item type name or None)."""
    scalar = st.sampled_from(sorted(_SCALARS)).flatmap(lambda t: _SCALARS[t].map(lambda v: (t, v, None)))
    array = st.sampled_from(sorted(_SCALARS)).flatmap(
        lambda t: st.lists(_SCALARS[t], min_size=1, max_size=40).map(lambda v: ("ARRAY", v, t))
    )
    nested = st.lists(st.lists(st.integers(0, 255), min_size=1, max_size=4), min_size=1, max_size=4).map(
        lambda v: ("ARRAY", v, "ARRAY")
    )
    return st.one_of(scalar, array, nested)


def _write(path: Path, entries: list[tuple[str, object, str | None]], *, big_endian: bool) -> list[str]:
    """A GGUF file (no tensors) with ``entries`` under keys k0, k1, ...; returns the keys."""
    import gguf

    endian = gguf.GGUFEndian.BIG if big_endian else gguf.GGUFEndian.LITTLE
    writer = gguf.GGUFWriter(str(path), "llama", endianess=endian)
    keys = []
    for i, (kind, value, item_kind) in enumerate(entries):
        key = f"k{i}"
        keys.append(key)
        sub = None if item_kind is None else gguf.GGUFValueType[item_kind]
        writer.add_key_value(key, value, gguf.GGUFValueType[kind], sub_type=sub)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return keys


def _same(ours: object, theirs: object) -> bool:
    if isinstance(theirs, float):
        return isinstance(ours, float) and (ours == theirs or (math.isnan(ours) and math.isnan(theirs)))
    return type(ours) is type(theirs) and ours == theirs


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(entries=st.lists(_entry(), min_size=1, max_size=8), big_endian=st.booleans(), data=st.data())
def test_every_value_matches_the_gguf_package(tmp_path_factory, entries, big_endian, data):
    import gguf

    path = tmp_path_factory.mktemp("meta") / "m.gguf"
    keys = _write(path, entries, big_endian=big_endian)
    asked = data.draw(st.lists(st.sampled_from([*keys, "general.architecture", "absent.key"]), unique=True))
    ours = gguf_metadata(path, asked)
    fields = gguf.GGUFReader(str(path)).fields
    for key in asked:
        field = fields.get(key)
        if field is None or field.types[0] == gguf.GGUFValueType.ARRAY:
            assert key not in ours  # absent, or an array: left out
        else:
            assert _same(ours[key], field.contents()), (key, ours[key], field.contents())


def test_the_header_cut_anywhere_is_one_line_or_still_right(tmp_path):
    """Cut at every byte of the header: the values asked for come back right (the cut is past
    them) or the read fails in one line; never another exception or a wrong value."""
    entries = [
        ("ARRAY", ["a", "bb", "ccc"], "STRING"),
        ("UINT32", 8192, None),
        ("STRING", "qwen2", None),
        ("ARRAY", [1, 2, 3], "INT32"),
        ("FLOAT32", 0.5, None),
    ]
    whole = tmp_path / "whole.gguf"
    keys = _write(whole, entries, big_endian=False)
    full = gguf_metadata(whole, keys)
    assert full == {"k1": 8192, "k2": "qwen2", "k4": 0.5}
    content = whole.read_bytes()
    cut = tmp_path / "cut.gguf"
    for size in range(len(content)):
        cut.write_bytes(content[:size])
        try:
            got = gguf_metadata(cut, keys)
        except UserError as err:
            assert "\n" not in str(err) and str(cut) in str(err)
        else:
            assert got == full, size


@pytest.mark.parametrize(
    "content, problem",
    [
        (b"PK\x03\x04" + bytes(40), "does not start with 'GGUF'"),
        (b"GGUF" + (1).to_bytes(4, "little") + bytes(16), "version 1"),
        (b"GGUF" + (3).to_bytes(4, "little") + bytes(8) + (1).to_bytes(8, "little") + (1).to_bytes(8, "little") + b"k"
         + (99).to_bytes(4, "little"), "unknown type 99"),
        (b"GGUF" + (3).to_bytes(4, "little") + bytes(8) + (1).to_bytes(8, "little") + (2**40).to_bytes(8, "little"),
         "ends past the file.s 32 bytes"),
    ],  # fmt: skip
)
def test_a_malformed_header_is_one_line_naming_the_problem(tmp_path, content, problem):
    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    with pytest.raises(UserError, match=problem) as err:
        gguf_metadata(path, ["x.context_length"])
    assert "\n" not in str(err.value) and "check the file" in str(err.value)
