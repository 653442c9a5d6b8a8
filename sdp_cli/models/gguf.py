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
import math
import mmap
import struct
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any

from sdp_cli.errors import UserError

#: GGUF file types whose weights are stored unquantised (no dequantisation happens)
_PLAIN_TYPES = ("ALL_F32", "MOSTLY_F16", "MOSTLY_BF16")


def is_gguf(path: str | Path | None) -> bool:
    """Whether ``model.path`` names a GGUF file (by its suffix)."""
    return path is not None and str(path).lower().endswith(".gguf")


def check_gguf_file(path: str | Path, *, label: str | None = None) -> Path:
    """The GGUF file, checked: it exists, starts with the GGUF magic, the ``gguf`` package is
    installed, and its header and tensors' table read to the end, with the file long enough for
    every tensor's data (a download or copy cut short); one-line UserError otherwise, naming the
    file as ``label`` (default ``model.path=PATH``, the config key that gave it)."""
    file = Path(path).expanduser()
    label = label or f"model.path={path}"
    if not file.is_file():
        raise UserError(f"{label} is not a file; pass an existing .gguf file")
    with open(file, "rb") as handle:
        magic = handle.read(4)
    if magic != b"GGUF":
        raise UserError(f"{label} is not a GGUF file (it does not start with 'GGUF'); check the file")
    if importlib.util.find_spec("gguf") is None:
        raise UserError(
            f"{label} is a GGUF file, which needs the gguf package; pip install 'sdp-cli[gguf]'"
        )
    try:
        with _GGUFHeader(file) as header:
            needed, size = header.data_end(), len(header.data)
    except _CutShort as err:
        raise UserError(f"{label} is cut short ({err}); copy or download the file again") from None
    except (OSError, ValueError, UnicodeDecodeError) as err:
        raise UserError(f"{label} is not a GGUF file sdp can read ({err}); check the file") from None
    if needed > size:
        raise UserError(
            f"{label} is cut short (its tensors' data end at byte {needed}, the file has {size}); "
            "copy or download the file again"
        )
    return file


#: GGUF metadata value types (the format's numbering) with their struct codes; 8 string, 9 array
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
#: where a tensor's data starts is a multiple of this, unless ``general.alignment`` says otherwise
_DEFAULT_ALIGNMENT = 32
#: the most dimensions a tensor has (ggml's limit)
_MAX_DIMS = 4


class _CutShort(ValueError):
    """The file ends before what its header says comes next."""


class _GGUFHeader:
    """A GGUF file's header, read in place (memory-mapped) with the format's own layout, and
    only as far as asked: ``metadata`` walks its key-value pairs, ``data_end`` its tensors'
    table too. ``gguf.GGUFReader`` maps every field and tensor before it answers anything:
    seconds for a model's token lists."""

    def __init__(self, file: Path):
        self._handle = open(file, "rb")  # noqa: SIM115 - closed by __exit__
        try:
            self.data = mmap.mmap(self._handle.fileno(), 0, access=mmap.ACCESS_READ)
        except BaseException:
            self._handle.close()
            raise

    def __enter__(self) -> _GGUFHeader:
        try:
            if self.data[:4] != b"GGUF":
                raise ValueError("it does not start with 'GGUF'")
            # a big-endian file's version reads as a multiple of 2**16 in little-endian order
            self._order = "<" if self._unpack("<I", 4)[0] < 1 << 16 else ">"
            version = self._unpack(self._order + "I", 4)[0]
            if version < 2:
                raise ValueError(f"GGUF version {version} is not read (2 and later are)")
            self.tensor_count, self.kv_count = self._unpack(self._order + "QQ", 8)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.data.close()
        self._handle.close()

    def _unpack(self, code: str, offset: int) -> tuple[Any, ...]:
        if offset + struct.calcsize(code) > len(self.data):
            raise _CutShort(f"its header ends past the file's {len(self.data)} bytes")
        return struct.unpack_from(code, self.data, offset)

    def metadata(self) -> Iterator[tuple[str, int, Any]]:
        """Each key-value pair as ``(key, value type, value)``, in the file's order (an
        array's value: None, skipped without decoding its items); the offset after the last
        one read is ``self.offset``."""
        self.offset = 24
        for _ in range(self.kv_count):
            key, offset = self._string(self.offset)
            kind = self._unpack(self._order + "I", offset)[0]
            value, self.offset = self._value(offset + 4, kind)
            yield key, kind, value

    def data_end(self) -> int:
        """Where the last tensor's data ends, by the header (the file must be at least this
        long); tensors of a type this gguf package does not know are not counted."""
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        alignment = _DEFAULT_ALIGNMENT
        for key, _, value in self.metadata():
            if key == "general.alignment" and isinstance(value, int) and value > 0:
                alignment = value
        offset, ends = self.offset, [0]
        for _ in range(self.tensor_count):
            _, offset = self._string(offset)
            dims = self._unpack(self._order + "I", offset)[0]
            if dims > _MAX_DIMS:
                raise ValueError(f"a tensor of its table has {dims} dimensions")
            shape = self._unpack(self._order + "Q" * dims, offset + 4)
            kind, start = self._unpack(self._order + "IQ", offset + 4 + 8 * dims)
            offset += 4 + 8 * dims + 12
            with contextlib.suppress(ValueError, KeyError):  # a type this gguf package does not know
                block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
                ends.append(start + math.prod(shape) // block * block_bytes)
        data_start = -(-offset // alignment) * alignment
        return data_start + max(ends)

    def _string(self, offset: int) -> tuple[str, int]:
        size = self._unpack(self._order + "Q", offset)[0]
        end = offset + 8 + size
        if end > len(self.data):
            raise _CutShort(f"a string of its header ends past the file's {len(self.data)} bytes")
        return self.data[offset + 8 : end].decode("utf-8"), end

    def _value(self, offset: int, kind: int) -> tuple[Any, int]:
        """The value of type ``kind`` at ``offset`` and the offset after it (an array: None,
        skipped without decoding its items, which for a token list are most of the header)."""
        if kind in _SCALARS:
            code = self._order + _SCALARS[kind]
            return self._unpack(code, offset)[0], offset + struct.calcsize(code)
        if kind == _STRING:
            return self._string(offset)
        if kind == _ARRAY:
            item_kind, items = self._unpack(self._order + "IQ", offset)
            offset += 12
            if item_kind in _SCALARS:
                end = offset + items * struct.calcsize(self._order + _SCALARS[item_kind])
            else:
                for _ in range(items):
                    if item_kind == _STRING:  # the length alone: no string is decoded
                        offset += 8 + self._unpack(self._order + "Q", offset)[0]
                    else:
                        _, offset = self._value(offset, item_kind)
                end = offset
            if end > len(self.data):
                raise _CutShort(f"an array of its header ends past the file's {len(self.data)} bytes")
            return None, end
        raise ValueError(f"its header holds a value of unknown type {kind}")


def gguf_metadata(path: str | Path, keys: Collection[str]) -> dict[str, Any]:
    """The values of the metadata ``keys`` a GGUF file holds (numbers, booleans and strings;
    an array's key is left out), read from its header alone and only as far as the last of
    them. One-line UserError for a file whose header is cut short or malformed."""
    file = Path(path).expanduser()
    wanted = set(keys)
    found: dict[str, Any] = {}
    try:
        with _GGUFHeader(file) as header:
            for key, kind, value in header.metadata() if wanted else ():
                if key in wanted and kind != _ARRAY:
                    found[key] = value
                if not wanted - found.keys():
                    break
    except (OSError, ValueError, UnicodeDecodeError) as err:
        raise UserError(f"cannot read the GGUF file {file}'s metadata: {err}; check the file") from None
    return found


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


def load_gguf(path: str | Path, *, tokenizer: Any = None) -> tuple[Any, Any]:
    """``(model, tokenizer)`` from a GGUF file: a plain float32 transformers model (no quantizer
    attached) and the tokenizer stored in the file (``tokenizer``: that tokenizer, already
    loaded with ``load_gguf_tokenizer``)."""
    from transformers import AutoModelForCausalLM

    if tokenizer is None:
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
