"""Which padding layouts keep a causal LM's attention exact, read from its config
(docs/training.md, "The trainer's policy and loss").

transformers builds attention masks from cache indices, not from position ids. Full causal
attention asks only that a key's index is not after the query's, so padding anywhere in a row
(masked out) leaves what a token attends to unchanged. A sliding window asks that
query index − key index < window: that is the distance in positions only while a row's tokens
sit at consecutive cache indices, which padding before them (left padding) keeps and padding
between them breaks. Everything else a config can declare — chunked attention, linear or
recurrent layers, local attention under another name, layer kinds this module does not know —
is ``OTHER``: no layout but the plain one (each row's whole sequence in one forward) is trusted.
"""

from __future__ import annotations

import re
from enum import Enum
from typing import Any

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"


class AttentionLayout(Enum):
    """The layouts under which a model's forward is exact."""

    #: full attention only: padding may sit anywhere, even between a row's tokens
    ANY = "any"
    #: full and sliding-window attention: padding may sit before a row's tokens (and after them)
    CONTIGUOUS = "contiguous"
    #: something else: only each row's whole sequence, as a plain (left- or right-padded) forward
    PLAIN = "plain"


#: config fields that declare a local, chunked or recurrent pattern this module does not model
#: (GPT-Neo's attention_layers, Llama-4's attention_chunk_size, Mamba and hybrid layers, …)
_OTHER_FIELD = re.compile(
    r"window|chunk|local_att|attention_(layers|types)|attn_layer|block_type|mamba|ssm|state_size|conv_kernel|conv_L|recurren"
)
#: model types of recurrent or hybrid models
_RECURRENT_TYPE = re.compile(r"rwkv|mamba|xlstm|recurrent|hybrid")
#: fields that match the pattern but are read here or say nothing about attention
_KNOWN_FIELDS = frozenset(
    {
        "sliding_window",  # read below
        "use_sliding_window",  # Qwen2/3: already folded into sliding_window and layer_types
        "max_window_layers",  # Qwen2/3: likewise
        "sliding_window_pattern",  # Gemma-3, EXAONE-4: already folded into layer_types
        "_sliding_window_pattern",
        "chunk_size_feed_forward",  # every config: the feed-forward's chunking, not attention's
    }
)


def attention_kinds(config: Any) -> frozenset[str]:
    """The attention kinds ``config`` declares: its ``layer_types``, ``sliding_attention`` where
    it sets a sliding window (Mistral and Phi-3 do without ``layer_types``), and the name of
    every other field that declares a pattern (``_OTHER_FIELD``) and is set."""
    text = config
    if callable(getattr(config, "get_text_config", None)):
        try:
            text = config.get_text_config(decoder=True)
        except ValueError:  # several text configs (e.g. an encoder and a decoder): none is read
            return frozenset({"several text configs"})
    fields = text.to_dict() if callable(getattr(text, "to_dict", None)) else dict(vars(text))
    kinds = set(fields.get("layer_types") or [FULL_ATTENTION])
    model_type = str(fields.get("model_type", ""))
    if _RECURRENT_TYPE.search(model_type):  # recurrent models whose fields name no pattern (RWKV)
        kinds.add(model_type)
    if fields.get("sliding_window"):
        kinds.add(SLIDING_ATTENTION)
    kinds.update(
        name
        for name, value in fields.items()
        if _OTHER_FIELD.search(name) and name not in _KNOWN_FIELDS and value not in (None, False, 0, [], ())
    )
    return frozenset(kinds)


def attention_layout(config: Any) -> AttentionLayout:
    """The layouts under which a model with ``config`` computes exactly what its plain forward
    does (module docstring); a model without a config is ``PLAIN``."""
    if config is None:
        return AttentionLayout.PLAIN
    kinds = attention_kinds(config)
    if kinds == {FULL_ATTENTION}:
        return AttentionLayout.ANY
    if kinds <= {FULL_ATTENTION, SLIDING_ATTENTION}:
        return AttentionLayout.CONTIGUOUS
    return AttentionLayout.PLAIN


def unvouched_kinds(config: Any) -> list[str]:
    """The kinds of ``config`` that keep it ``PLAIN`` (for a one-line message), sorted."""
    if config is None:
        return ["no config"]
    return sorted(attention_kinds(config) - {FULL_ATTENTION, SLIDING_ATTENTION})
