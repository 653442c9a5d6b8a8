"""The structure of a safetensors file, checked from its header alone (no tensor is read).

A safetensors file is an 8-byte little-endian header length n, n bytes of JSON mapping each
tensor name to its dtype, shape and ``data_offsets`` [begin, end) into the data that follows,
and the data itself, which the tensors must cover exactly. A truncated or corrupt file breaks
one of these rules; :func:`check_file` names the first broken one in a phrase that reads after
the file name ("is truncated: ..."), so that every model and checkpoint reader reports it in one
line instead of the library's traceback. sdp's batch reader (``rollout/batch_file.py``) checks
the same layout with batch-specific rules of its own.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

#: safetensors' own limit on the header length
MAX_HEADER_BYTES = 100_000_000
#: bytes per element of the dtypes safetensors writes (sub-byte float types are not checked)
DTYPE_SIZES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}  # fmt: skip


class LayoutError(ValueError):
    """The first structural problem of a file, as a phrase to put after its name."""


def check_file(path: str | os.PathLike[str]) -> None:
    """Raise :class:`LayoutError` unless ``path`` is a complete, well-formed safetensors file."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < 8:
            raise LayoutError(f"is truncated: {size} bytes, shorter than the 8-byte header length")
        header_len = int.from_bytes(f.read(8), "little")
        if header_len > MAX_HEADER_BYTES:
            raise LayoutError(f"has a header length of {header_len} bytes, more than safetensors allows (corrupt)")
        if 8 + header_len > size:
            raise LayoutError(f"is truncated: its header claims {header_len} bytes but {size - 8} follow")
        raw = f.read(header_len)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        raise LayoutError("has a header that is not valid JSON (corrupt)") from None
    if not isinstance(header, dict):
        raise LayoutError("has a header that is not a JSON object (corrupt)")
    check_entries(header, size - 8 - header_len)


def check_entries(header: dict[str, object], data_len: int) -> None:
    """Every tensor entry well formed, its byte range consistent with its dtype and shape, and
    the ``data_len`` bytes after the header covered exactly."""
    covered = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(entry, dict):
            raise LayoutError(f"has a malformed header entry for tensor {name!r} (corrupt)")
        shape, offsets, dtype = entry.get("shape"), entry.get("data_offsets"), entry.get("dtype")
        if not (
            isinstance(shape, list)
            and all(type(d) is int and d >= 0 for d in shape)
            and isinstance(offsets, list)
            and len(offsets) == 2
            and all(type(o) is int for o in offsets)
            and 0 <= offsets[0] <= offsets[1]
        ):
            raise LayoutError(f"has a malformed header entry for tensor {name!r} (corrupt)")
        begin, end = offsets
        if isinstance(dtype, str) and dtype in DTYPE_SIZES and end - begin != math.prod(shape) * DTYPE_SIZES[dtype]:
            raise LayoutError(f"has data_offsets of tensor {name!r} inconsistent with its shape (corrupt)")
        if end > data_len:
            raise LayoutError(
                f"is truncated: tensor {name!r} ends at data byte {end} but {data_len} bytes follow the header"
            )
        covered = max(covered, end)
    if covered < data_len:
        raise LayoutError(f"has {data_len - covered} bytes after its last tensor (corrupt)")


def check_directory(directory: Path) -> None:
    """:func:`check_file` on every ``*.safetensors`` file of ``directory``; the error names the file."""
    for file in sorted(directory.glob("*.safetensors")):
        try:
            check_file(file)
        except LayoutError as err:
            raise LayoutError(f"{file.name} {err}") from None
