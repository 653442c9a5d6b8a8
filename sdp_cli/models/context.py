"""The model's context window, read from its config without loading weights (docs/tasks.md,
"Limits on a record"): no prompt + completion longer than it reaches the warm start, training
or the engine.

The tiny model has ``TINY_CONTEXT`` positions. A Hugging Face model's context is the first of
``CONTEXT_KEYS`` its config.json sets (at the top level or in ``text_config``), a GGUF file's
its ``<architecture>.context_length``; None when the config says nothing. ``engine.max_model_len``
lowers it when set smaller. No torch or transformers import: ``sdp train`` checks this before it
writes anything.
"""

from __future__ import annotations

import json
from typing import Any

from sdp_cli.config.schema import SdpConfig
from sdp_cli.models.gguf import gguf_metadata, is_gguf

#: positions of the built-in tiny model (its ``max_position_embeddings``)
TINY_CONTEXT = 1024
#: config.json keys that give a model's context length, in the order they are tried
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx", "max_seq_len")


def config_context(config: dict[str, Any]) -> int | None:
    """The context length a Hugging Face config.json states, or None."""
    for section in (config, config.get("text_config")):
        if not isinstance(section, dict):
            continue
        for key in CONTEXT_KEYS:
            value = section.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def _gguf_context(path: str) -> int | None:
    arch = gguf_metadata(path, ["general.architecture"]).get("general.architecture")
    if not isinstance(arch, str):
        return None
    key = f"{arch}.context_length"
    context = gguf_metadata(path, [key]).get(key)
    return context if isinstance(context, int) and not isinstance(context, bool) and context > 0 else None


def model_context(cfg: SdpConfig) -> int | None:
    """The longest sequence (prompt + completion) the run's model and engine take, or None when
    the model's config does not say."""
    if cfg.model.kind == "tiny":
        context: int | None = TINY_CONTEXT
    elif is_gguf(cfg.model.path):
        context = _gguf_context(cfg.model.path or "")
    else:
        from sdp_cli.models.model_dir import resolve_model_dir

        try:
            config = json.loads((resolve_model_dir(cfg.model.path or "") / "config.json").read_text())
        except (OSError, ValueError):
            config = None  # the model check names a missing or broken config.json
        context = config_context(config) if isinstance(config, dict) else None
    limit = cfg.engine.max_model_len
    if limit is not None:
        context = limit if context is None else min(context, limit)
    return context
