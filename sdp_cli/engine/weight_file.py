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
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

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


class PackedWeights(Mapping[str, torch.Tensor]):
    """A copy of a state dict in one buffer, readable as a mapping and writable as safetensors.

    The copy shares nothing with the tensors it was made from, so they may change at once.
    """

    def __init__(self, state_dict: Mapping[str, torch.Tensor]):
        seen: set[tuple[int, int]] = set()
        sources: list[tuple[str, torch.Tensor]] = []
        for name, tensor in state_dict.items():
            if tensor.dtype not in DTYPE_NAMES:
                raise TypeError(f"{name}: dtype {tensor.dtype} has no safetensors name in sdp's weight writer")
            key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
            if key in seen:
                continue  # a tied tensor: written once, under its first name
            seen.add(key)
            sources.append((name, tensor.detach()))
        order = [name for name, _ in sources]  # the mapping's order: the state dict's
        # widest first, and each dtype's tensors together (one copy call each, below)
        dtypes = list(dict.fromkeys(tensor.dtype for _, tensor in sources))
        sources.sort(key=lambda item: (-item[1].element_size(), dtypes.index(item[1].dtype)))

        header: dict[str, object] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for name, tensor in sources:
            end = offset + tensor.numel() * tensor.element_size()
            header[name] = {"dtype": DTYPE_NAMES[tensor.dtype], "shape": list(tensor.shape), "data_offsets": [offset, end]}
            offset = end
        raw = json.dumps(header, separators=(",", ":")).encode()
        self._header = raw + b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
        self._data = torch.empty(offset, dtype=torch.uint8)
        # One split and one copy call per dtype: a copy per tensor cost twice the time in
        # Python on a model of 50 small tensors.
        tensors: dict[str, torch.Tensor] = {}
        begin = 0
        with torch.no_grad():
            for dtype in dict.fromkeys(tensor.dtype for _, tensor in sources):  # in file order
                group = [(name, tensor) for name, tensor in sources if tensor.dtype == dtype]
                numels = [tensor.numel() for _, tensor in group]
                end = begin + sum(numels) * group[0][1].element_size()
                parts = torch.split_with_sizes(self._data[begin:end].view(dtype), numels)
                torch._foreach_copy_(list(parts), [tensor.reshape(-1).to("cpu") for _, tensor in group])
                for (name, tensor), part in zip(group, parts, strict=True):
                    tensors[name] = part.view(tensor.shape)
                begin = end
        self._tensors = {name: tensors[name] for name in order}

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._tensors[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    def write(self, path: Path) -> Path:
        """The safetensors file ``path``, whole or not at all (written beside and renamed)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        with open(tmp, "wb", buffering=0) as f:
            _write_all(f, len(self._header).to_bytes(8, "little") + self._header)
            _write_all(f, memoryview(self._data.numpy()))
        os.replace(tmp, path)
        return path


def _write_all(f: io.FileIO, data: bytes | memoryview) -> None:
    """An unbuffered write may take part of ``data``: write until all of it is out."""
    view = memoryview(data)
    while view:
        view = view[f.write(view) :]
