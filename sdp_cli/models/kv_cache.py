"""The KV cache's name in transformers' model calls, which changed within 5.x: up to 5.23 a
forward takes and returns ``past_key_values``; from 5.24 it is ``cache`` (the old keyword still
works there, with a FutureWarning on every call, and is to be removed). sdp supports both, so
every incremental forward passes and reads the cache through these two helpers.
"""

from __future__ import annotations

from typing import Any

from transformers.modeling_outputs import CausalLMOutputWithPast

#: the keyword of a forward's KV cache, and the field of its output that returns it
CACHE_NAME = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


def with_cache(cache: Any) -> dict[str, Any]:
    """The keyword argument that hands ``cache`` (None: start a new one) to a model's forward."""
    return {CACHE_NAME: cache}


def returned_cache(output: Any) -> Any:
    """The KV cache a forward returned (``use_cache=True``)."""
    return getattr(output, CACHE_NAME)


def lay_rows_end_to_end(cache: Any) -> bool:
    """Turn the rows of ``cache`` [B, heads, L, dim] into one row [1, heads, B·L, dim], row after
    row, in place (``models/packed.py``). False, and ``cache`` untouched, where it holds any layer
    but transformers' plain dynamic one (sliding, quantised, static layers keep other state)."""
    from transformers.cache_utils import DynamicLayer

    layers = getattr(cache, "layers", None)
    if not layers or any(type(layer) is not DynamicLayer or layer.keys is None for layer in layers):
        return False
    for layer in layers:
        for name in ("keys", "values"):
            rows = getattr(layer, name)
            setattr(layer, name, rows.transpose(0, 1).reshape(1, rows.shape[1], -1, rows.shape[3]))
    return True
