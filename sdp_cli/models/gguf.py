"""GGUF model files (``model.path=model.gguf``; docs/real-models.md).

transformers reads a GGUF file (through the optional ``gguf`` package, extra ``sdp-cli[gguf]``)
and dequantises its weights to float32; sdp trains those float32 weights, not the quantised
ones. A model loaded that way keeps a GGUF quantizer attached and ``save_pretrained`` refuses
it, so ``load_gguf`` rebuilds a plain model from the config (without its quantization entry)
and the dequantised state dict: it then saves, pushes to engines and checkpoints like any other
Hugging Face model. ``scripts/gguf_to_hf.py`` writes such a model as a safetensors directory,
e.g. to start a vLLM server on it by hand; ``sdp train`` needs no conversion: a server engine
starts from the run's own saved copy (``weights/launch``).
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import mmap
import struct
from collections.abc import Collection
from pathlib import Path
from typing import Any

from sdp_cli.errors import UserError

#: GGUF file types whose weights are stored unquantised (no dequantisation happens)
_PLAIN_TYPES = ("ALL_F32", "MOSTLY_F16", "MOSTLY_BF16")


def is_gguf(path: str | Path | None) -> bool:
    """Whether ``model.path`` names a GGUF file (by its suffix)."""
    return path is not None and str(path).lower().endswith(".gguf")


def check_gguf_file(path: str | Path) -> Path:
    """The GGUF file, checked: it exists, starts with the GGUF magic, and the ``gguf`` package
    is installed; one-line UserError otherwise."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise UserError(f"model.path={path} is not a file; pass an existing .gguf file or a model directory")
    with open(file, "rb") as handle:
        magic = handle.read(4)
    if magic != b"GGUF":
        raise UserError(f"model.path={path} is not a GGUF file (it does not start with 'GGUF'); check the file")
    if importlib.util.find_spec("gguf") is None:
        raise UserError(
            f"model.path={path} is a GGUF file, which needs the gguf package; pip install 'sdp-cli[gguf]'"
        )
    return file


#: GGUF metadata value types (the format's numbering) with their struct codes; 8 string, 9 array
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


def gguf_metadata(path: str | Path, keys: Collection[str]) -> dict[str, Any]:
    """The values of the metadata ``keys`` a GGUF file holds (numbers, booleans and strings;
    an array's key is left out), read from its header alone and only as far as the last of them.
    ``gguf.GGUFReader`` maps every field and tensor of the file first: seconds for a model's
    token lists, paid by each process that asked for one number. One-line UserError for a file
    whose header is cut short or malformed."""
    file = Path(path).expanduser()
    wanted = set(keys)
    found: dict[str, Any] = {}
    try:
        with open(file, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
            if data[:4] != b"GGUF":
                raise ValueError("it does not start with 'GGUF'")
            # a big-endian file's version reads as a multiple of 2**16 in little-endian order
            order = "<" if struct.unpack_from("<I", data, 4)[0] < 1 << 16 else ">"
            version = struct.unpack_from(order + "I", data, 4)[0]
            if version < 2:
                raise ValueError(f"GGUF version {version} is not read (2 and later are)")
            count = struct.unpack_from(order + "Q", data, 16)[0]
            offset = 24
            for _ in range(count):
                if not wanted - found.keys():
                    break
                key, offset = _gguf_string(data, offset, order)
                kind = struct.unpack_from(order + "I", data, offset)[0]
                value, offset = _gguf_value(data, offset + 4, order, kind)
                if key in wanted and kind != _ARRAY:
                    found[key] = value
    except (OSError, ValueError, struct.error, UnicodeDecodeError) as err:
        raise UserError(f"cannot read the GGUF file {file}'s metadata: {err}; check the file") from None
    return found


def _gguf_string(data: mmap.mmap, offset: int, order: str) -> tuple[str, int]:
    size = struct.unpack_from(order + "Q", data, offset)[0]
    end = offset + 8 + size
    if end > len(data):
        raise ValueError("its metadata is cut short")
    return data[offset + 8 : end].decode("utf-8"), end


def _gguf_value(data: mmap.mmap, offset: int, order: str, kind: int) -> tuple[Any, int]:
    """The value of type ``kind`` at ``offset`` and the offset after it (an array: None, skipped
    without decoding its items, which for a token list are most of the header)."""
    if kind in _SCALARS:
        code = order + _SCALARS[kind]
        return struct.unpack_from(code, data, offset)[0], offset + struct.calcsize(code)
    if kind == _STRING:
        return _gguf_string(data, offset, order)
    if kind == _ARRAY:
        item_kind, items = struct.unpack_from(order + "IQ", data, offset)
        offset += 12
        if item_kind in _SCALARS:
            end = offset + items * struct.calcsize(order + _SCALARS[item_kind])
            if end > len(data):
                raise ValueError("its metadata is cut short")
            return None, end
        for _ in range(items):
            if item_kind == _STRING:  # the length alone: no string is decoded
                offset += 8 + struct.unpack_from(order + "Q", data, offset)[0]
            else:
                _, offset = _gguf_value(data, offset, order, item_kind)
        if offset > len(data):
            raise ValueError("its metadata is cut short")
        return None, offset
    raise ValueError(f"its metadata holds a value of unknown type {kind}")


def quantization(path: str | Path) -> str:
    """The file's weight type as llama.cpp names it (``Q4_1``, ``F32``, ...); ``unknown`` when
    the file does not say."""
    import gguf

    value = gguf_metadata(path, ["general.file_type"]).get("general.file_type")
    if value is None:
        return "unknown"
    try:
        name = gguf.LlamaFileType(value).name
    except ValueError:
        return f"type {value}"
    return name.removeprefix("MOSTLY_").removeprefix("ALL_")


def dequantised_note(path: str | Path, dtype: str = "float32") -> str:
    """The line ``sdp train`` prints when it loads a GGUF file."""
    kind = quantization(path)
    if f"MOSTLY_{kind}" in _PLAIN_TYPES or f"ALL_{kind}" in _PLAIN_TYPES:
        return f"{Path(path).name}: GGUF {kind} weights read as {dtype}"
    return (
        f"{Path(path).name}: GGUF {kind} weights dequantised to {dtype}; training updates these "
        "full-precision weights, not the quantised ones"
    )


def _quiet_tqdm() -> contextlib.AbstractContextManager:
    """No tqdm bar while transformers dequantises: its bar ignores transformers' own progress-bar
    switch and writes to ``sys.stderr`` (``sdp train`` shows the load as a phase of its display)."""
    return contextlib.redirect_stderr(io.StringIO())


def load_gguf_tokenizer(path: str | Path) -> Any:
    """The tokenizer stored in a GGUF file."""
    from transformers import AutoTokenizer

    file = check_gguf_file(path)
    try:
        return AutoTokenizer.from_pretrained(str(file.parent), gguf_file=file.name)
    except (OSError, ValueError, KeyError, RuntimeError, NotImplementedError) as err:
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise UserError(f"cannot load the tokenizer of the GGUF file {file}: {type(err).__name__}: {first}") from None


def load_gguf(path: str | Path) -> tuple[Any, Any]:
    """``(model, tokenizer)`` from a GGUF file: a plain float32 transformers model (no quantizer
    attached) and the tokenizer stored in the file."""
    from transformers import AutoModelForCausalLM

    tokenizer = load_gguf_tokenizer(path)
    file = Path(path).expanduser()
    try:
        with _quiet_tqdm():
            loaded = AutoModelForCausalLM.from_pretrained(
                str(file.parent), gguf_file=file.name, dtype="float32", use_safetensors=True
            )
    except (OSError, ValueError, KeyError, RuntimeError, NotImplementedError) as err:
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise UserError(
            f"cannot load the GGUF file {file}: {type(err).__name__}: {first}; "
            "transformers reads GGUF files of the architectures it lists as GGUF-supported"
        ) from None
    config = loaded.config
    # the quantization entry would make every later load look for the GGUF file again
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    config.name_or_path = str(file)
    model = AutoModelForCausalLM.from_config(config, dtype="float32")
    model.load_state_dict(loaded.state_dict(), strict=True)
    model.tie_weights()
    return model.eval(), tokenizer
