"""Continuations of shared prefixes laid end to end in one row, under a block mask
(docs/training.md "The trainer's policy and loss").

A GRPO batch continues a few distinct prefixes (prompts) with many continuations of unequal
length. Run padded, every continuation costs as many positions as the longest; laid end to end
in one row, each costs its own length, and a 4-D mask lets each token attend to the real tokens
of its own prefix and to its own continuation up to itself, at the position it has in its own
sequence: for full causal attention the same function, up to summation order. Two forms:

- ``packed_forward`` (the trainer's windows, ``train/step/shared_prefix.py``): the prefixes ran
  as a left-padded batch [U, P] with a cache; their caches are laid end to end as one row of
  U·P keys, and the continuations run on it as one packed row. Two forwards, as the padded
  form runs, so every training process runs the same forwards.
- ``packed_logits`` (the engine's scoring, ``LocalEngine.score``): the prefixes and then the
  continuations as one row of one forward, without a cache.

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


def _continuation_positions(
    prefix_lengths: torch.Tensor, row_prefix: torch.Tensor, lengths: torch.Tensor
) -> torch.Tensor:
    """The positions [T] of packed continuation tokens: token j of row i at the length of its
    prefix + j, as in its own sequence."""
    device = lengths.device
    total = int(lengths.sum())
    row_of = torch.repeat_interleave(torch.arange(len(lengths), device=device), lengths)
    first = torch.cumsum(lengths, 0) - lengths
    return prefix_lengths[row_prefix][row_of] + torch.arange(total, device=device) - first[row_of]


def one_row_visibility(prefix_lengths: torch.Tensor, row_prefix: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Which tokens each token sees, [N, N], when the distinct prefixes (``prefix_lengths`` [U]
    tokens each) and then every row's continuation (``lengths`` [B]) run as one row with no
    cache: a prefix token sees its prefix up to itself; a continuation token of row i sees all
    of prefix ``row_prefix[i]`` and row i up to itself."""
    device = lengths.device
    owner = torch.cat([
        torch.repeat_interleave(torch.arange(len(prefix_lengths), device=device), prefix_lengths),
        torch.repeat_interleave(row_prefix, lengths),
    ])
    row = torch.cat([
        torch.full((int(prefix_lengths.sum()),), -1, device=device),
        torch.repeat_interleave(torch.arange(len(lengths), device=device), lengths),
    ])
    index = torch.arange(owner.numel(), device=device)
    own_segment = (row[None] == -1) | (row[None] == row[:, None])
    return (owner[:, None] == owner[None]) & (index[None] <= index[:, None]) & own_segment


def packed_logits(
    model: torch.nn.Module,
    prefixes: Sequence[Sequence[int]],
    row_prefix: Sequence[int],
    continuations: Sequence[Sequence[int]],
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """One forward, without a cache, of the distinct ``prefixes`` and then every row's
    continuation laid end to end (row i continues prefix ``row_prefix[i]``): the logits after
    each prefix's last token [U, V] and at every continuation token [T, V], row after row. None
    when the mask would exceed ``MAX_MASK_ENTRIES``."""
    prefix_lengths = torch.tensor([len(p) for p in prefixes], dtype=torch.long, device=device)
    lengths = torch.tensor([len(c) for c in continuations], dtype=torch.long, device=device)
    owners = torch.tensor(list(row_prefix), dtype=torch.long, device=device)
    in_prefixes = int(prefix_lengths.sum())
    total = in_prefixes + int(lengths.sum())
    if total * total > MAX_MASK_ENTRIES:
        return None
    ids = torch.tensor([t for p in prefixes for t in p] + [t for c in continuations for t in c], device=device)
    # a prefix's token j at position j; row i's token j at its prefix's length + j
    prefix_positions = torch.cat([torch.arange(n, device=device) for n in prefix_lengths.tolist()])
    positions = torch.cat([prefix_positions, _continuation_positions(prefix_lengths, owners, lengths)])
    visible = one_row_visibility(prefix_lengths, owners, lengths)
    out = model(
        input_ids=ids[None],
        attention_mask=_as_attention_mask(visible, model),
        position_ids=positions[None],
        use_cache=False,
    )
    logits = out.logits[0]
    return logits[torch.cumsum(prefix_lengths, 0) - 1], logits[in_prefixes:]
