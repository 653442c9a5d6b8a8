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
