"""A weight push's tensors packed into one buffer, then written as a safetensors file.

Every step of a run on the local engine's process pushes the trainer's weights through a file
on tmpfs (``engine/process.py``). At η > 0 the trainer's thread only *packs* them into a private
byte buffer laid out as a safetensors file's data: one torch copy call per dtype, which releases
the GIL while it copies. The push's own thread then writes the header and that buffer in two
calls, which release the GIL too, while the next step trains. safetensors' ``save_file`` did
both in the trainer's thread and held the GIL for most of it (a byte copy of every tensor in
Python, then its writer). On the tiny model, timed apart: ``save_file`` 2.1 ms, packing 0.7–1.0 ms,
writing 0.9 ms; in the trainer's thread of an η = 4 run, staging took 3.0–3.5 ms before and
1.3–1.4 ms after (docs/benchmarks.md).

The file is what ``save_file`` writes, read by the same reader (``_local_weights``): tensors
sharing storage (tied embeddings) once, under the first name, and the data ordered by element
size, widest first, so that every tensor's bytes start at a multiple of its element size.

Floating tensors are packed in the engine's dtype when one is given: the engine would round them
to it on load anyway (the same round-to-nearest cast, so its weights are bit for bit the same),
and a bfloat16 engine then gets half the bytes to copy, write and read. The cast runs on the
trainer's device, before the copy into host memory. On a GPU (the H200 of the GPU check,
docs/engines.md) packing 494 M float32 weights was most of a step.

A pack's buffer can be handed on (``release``) to the next pack (``spare=``): ``ProcessEngine``
keeps the buffer of the push its process loaded last, so that a push does not fault a fresh
buffer's pages in again (SmolLM2-135M in float32: 234 ms fresh, 91 ms reused; bench/weight_push.py).

``WeightSlots`` skips the second copy: the trainer's process of a run with a rollout process
(docs/training.md "Three processes") packs each push straight into one of three safetensors files
on tmpfs that stay mapped, so the pack is the file (tiny model: 0.4 ms, against 1.8 ms to pack
and then write).
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from sdp_cli.fileio import write_all

#: safetensors' name of each dtype a policy's weights come in
DTYPE_NAMES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


@dataclass
class _Layout:
    """Where each tensor of a state dict goes in a safetensors file (``_layout``)."""

    #: (name, tensor, dtype in the file), in the file's order
    sources: list[tuple[str, torch.Tensor, torch.dtype]]
    #: the names in the state dict's order (tied tensors once)
    order: list[str]
    #: the JSON header, padded so that the data starts 8-byte aligned
    header: bytes
    #: bytes of data after the header
    nbytes: int


def _layout(state_dict: Mapping[str, torch.Tensor], dtype: torch.dtype | None) -> _Layout:
    """The file's layout: tensors sharing storage (tied embeddings) once, under the first name;
    floating tensors in ``dtype`` (None: their own); widest first, each dtype's tensors together."""
    seen: set[tuple[int, int]] = set()
    sources: list[tuple[str, torch.Tensor, torch.dtype]] = []  # name, tensor, dtype in the file
    for name, tensor in state_dict.items():
        if tensor.dtype not in DTYPE_NAMES:
            raise TypeError(f"{name}: dtype {tensor.dtype} has no safetensors name in sdp's weight writer")
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
        if key in seen:
            continue  # a tied tensor: written once, under its first name
        seen.add(key)
        target = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
        sources.append((name, _source(tensor, target), target))
    order = [name for name, _, _ in sources]  # the mapping's order: the state dict's
    # widest first, and each dtype's tensors together (one copy call each, in ``_pack``)
    dtypes = list(dict.fromkeys(target for _, _, target in sources))
    sources.sort(key=lambda item: (-item[2].itemsize, dtypes.index(item[2])))

    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, tensor, target in sources:
        end = offset + tensor.numel() * target.itemsize
        header[name] = {"dtype": DTYPE_NAMES[target], "shape": list(tensor.shape), "data_offsets": [offset, end]}
        offset = end
    raw = json.dumps(header, separators=(",", ":")).encode()
    return _Layout(sources, order, raw + b" " * (-len(raw) % 8), offset)


def _source(tensor: torch.Tensor, target: torch.dtype) -> torch.Tensor:
    """What ``_pack`` copies from: ``tensor`` detached, or on a device cast there to ``target``
    (fewer bytes to bring over)."""
    tensor = tensor.detach()
    return tensor.to(target) if tensor.device.type != "cpu" else tensor


def _shape_key(state_dict: Mapping[str, torch.Tensor], dtype: torch.dtype | None) -> tuple[Any, ...]:
    """What a layout's header depends on: the engine's dtype, the names in order, each tensor's
    dtype and shape, and which names share memory (each name with the position of the first
    name at the same storage and offset: no addresses, which a later push's tensors may reuse)."""
    first: dict[tuple[int, int], int] = {}
    entries = []
    for position, (name, tensor) in enumerate(state_dict.items()):
        where = (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
        entries.append((name, tensor.dtype, tensor.shape, first.setdefault(where, position)))
    return (dtype, entries)


def _pack(layout: _Layout, data: torch.Tensor) -> dict[str, torch.Tensor]:
    """Copy the layout's tensors into ``data`` (uint8, ``layout.nbytes`` long); each one's view
    of it, by name, in the state dict's order. One split and one copy call per dtype: a copy per
    tensor cost twice the time in Python on a model of 50 small tensors."""
    tensors: dict[str, torch.Tensor] = {}
    begin = 0
    with torch.no_grad():
        for file_dtype in dict.fromkeys(target for _, _, target in layout.sources):  # in file order
            group = [(name, tensor) for name, tensor, target in layout.sources if target == file_dtype]
            numels = [tensor.numel() for _, tensor in group]
            end = begin + sum(numels) * file_dtype.itemsize
            parts = torch.split_with_sizes(data[begin:end].view(file_dtype), numels)
            flat = [tensor.reshape(-1) for _, tensor in group]
            if all(tensor.device.type == "cpu" for tensor in flat):
                torch._foreach_copy_(list(parts), flat)  # casts where the dtypes differ
            else:  # straight from the device into the buffer, no host copy in between
                for part, tensor in zip(parts, flat, strict=True):
                    part.copy_(tensor)
            for (name, tensor), part in zip(group, parts, strict=True):
                tensors[name] = part.view(tensor.shape)
            begin = end
    return {name: tensors[name] for name in layout.order}


class PackedWeights(Mapping[str, torch.Tensor]):
    """A copy of a state dict in one buffer, readable as a mapping and writable as safetensors.

    The copy shares nothing with the tensors it was made from, so they may change at once.
    """

    def __init__(
        self, state_dict: Mapping[str, torch.Tensor], dtype: torch.dtype | None = None, *, spare: torch.Tensor | None = None
    ):
        """``dtype``: the engine's weight dtype, which floating tensors are cast to (None: each
        tensor's own). ``spare``: a released pack's buffer (``release``), used when it is large
        enough: the same model's next push then writes into memory already mapped."""
        layout = _layout(state_dict, dtype)
        self._header = layout.header
        fits = spare is not None and spare.dtype == torch.uint8 and spare.numel() >= layout.nbytes
        self._buffer: torch.Tensor | None = spare if fits else torch.empty(layout.nbytes, dtype=torch.uint8)
        self._data = self._buffer[: layout.nbytes]
        self._tensors = _pack(layout, self._data)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._tensors[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    def release(self) -> torch.Tensor:
        """This pack's buffer, for the next one to reuse; the pack is empty from now on (its
        tensors were views of the buffer) and cannot be written."""
        if self._buffer is None:
            raise RuntimeError("this weight pack was released already")
        buffer, self._buffer = self._buffer, None
        self._tensors, self._data = {}, buffer[:0]
        return buffer

    def write(self, path: Path) -> Path:
        """The safetensors file ``path``, whole or not at all (written beside and renamed)."""
        if self._buffer is None:
            raise RuntimeError("a released weight pack cannot be written")
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        with open(tmp, "wb", buffering=0) as f:
            write_all(f.fileno(), len(self._header).to_bytes(8, "little") + self._header)
            write_all(f.fileno(), memoryview(self._data.numpy()))
        os.replace(tmp, path)
        return path


def bytes_kept(state_dict: Mapping[str, torch.Tensor], push_dtype: torch.dtype | None) -> int:
    """Bytes of weight files a run on the local engine's process keeps in its scratch directory
    at most: the start's (the weights as they are, tied tensors once) and one push in each of
    ``WeightSlots.SLOTS`` (floating tensors in ``push_dtype``). A process's own pushes
    (``PackedWeights``) keep fewer."""
    unique = {tensor.untyped_storage().data_ptr(): tensor for tensor in state_dict.values()}
    start = pushed = 0
    for tensor in unique.values():
        start += tensor.numel() * tensor.element_size()
        cast = push_dtype is not None and tensor.is_floating_point()
        pushed += tensor.numel() * (push_dtype.itemsize if cast else tensor.element_size())
    return start + WeightSlots.SLOTS * pushed


class WeightSlots:
    """Safetensors files that pushes are packed straight into, one slot per push in turn
    (``version % SLOTS``), each file kept mapped: a push writes the trainer's weights once, into
    pages mapped already, instead of packing them and then writing the pack (tiny model: 0.4 ms
    against 1.8; bench/weight_push.py).

    Three slots, because pushes are loaded one at a time and in order: when the weights of
    version v + 1 are written, the push of v may still be loading its slot and the engine may
    still run v − 1 (a restarted engine process reads that one's slot again), but the push of
    v − 1 is done, so the third slot, which held v − 2, is no one's.
    """

    SLOTS = 3

    def __init__(self, directory: Path, file_name: str):
        self.directory = directory
        self.file_name = file_name
        self._maps: dict[int, mmap.mmap] = {}
        # the last push's layout without its tensors: (``_shape_key``, header, order, bytes of
        # data, (name, dtype in the file) in the file's order)
        self._kept_layout: tuple[Any, bytes, list[str], int, list[tuple[str, torch.dtype]]] | None = None

    def write(self, version: int, state_dict: Mapping[str, torch.Tensor], dtype: torch.dtype | None) -> Path:
        """The weights of ``version`` written into its slot; the slot's directory."""
        layout = self._layout_of(state_dict, dtype)
        head = len(layout.header).to_bytes(8, "little") + layout.header
        slot = version % self.SLOTS
        target = self.directory / f"push{slot}"
        mapping = self._mapping(slot, target / self.file_name, len(head) + layout.nbytes)
        mapping[: len(head)] = head
        if layout.nbytes:  # (torch cannot view zero bytes of a buffer: nothing to copy then)
            data = torch.frombuffer(mapping, dtype=torch.uint8, offset=len(head), count=layout.nbytes)
            _pack(layout, data)
            del data  # no view of the mapping outlives the write (it could not be closed)
        return target

    def _layout_of(self, state_dict: Mapping[str, torch.Tensor], dtype: torch.dtype | None) -> _Layout:
        """``_layout(state_dict, dtype)``, with the last push's header, order and sizes when
        nothing they depend on changed (``_shape_key``): a run pushes the same parameters every
        step (merged LoRA weights as new tensors of the same shapes), and making the header cost
        the trainer 0.1–0.3 ms a push. The tensors are always this push's: none is kept."""
        key = _shape_key(state_dict, dtype)
        kept = self._kept_layout
        if kept is not None and kept[0] == key:
            _, header, order, nbytes, plan = kept
            sources = [(name, _source(state_dict[name], target), target) for name, target in plan]
            return _Layout(sources, order, header, nbytes)
        layout = _layout(state_dict, dtype)
        plan = [(name, target) for name, _, target in layout.sources]
        self._kept_layout = (key, layout.header, layout.order, layout.nbytes, plan)
        return layout

    def _mapping(self, slot: int, path: Path, size: int) -> mmap.mmap:
        """The slot's file mapped, ``size`` bytes long (made again when the size changed)."""
        mapping = self._maps.get(slot)
        if mapping is not None and len(mapping) == size:
            return mapping
        if mapping is not None:
            mapping.close()
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.ftruncate(fd, size)
            # the file's room is taken now: a write through the mapping into pages its file
            # system cannot give (a full tmpfs) is a SIGBUS that kills the process, where this
            # is an OSError (ENOSPC) the run stops on
            os.posix_fallocate(fd, 0, size)
            self._maps[slot] = mmap.mmap(fd, size)
        except BaseException:
            with contextlib.suppress(OSError):  # no slot is left that a later push maps without its room
                os.unlink(path)
            raise
        finally:
            os.close(fd)
        return self._maps[slot]

    def close(self) -> None:
        """Unmap the files (they stay, with the last weights each slot was given)."""
        for mapping in self._maps.values():
            mapping.close()
        self._maps = {}
        self._kept_layout = None
