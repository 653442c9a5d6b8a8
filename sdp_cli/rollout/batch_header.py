"""The on-disk header of an sdp batch file (docs/batch-format.md, "Validation" steps 1–5):
reading the bytes safely, recognising safetensors by its structure, the metadata and the tensor
entries. No tensor is built here; ``batch_file`` validates the tensors and their numbers.
"""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path
from typing import Any, BinaryIO

from sdp_cli.errors import UserError

FORMAT_TAG = "sdp-batch"
FORMAT_VERSION = 1
#: a header longer than this is refused before it is read: a real one is a few kB, and parsing
#: an adversarial 100 MB header (safetensors' own limit) takes seconds and gigabytes
MAX_HEADER_BYTES = 1024 * 1024
#: a batch file larger than this is refused before it is read (docs/batch-format.md, "Validation"):
#: the reader holds the whole file in memory, and sdp writes 33 to 45 bytes per token (with
#: every optional tensor), so 4 GiB is over 90 million tokens; a sparse file can claim terabytes
MAX_BATCH_BYTES = 4 * 2**30
REQUIRED_TENSORS = (
    "input_ids",
    "cu_seqlens",
    "prompt_lens",
    "old_logprobs",
    "versions",
    "proximal_logprobs_t",
    "proximal_t_versions",
)
#: every tensor a batch may hold: safetensors dtype name and element size
ENTRY_DTYPES = {
    "input_ids": ("I64", 8),
    "cu_seqlens": ("I64", 8),
    "prompt_lens": ("I64", 8),
    "versions": ("I64", 8),
    "proximal_t_versions": ("I64", 8),
    "old_logprobs": ("F32", 4),
    "proximal_logprobs_t": ("F32", 4),
    "proximal_logprobs": ("F32", 4),
    "logprobs": ("F32", 4),
    "advantages": ("F32", 4),
    "rewards": ("F32", 4),
    "loss_mask": ("U8", 1),
}
METADATA_KEYS = (
    "format",
    "format_version",
    "trainer_version",
    "temperature",
    "model",
    "mode",
    "sdp_version",
)

#: a trainer version as sdp writes it (str(int)); at most 40 digits, so that int() never
#: spends time on a hostile string (the range itself is checked in batch_file.validate_batch)
_DECIMAL = re.compile(r"[0-9]{1,40}")

FIX_RECREATE = "re-create it with `sdp train train.save_batches=true`"
FIX_NOT_OURS = "pass a batch file written by sdp (see docs/batch-format.md)"


class BatchFormatError(UserError):
    """A batch file (or an in-memory batch about to be written) is malformed."""

    def __init__(self, where: str, problem: str, fix: str = FIX_RECREATE):
        super().__init__(f"{where}: {problem}; {fix}")


def _looks_like_safetensors(head: bytes, size: int, first_header_byte: bytes) -> bool:
    """The file's own structure: a plausible header length that fits the file, followed by the
    opening brace of a JSON object. Checked before any magic bytes, because a valid header of
    640, 896, 1152 or 1408 bytes begins with what a pickle begins with (0x80, then 2–5)."""
    if len(head) < 8:
        return False
    header_len = int.from_bytes(head, "little")
    return 2 <= header_len <= MAX_HEADER_BYTES and 8 + header_len <= size and first_header_byte == b"{"


def _refuse_foreign(where: str, head: bytes) -> None:
    """Refuse zip archives (``torch.save``) and pickles by their magic bytes, unread."""
    if head.startswith(b"PK\x03\x04"):
        raise BatchFormatError(
            where, "is a zip archive (a torch.save file?), not a safetensors file", FIX_NOT_OURS
        )
    if len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5:
        raise BatchFormatError(where, "is a Python pickle, which sdp never loads", FIX_NOT_OURS)


def read_file(where: str, path: Path) -> tuple[bytes, int]:
    """(the whole file, its header length), copied into memory once. The file's size is checked
    against ``MAX_BATCH_BYTES`` and the header length against the size on the first 8 bytes,
    before anything else is read or allocated; a machine that lacks the memory for a file within
    the limit gets one line too."""
    try:
        # O_NONBLOCK: opening a FIFO must not wait for a writer; fstat then refuses it
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise BatchFormatError(where, "is not a regular file", "pass the path of a batch file")
            f = os.fdopen(fd, "rb")
        except BaseException:
            os.close(fd)
            raise
        size = info.st_size
        with f:
            if size > MAX_BATCH_BYTES:
                raise BatchFormatError(
                    where,
                    f"is {size / 2**30:.1f} GiB, over the {MAX_BATCH_BYTES // 2**30} GiB limit on a batch file "
                    "(docs/batch-format.md; a sparse or corrupt file can claim any size)",
                    "split the batches (train.save_batches writes one file per step)",
                )
            head = f.read(8)
            if not _looks_like_safetensors(head, size, f.read(1)):
                _refuse_foreign(where, head)
            if len(head) < 8:
                raise BatchFormatError(
                    where, f"is truncated: {len(head)} bytes, shorter than the 8-byte header length"
                )
            header_len = int.from_bytes(head, "little")
            if header_len > MAX_HEADER_BYTES:
                raise BatchFormatError(
                    where,
                    f"header length {header_len} exceeds the {MAX_HEADER_BYTES // 2**20} MB limit "
                    "(not a safetensors file, or corrupt)",
                    FIX_NOT_OURS,
                )
            if 8 + header_len > size:
                raise BatchFormatError(
                    where,
                    f"is truncated: the header claims {header_len} bytes but {size - 8} follow",
                )
            f.seek(0)
            data = read_whole(f, size)
    except FileNotFoundError:
        raise BatchFormatError(where, "file not found", "check the path") from None
    except PermissionError:
        raise BatchFormatError(where, "permission denied", "check the file's permissions") from None
    except MemoryError:
        raise BatchFormatError(
            where, f"not enough memory to read its {size / 2**20:.0f} MB", "free memory, or read fewer batches at once"
        ) from None
    except OSError as err:
        raise BatchFormatError(
            where, f"cannot be read ({err.strerror or err})", "check the file"
        ) from None
    if len(data) != size or data[:8] != head:
        raise BatchFormatError(
            where,
            f"changed while it was read ({size} bytes, then {len(data)})",
            "read it again once the process writing it has finished",
        )
    return data, header_len


def read_whole(f: BinaryIO, size: int) -> bytes:
    """The rest of ``f``, at most ``size + 1`` bytes: one more than the size it had, so that a
    file that grew while it was read is told from a whole one."""
    return f.read(size + 1)


def parse_header(where: str, data: bytes, header_len: int) -> tuple[dict[str, Any], int]:
    """(parsed header JSON, bytes of tensor data after it)."""
    try:
        header = json.loads(data[8 : 8 + header_len])
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        raise BatchFormatError(
            where, "header is not valid JSON (not a safetensors file, or corrupt)"
        ) from None
    if not isinstance(header, dict):
        raise BatchFormatError(where, "header is not a JSON object")
    return header, len(data) - 8 - header_len


def parse_metadata(where: str, header: dict[str, Any]) -> dict[str, Any]:
    meta = header.pop("__metadata__", None)
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_TAG:
        tag = meta.get("format") if isinstance(meta, dict) else None
        raise BatchFormatError(
            where, f"format tag is {tag!r}, expected {FORMAT_TAG!r}: not an sdp batch", FIX_NOT_OURS
        )
    missing = [k for k in METADATA_KEYS if k not in meta]
    if missing:
        raise BatchFormatError(where, f"metadata lacks {', '.join(missing)}")
    not_str = sorted(k for k, v in meta.items() if not isinstance(v, str))
    if not_str:
        raise BatchFormatError(where, f"metadata value of {not_str[0]!r} is not a string")
    try:
        version = int(meta["format_version"])
    except ValueError:
        raise BatchFormatError(
            where, f"format_version {meta['format_version']!r} is not an integer"
        ) from None
    if version > FORMAT_VERSION:
        raise BatchFormatError(
            where,
            f"format version {version} is newer than this sdp reads ({FORMAT_VERSION})",
            "upgrade sdp",
        )
    if version != FORMAT_VERSION:
        raise BatchFormatError(
            where, f"format version {version} is not supported (expected {FORMAT_VERSION})"
        )
    if not _DECIMAL.fullmatch(meta["trainer_version"]):
        raise BatchFormatError(
            where, f"trainer_version {meta['trainer_version'][:40]!r} is not a plain decimal integer"
        )
    trainer_version = int(meta["trainer_version"])
    try:
        temperature = float(meta["temperature"])
    except ValueError:
        raise BatchFormatError(
            where, f"temperature {meta['temperature'][:40]!r} in the metadata is not a number"
        ) from None
    return {
        "trainer_version": trainer_version,
        "temperature": temperature,
        "model": meta["model"],
        "mode": meta["mode"],
        "sdp_version": meta["sdp_version"],
    }


def check_entries(where: str, header: dict[str, Any], data_len: int) -> None:
    """Names, dtypes, 1-D shapes and byte ranges of the tensor entries, before any data is read."""
    unknown = sorted(set(header) - set(ENTRY_DTYPES))
    if unknown:
        raise BatchFormatError(where, f"unexpected tensor {unknown[0]!r}")
    missing = [n for n in REQUIRED_TENSORS if n not in header]
    if missing:
        raise BatchFormatError(where, f"missing required tensor(s) {', '.join(missing)}")
    for name, entry in header.items():
        st_dtype, itemsize = ENTRY_DTYPES[name]
        if not isinstance(entry, dict):
            raise BatchFormatError(where, f"header entry of tensor {name} is not an object")
        if entry.get("dtype") != st_dtype:
            raise BatchFormatError(
                where, f"tensor {name} has dtype {entry.get('dtype')}, expected {st_dtype}"
            )
        shape = entry.get("shape")
        if not (isinstance(shape, list) and len(shape) == 1 and type(shape[0]) is int and shape[0] >= 0):
            raise BatchFormatError(where, f"tensor {name} has shape {shape}, expected 1-D")
        offsets = entry.get("data_offsets")
        if not (
            isinstance(offsets, list)
            and len(offsets) == 2
            and all(type(o) is int for o in offsets)
        ):
            raise BatchFormatError(where, f"tensor {name} has malformed data_offsets {offsets}")
        begin, end = offsets
        if not 0 <= begin <= end or end - begin != shape[0] * itemsize:
            raise BatchFormatError(
                where, f"tensor {name} has data_offsets {offsets} inconsistent with its shape"
            )
        if end > data_len:
            raise BatchFormatError(
                where,
                f"is truncated: tensor {name} ends at data byte {end} but only {data_len} bytes follow the header",
            )
