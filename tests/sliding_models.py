"""Tiny causal LMs with sliding-window attention for the shared-prompt tests of the trainer and
the local engine (docs/training.md, "The trainer's policy and loss").

transformers builds a sliding window's mask from cache indices: a query at cache index q sees
keys at k > q − window. A window of 4 tokens is far shorter than the test sequences, so any
layout that puts padding between a row's tokens shifts which keys a query sees, and shows in the
log-probs. ``qwen2`` has every layer sliding (``layer_types``), ``qwen2_mixed`` one full and one
sliding layer (as Gemma-2/3 alternate), ``mistral`` slides in every layer without ``layer_types``
(Mistral-v0.1's ``sliding_window``).
"""

from __future__ import annotations

import torch
from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

KINDS = ("qwen2", "qwen2_mixed", "mistral")


def sliding_model(kind: str, *, vocab: int = 32, window: int = 4, seed: int = 0) -> torch.nn.Module:
    """A 2-layer model of ``kind`` (one of ``KINDS``) with a sliding window of ``window`` tokens,
    in eval mode; initializer_range 0.1 makes the next-token distributions clearly non-uniform."""
    assert kind in KINDS, f"unknown kind {kind}"
    torch.manual_seed(seed)
    common = dict(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=128,
        initializer_range=0.1,
        tie_word_embeddings=True,
        attn_implementation="sdpa",
        sliding_window=window,
    )
    if kind == "mistral":
        return MistralForCausalLM(MistralConfig(**common)).eval()
    layer_types = ["sliding_attention"] * 2 if kind == "qwen2" else ["full_attention", "sliding_attention"]
    config = Qwen2Config(**common, use_sliding_window=True, layer_types=layer_types)
    assert config.sliding_window == window and config.layer_types == layer_types
    return Qwen2ForCausalLM(config).eval()
