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


def quantization(path: str | Path) -> str:
    """The file's weight type as llama.cpp names it (``Q4_1``, ``F32``, ...); ``unknown`` when
    the file does not say."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    field = reader.fields.get("general.file_type")
    if field is None:
        return "unknown"
    value = int(field.parts[field.data[0]][0])
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
