"""A model cast to a compute dtype the way a checkpoint loader casts it (docs/training.md,
"Precision and memory").

``module.to(dtype)`` casts every floating tensor, the computed non-persistent buffers included:
a rotary embedding's ``inv_freq`` then loses its low bits, and with it the angle of every
position (in bfloat16 the angle at position 100 is off by up to ~0.2 rad). ``from_pretrained(dtype=…)``
and inference servers keep those buffers in float32. ``cast_weights`` does the same, so a model
cast here computes the numbers of the same weights saved in ``dtype`` and loaded again.
"""

from __future__ import annotations

import torch

#: train.dtype and engine.dtype names (float16: launched servers only)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def cast_weights(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """``model`` (in place, and returned) with its parameters and persistent buffers in ``dtype``;
    non-persistent buffers (computed at construction, never saved) keep their dtype."""
    persistent = set(model.state_dict(keep_vars=True))
    computed = [
        (name, buffer) for name, buffer in model.named_buffers(remove_duplicate=False) if name not in persistent
    ]
    model.to(dtype)
    for name, buffer in computed:
        owner, _, attr = name.rpartition(".")
        model.get_submodule(owner).register_buffer(attr, buffer, persistent=False)
    return model
