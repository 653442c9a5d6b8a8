"""Continuations of shared prefixes laid end to end in one row, under a block mask
(docs/training.md "The trainer's policy and loss").

A GRPO batch continues a few distinct prefixes (prompts) with many continuations of unequal
length. Run padded, every continuation costs as many positions as the longest; laid end to end
in one row, each costs its own length, and a 4-D mask lets each token attend to the real tokens
of its own prefix and to its own continuation up to itself, at the position it has in its own
sequence: for full causal attention the same function, up to summation order. The trainer's
windows run this way (``train/step/shared_prefix.py``): the prefixes ran as a left-padded batch
[U, P] with a cache; ``packed_forward`` lays their caches end to end as one row of U·P keys and
runs the continuations on it as one packed row, two forwards as the padded form runs, so every
training process runs the same forwards.

Summation order is not the same packed and padded, and it moves with what else a packed row
holds (float32: up to several 1e-6 in a log-prob; bfloat16: about 1e-3). With one optimizer
step per batch the trainer's π_θ and π_prox come from one forward, so that noise does not enter
their ratio (with minibatches it does, far below any clip). The engine does not
pack its scoring: π_prox_t is compared with the engine's own sampling (segment-wise's premise
in bfloat16) and across batches (``sdp recompute``), which padded scoring keeps independent of
what else a batch holds.

transformers passes a 4-D mask unchanged to SDPA (boolean, True where a key is seen, as it
builds them itself) and to eager attention (additive: 0 or the dtype's lowest value); other
attention kernels and other attention kinds do not take it (``packing_allowed``). The
attention over a packed row grows with its square, so a mask is kept under
``MAX_MASK_ENTRIES`` and packing is used only where it saves padding (``packing_saves``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from sdp_cli.models.attention import AttentionLayout, attention_layout
from sdp_cli.models.kv_cache import lay_rows_end_to_end, with_cache

#: the most mask entries (packed tokens × keys) one packed forward builds
MAX_MASK_ENTRIES = 1 << 22
#: attention kernels that take a 4-D mask as given
_MASKED_KERNELS = frozenset({"sdpa", "eager"})


def packing_allowed(model: torch.nn.Module) -> bool:
    """Whether ``model``'s config declares full attention only and a kernel that takes a 4-D mask."""
    config = getattr(model, "config", None)
    kernel = getattr(config, "_attn_implementation", None)
    return attention_layout(config) is AttentionLayout.ANY and kernel in _MASKED_KERNELS


def packing_saves(lengths: Sequence[int], min_saving: float = 0.2) -> bool:
    """Whether packing continuations of ``lengths`` runs at least ``min_saving`` fewer positions
    than padding them to the longest (without padding to save, the block mask's attention only
    costs more)."""
    padded = len(lengths) * max(lengths, default=0)
    return padded > 0 and sum(lengths) <= (1 - min_saving) * padded


def block_mask(row_prefix: torch.Tensor, prefix_mask: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Which keys each packed token sees, [T, U·P + T]: token k of row i sees the real tokens of
    prefix ``row_prefix[i]`` (keys u·P + c) and the tokens of row i up to k (keys U·P + k')."""
    device = prefix_mask.device
    distinct, width = prefix_mask.shape
    row_of = torch.repeat_interleave(torch.arange(len(lengths), device=device), lengths)  # [T]
    prefix_of_key = torch.arange(distinct, device=device).repeat_interleave(width)  # [U·P]
    sees_prefix = (row_prefix[row_of][:, None] == prefix_of_key[None]) & (prefix_mask.reshape(-1) > 0)[None]
    index = torch.arange(row_of.numel(), device=device)
    sees_own = (row_of[:, None] == row_of[None]) & (index[None] <= index[:, None])
    return torch.cat([sees_prefix, sees_own], 1)


def _as_attention_mask(visible: torch.Tensor, model: torch.nn.Module) -> torch.Tensor:
    """``visible`` as the 4-D mask ``model``'s kernel takes: boolean for SDPA, additive for eager."""
    if getattr(model.config, "_attn_implementation", None) == "sdpa":
        return visible[None, None]
    dtype = model.get_output_embeddings().weight.dtype
    additive = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
    return additive.masked_fill_(~visible, torch.finfo(dtype).min)[None, None]


def packed_forward(
    model: torch.nn.Module,
    cache: Any,
    prefix_mask: torch.Tensor,
    row_prefix: torch.Tensor,
    ids: torch.Tensor,
    lengths: torch.Tensor,
    positions: torch.Tensor,
    *,
    unwrapped: torch.nn.Module | None = None,
    **kwargs: Any,
) -> Any | None:
    """``model``'s output for the continuation tokens ``ids`` [T] (row after row, ``lengths``
    [B] of them per row, at ``positions`` [T]) on the prefixes' ``cache`` ([U, …, P, …] as the
    prefix forward left it; laid end to end here, so it is consumed). ``prefix_mask`` [U, P]:
    the prefixes' left padding; ``row_prefix`` [B]: each row's prefix; ``unwrapped``: the bare
    model, if ``model`` wraps it; ``kwargs`` go to the forward. None, and ``cache`` untouched,
    when there is no token, the mask would exceed ``MAX_MASK_ENTRIES`` or the cache is not made
    of transformers' plain dynamic layers: the caller then runs its rows padded."""
    total = int(ids.numel())
    if total == 0 or total * (prefix_mask.numel() + total) > MAX_MASK_ENTRIES or not lay_rows_end_to_end(cache):
        return None
    visible = block_mask(row_prefix, prefix_mask, lengths)
    return model(
        input_ids=ids[None],
        attention_mask=_as_attention_mask(visible, unwrapped if unwrapped is not None else model),
        position_ids=positions[None],
        use_cache=True,
        **with_cache(cache),
        **kwargs,
    )
