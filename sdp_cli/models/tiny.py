"""A small Qwen2 causal LM built from a config, for CPU runs and tests.

The defaults are the size a CPU probe found to learn single-digit addition by RL within minutes
(about 1.06M parameters with the arith vocabulary): hidden 128, 4 layers, 4 query and 4 KV heads
(head size 32, which vLLM's CPU attention accepts: docs/engines.md "vLLM"), SwiGLU width 512,
tied embeddings, SDPA attention, float32. The vocabulary is the tokenizer's size rounded up to a multiple of 32; the extra ids have
no text.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from sdp_cli.errors import UserError
from sdp_cli.models.context import TINY_CONTEXT

VOCAB_MULTIPLE = 32


def padded_vocab_size(tokenizer_size: int) -> int:
    """``tokenizer_size`` rounded up to a multiple of ``VOCAB_MULTIPLE``."""
    return -(-tokenizer_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


def tiny_arch(
    *,
    hidden_size: int = 128,
    num_layers: int = 4,
    num_heads: int = 4,
    num_kv_heads: int = 4,
    intermediate_size: int = 512,
    max_positions: int = TINY_CONTEXT,
) -> dict[str, Any]:
    """Validated architecture parameters (also part of the warm-start cache key)."""
    arch = {
        "hidden_size": hidden_size,
        "num_layers": num_layers,
        "num_heads": num_heads,
        "num_kv_heads": num_kv_heads,
        "intermediate_size": intermediate_size,
        "max_positions": max_positions,
    }
    for key, value in arch.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise UserError(f"tiny model {key} must be a positive integer, got {value!r}")
    if hidden_size % num_heads or (hidden_size // num_heads) % 2:
        raise UserError(
            f"tiny model hidden_size {hidden_size} must split into {num_heads} heads of even size; "
            "choose hidden_size = num_heads * 32 (or 64) for vLLM compatibility"
        )
    if num_heads % num_kv_heads:
        raise UserError(f"tiny model num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads}")
    return arch


def tiny_config(
    tokenizer_size: int, arch: dict[str, Any], *, pad_id: int = 0, bos_id: int = 1, eos_id: int = 2
) -> Qwen2Config:
    """The ``Qwen2Config`` for ``arch`` (from ``tiny_arch``) and a tokenizer of ``tokenizer_size``."""
    return Qwen2Config(
        vocab_size=padded_vocab_size(tokenizer_size),
        hidden_size=arch["hidden_size"],
        num_hidden_layers=arch["num_layers"],
        num_attention_heads=arch["num_heads"],
        num_key_value_heads=arch["num_kv_heads"],
        intermediate_size=arch["intermediate_size"],
        max_position_embeddings=arch["max_positions"],
        tie_word_embeddings=True,
        attn_implementation="sdpa",
        pad_token_id=pad_id,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        dtype="float32",
    )


def build_tiny_model(tokenizer_size: int, *, seed: int = 0, **arch_kwargs: int) -> Qwen2ForCausalLM:
    """A freshly initialised tiny Qwen2 in eval mode; the same seed gives the same weights.

    ``arch_kwargs`` are ``tiny_arch``'s keyword arguments. The global torch RNG is left untouched.
    """
    config = tiny_config(tokenizer_size, tiny_arch(**arch_kwargs))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    return model.to(torch.float32).eval()
