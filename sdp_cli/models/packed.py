"""Continuations of shared prefixes laid end to end in one row, under a block mask
(docs/engines.md "Scoring").

The distinct prefixes of a batch run first, as one left-padded batch [U, P]. Continuing them
row by row would copy each row's prefix cache and pad every row's continuation to the longest,
B × S positions, most of them padding when continuations differ in length (a GRPO group's
answers do). Here the prefixes' KV caches are laid end to end as one row of U·P keys, and the
continuations follow as one packed row of T = Σ lengths tokens. A 4-D mask lets each token attend
to the real tokens of its own prefix and to its own continuation up to itself, at the position
it has in its own sequence: for full causal attention the same function, up to summation order.
The mask is additive (0 or the dtype's lowest value), which transformers passes unchanged to
SDPA and eager attention; other attention kernels and other attention kinds do not take it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from sdp_cli.models.attention import AttentionLayout, attention_layout
from sdp_cli.models.kv_cache import lay_rows_end_to_end, with_cache

#: the most mask entries (packed tokens × keys) one packed forward builds
MAX_MASK_ENTRIES = 1 << 22
#: attention kernels that apply a 4-D additive mask as given
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


def block_mask(
    row_prefix: torch.Tensor, prefix_mask: torch.Tensor, lengths: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """The additive mask [1, 1, T, U·P + T] of a packed continuation: packed token k of row i
    sees the real tokens of prefix ``row_prefix[i]`` and the tokens of row i up to k."""
    device = prefix_mask.device
    distinct, width = prefix_mask.shape
    row_of = torch.repeat_interleave(torch.arange(len(lengths), device=device), lengths)  # [T]
    prefix_of_key = torch.arange(distinct, device=device).repeat_interleave(width)  # [U·P]
    sees_prefix = (row_prefix[row_of][:, None] == prefix_of_key[None]) & (prefix_mask.reshape(-1) > 0)[None]
    index = torch.arange(row_of.numel(), device=device)
    sees_own = (row_of[:, None] == row_of[None]) & (index[None] <= index[:, None])
    visible = torch.cat([sees_prefix, sees_own], 1)
    blocked = torch.zeros(visible.shape, dtype=dtype, device=device)
    blocked.masked_fill_(~visible, torch.finfo(dtype).min)
    return blocked[None, None]


def packed_continuation_logits(
    model: torch.nn.Module,
    cache: Any,
    prefix_mask: torch.Tensor,
    row_prefix: torch.Tensor,
    continuations: Sequence[Sequence[int]],
    dtype: torch.dtype,
) -> torch.Tensor | None:
    """Logits [T, V] of every continuation token, row after row, run on the prefixes' ``cache``
    ([U, …, P, …] as the prefix forward left it; laid end to end here, so it is consumed).
    ``prefix_mask`` [U, P]: the prefixes' left padding; ``row_prefix`` [B]: each row's prefix.
    None (``cache`` untouched) when the mask would exceed ``MAX_MASK_ENTRIES`` or the cache is
    not one transformers' dynamic layers keep (the caller then runs rows the padded way)."""
    device = prefix_mask.device
    lengths = torch.tensor([len(c) for c in continuations], dtype=torch.long, device=device)
    total = int(lengths.sum())
    keys = prefix_mask.numel() + total
    if total == 0 or total * keys > MAX_MASK_ENTRIES or not lay_rows_end_to_end(cache):
        return None
    ids = torch.tensor([t for c in continuations for t in c], dtype=torch.long, device=device)
    # token j of row i sits at position (its prefix's real length) + j, as in its own sequence
    starts = prefix_mask.sum(1)[row_prefix]
    first = torch.cumsum(lengths, 0) - lengths
    row_of = torch.repeat_interleave(torch.arange(len(lengths), device=device), lengths)
    positions = starts[row_of] + torch.arange(total, device=device) - first[row_of]
    out = model(
        input_ids=ids[None],
        attention_mask=block_mask(row_prefix, prefix_mask, lengths, dtype),
        position_ids=positions[None],
        use_cache=True,
        **with_cache(cache),
    )
    return out.logits[0]
