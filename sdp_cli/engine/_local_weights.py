"""New weights for the local engine's model: read a safetensors directory, copy a state dict in.

The whole state dict is checked against the model before a single tensor is copied, so a bad
update leaves the engine at its old weights. Copying parameter by parameter (instead of
``load_state_dict``) keeps tied parameters tied: a checkpoint written by ``save_pretrained``
stores a tied pair (e.g. ``lm_head.weight`` / ``model.embed_tokens.weight``) under one name only.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from sdp_cli.engine.base import EngineError
from sdp_cli.safetensors_layout import LayoutError, check_file

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

_LAYOUT_HINT = f"expected a directory written by save_pretrained ({SINGLE_FILE} or {INDEX_FILE})"


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


def read_safetensors_dir(path: Path | str) -> dict[str, torch.Tensor]:
    """All tensors of a Hugging Face safetensors checkpoint directory (single file or sharded)."""
    path = Path(path)
    if not path.is_dir():
        raise EngineError(f"{path}: weight directory not found; {_LAYOUT_HINT}")
    if (path / SINGLE_FILE).is_file():
        return _read_file(path / SINGLE_FILE)
    index_path = path / INDEX_FILE
    if not index_path.is_file():
        raise EngineError(
            f"{path}: no {SINGLE_FILE} or {INDEX_FILE} in the directory; {_LAYOUT_HINT}"
        )
    try:
        weight_map = json.loads(index_path.read_text())["weight_map"]
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError("weight_map is empty or not an object")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise EngineError(
            f"{index_path}: unreadable shard index ({_one_line(exc)}); {_LAYOUT_HINT}"
        ) from exc
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(set(weight_map.values())):
        part = _read_file(path / shard)
        expected = {name for name, file in weight_map.items() if file == shard}
        absent = sorted(expected - part.keys())
        if absent:
            raise EngineError(
                f"{path / shard}: lacks {len(absent)} tensor(s) named by the index "
                f"(e.g. {absent[0]}); "
                "re-save the checkpoint"
            )
        tensors.update(part)
    return tensors


def _read_file(file: Path) -> dict[str, torch.Tensor]:
    if not file.is_file():
        raise EngineError(f"{file}: shard file not found; {_LAYOUT_HINT}")
    try:
        check_file(file)  # names a truncated file as such, before the library reads it
    except (LayoutError, OSError) as exc:
        raise EngineError(f"{file}: {exc}; re-save the checkpoint") from None
    try:
        return load_file(file)
    except (OSError, SafetensorError, ValueError) as exc:
        raise EngineError(
            f"{file}: not a readable safetensors file ({_one_line(exc)}); re-save the checkpoint"
        ) from exc


def copy_weights(
    model: torch.nn.Module, state_dict: Mapping[str, torch.Tensor], source: str
) -> None:
    """Copy ``state_dict`` into ``model`` in place, strictly: every tensor of the model (one name
    per tied group suffices), no unknown names, same shapes. ``source`` names it in errors."""
    own = model.state_dict(keep_vars=True)
    groups: dict[int, list[str]] = {}
    for name, tensor in own.items():
        groups.setdefault(id(tensor), []).append(name)

    missing = [names[0] for names in groups.values() if not any(n in state_dict for n in names)]
    unexpected = [name for name in state_dict if name not in own]
    mismatched = [
        f"{name} {tuple(state_dict[name].shape)} vs {tuple(own[name].shape)}"
        for name in state_dict
        if name in own and state_dict[name].shape != own[name].shape
    ]
    problems = []
    if missing:
        problems.append(f"{len(missing)} missing (e.g. {missing[0]})")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected (e.g. {unexpected[0]})")
    if mismatched:
        problems.append(f"{len(mismatched)} of the wrong shape (e.g. {mismatched[0]})")
    for names in groups.values():
        given = [n for n in names if n in state_dict]
        if len(given) > 1 and not all(
            torch.equal(state_dict[given[0]], state_dict[n]) for n in given[1:]
        ):
            problems.append(f"tied tensors {' and '.join(given)} differ")
    if problems:
        raise EngineError(
            f"{source}: weights do not fit the model: {'; '.join(problems)}; "
            "save them from a model of the same architecture"
        )

    with torch.no_grad():
        for names in groups.values():
            source_name = next(n for n in names if n in state_dict)
            own[names[0]].copy_(state_dict[source_name])
