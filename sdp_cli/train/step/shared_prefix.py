"""The trainer's forward with each distinct prompt computed once (docs/training.md, "The
trainer's policy and loss").

A GRPO batch holds ``group_size`` samples of every prompt. A plain forward runs the prompt's
tokens once per sample; this one runs every distinct prefix once, then the response tokens of
all rows on top of its KV cache (selected per row, so the gradient of the prefix sums over the
rows that share it). The result is the same function of θ: the same tokens at the same
positions attend to the same keys, and only floating-point summation order may differ.

A row's prefix is everything before its first trained token (the prompt, plus any leading
response tokens the loss mask leaves out), so rows share a prefix exactly when those token ids
are equal; no group id is trusted. Its window runs from that token up to the one before its last
trained token: the last trained token (and anything after it) predicts nothing the loss reads,
so it is not run (with 2–3-token answers that is a quarter of the window). Where the model
allows it (full attention on SDPA or eager), the windows' real tokens then run as one packed row
on the prefixes' caches laid end to end (``sdp_cli/models/packed.py``), else padded to the
longest window. Prefixes are left-padded to one width, so every row's prefix
ends at the same cache index and its window follows it without a gap: a row's cache index minus
its position is the same for all its tokens. That keeps sliding-window attention exact, whose
mask transformers builds from cache indices (``sdp_cli/models/attention.py``); with a gap between
a short prompt and its response, its window would lose keys that the plain forward attends to.
Both forwards carry explicit position ids, so the padding never shifts a position.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from sdp_cli.models.kv_cache import returned_cache, with_cache
from sdp_cli.models.packed import packed_forward, packing_allowed, packing_saves

#: share prefixes only when that removes at least this fraction of the forward's token positions
MIN_SAVING = 0.2


@dataclass
class PrefixPlan:
    """How a batch's rows map onto distinct prefixes and a response window.

    ``prefix_ids``/``prefix_mask``/``prefix_positions`` [U, P]: the distinct prefixes,
    left-padded, and their positions; ``row_prefix`` [N]: each row's prefix; ``targets`` [N, W]:
    of the W tokens after each row's prefix (W: the most any row trains, counted from its first
    trained token to its last), which are trained tokens; ``window_ids``/``window_mask``/``positions``
    [N, max(W − 1, 1)]: the tokens the forward runs after each row's prefix, their attention mask
    and positions (the hidden state of window column j predicts token j + 1; the last of the W
    tokens is predicted and not run; one column is kept even when W = 1, so every process runs
    the same two forwards).
    """

    prefix_ids: torch.Tensor
    prefix_mask: torch.Tensor
    prefix_positions: torch.Tensor
    row_prefix: torch.Tensor
    window_ids: torch.Tensor
    window_mask: torch.Tensor
    positions: torch.Tensor
    targets: torch.Tensor
    #: the fraction of the plain forward's token positions (N · (L − 1)) this plan does not run
    #: with its windows padded (packed, it runs fewer: ``shared_prefix_hidden``)
    positions_saved: float
    #: the plain forward's token positions, N · (L − 1)
    plain_positions: int


def plan_shared_prefix(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, response: torch.Tensor, *, min_saving: float = MIN_SAVING
) -> PrefixPlan | None:
    """The plan for a batch (ids/attention [N, L], trained targets ``response`` [N, L-1], with
    ``response[i, t]`` meaning token t+1 of row i is trained), or None when sharing would save
    less than ``min_saving`` of the positions or the batch's layout does not allow it (a row
    without trained tokens, or with padding inside its tokens)."""
    n, width = input_ids.shape
    lengths = attention_mask.sum(1)
    contiguous = bool((attention_mask == (torch.arange(width) < lengths[:, None])).all())
    if n < 2 or not contiguous or not bool(response.any(1).all()):
        return None
    # first trained target t = the first position whose next token is trained: prefix = ids[:t+1]
    prefix_len = response.to(torch.int8).argmax(1) + 1
    # the last trained token's position + 1: where each row's predicted tokens end
    predicted_end = response.shape[1] + 1 - response.flip(1).to(torch.int8).argmax(1)
    prefix_width = int(prefix_len.max())
    # each row's prefix, -1 past its end (token ids are ≥ 0): equal keys = the same prefix
    inside_prefix = torch.arange(prefix_width) < prefix_len[:, None]
    keys = torch.where(inside_prefix, input_ids[:, :prefix_width], -1)
    distinct_keys, row_prefix = torch.unique(keys, dim=0, return_inverse=True)
    distinct = distinct_keys.shape[0]
    predicted_width = int((predicted_end - prefix_len).max())
    window_width = max(predicted_width - 1, 1)
    # the plain forward runs every row's tokens but the last (whose state predicts nothing)
    saved = 1 - (distinct * prefix_width + n * window_width) / (n * (width - 1))
    if saved < min_saving:
        return None
    # left-pad: column c of a prefix of length l holds its token c − (P − l)
    distinct_len = (distinct_keys >= 0).sum(1)
    prefix_positions = torch.arange(prefix_width) - (prefix_width - distinct_len)[:, None]
    inside_distinct = prefix_positions >= 0
    prefix_positions = prefix_positions.clamp_min(0)
    prefix_mask = inside_distinct.to(attention_mask.dtype)
    prefix_ids = torch.where(inside_distinct, distinct_keys.gather(1, prefix_positions), 0).to(input_ids.dtype)
    # full positions of the predicted tokens; the one at p+j is predicted by the state before it
    predicted = prefix_len[:, None] + torch.arange(predicted_width)[None]
    targets = response.gather(1, (predicted - 1).clamp_max(width - 2)) & (predicted < predicted_end[:, None])
    if int(targets.sum()) != int(response.sum()):  # a trained token outside the window: impossible
        return None
    # the window runs the tokens whose states predict the next trained ones: up to the last's predecessor
    columns = prefix_len[:, None] + torch.arange(window_width)[None]
    inside = columns < predicted_end[:, None] - 1
    window_ids = torch.where(inside, input_ids.gather(1, columns.clamp_max(width - 1)), torch.zeros_like(input_ids[:1, :1]))
    return PrefixPlan(
        prefix_ids=prefix_ids,
        prefix_mask=prefix_mask,
        prefix_positions=prefix_positions,
        row_prefix=row_prefix,
        window_ids=window_ids,
        window_mask=inside.to(attention_mask.dtype),
        positions=columns,
        targets=targets,
        positions_saved=saved,
        plain_positions=n * (width - 1),
    )


def shared_prefix_hidden(
    model: torch.nn.Module, plan: PrefixPlan, device: torch.device, *, unwrapped: torch.nn.Module | None = None
) -> tuple[torch.Tensor, float]:
    """The final hidden states that predict the trained tokens, [trained tokens, hidden], in the
    order of ``hidden_states[:, :-1][response]`` of the plain forward, and the fraction of the
    plain forward's positions this forward did not run. ``unwrapped``: the bare model when
    ``model`` wraps it (its config says whether the windows may be packed)."""
    row_prefix = plan.row_prefix.to(device)
    kwargs: dict[str, Any] = {"use_cache": True, "output_hidden_states": True, "logits_to_keep": 1}
    prefix_mask = plan.prefix_mask.to(device)
    out = model(
        input_ids=plan.prefix_ids.to(device),
        attention_mask=prefix_mask,
        position_ids=plan.prefix_positions.to(device),
        **kwargs,
    )
    # the state after each row's last prefix token (the last column) predicts its first window token
    last_of_prefix = out.hidden_states[-1][row_prefix, -1]
    cache = returned_cache(out)
    window_mask = plan.window_mask.to(device)
    windows = _packed_windows(model, unwrapped or model, plan, cache, prefix_mask, row_prefix, window_mask)
    if windows is not None:
        saved = 1 - (plan.prefix_ids.numel() + int((window_mask > 0).sum())) / plan.plain_positions
    else:
        saved = plan.positions_saved
        cache.reorder_cache(row_prefix)  # each row's copy of its prefix's keys and values (index_select)
        out = model(
            input_ids=plan.window_ids.to(device),
            attention_mask=torch.cat([prefix_mask[row_prefix], window_mask], 1),
            position_ids=plan.positions.to(device),
            **with_cache(cache),
            **kwargs,
        )
        windows = out.hidden_states[-1]
    # predicted token j comes from the state before it: the prefix's last, then window column j-1
    targets = plan.targets.to(device)
    before = torch.cat([last_of_prefix[:, None], windows], 1)[:, : targets.shape[1]]
    return before[targets], saved


def _packed_windows(
    model: torch.nn.Module,
    unwrapped: torch.nn.Module,
    plan: PrefixPlan,
    cache: Any,
    prefix_mask: torch.Tensor,
    row_prefix: torch.Tensor,
    window_mask: torch.Tensor,
) -> torch.Tensor | None:
    """The windows' final hidden states [N, W, hidden] (0 on padding) from one packed forward of
    their real tokens (``models/packed.py``), or None where packing does not hold or save: the
    caller then runs them padded."""
    inside = window_mask > 0
    lengths = inside.sum(1)
    if not packing_allowed(unwrapped) or not packing_saves(lengths.tolist()):
        return None
    positions = plan.positions.to(window_mask.device)[inside]
    ids = plan.window_ids.to(window_mask.device)[inside]
    out = packed_forward(
        model, cache, prefix_mask, row_prefix, ids, lengths, positions,
        unwrapped=unwrapped, output_hidden_states=True, logits_to_keep=1,
    )
    if out is None:
        return None
    packed = out.hidden_states[-1][0]
    return packed.new_zeros(*inside.shape, packed.shape[-1]).masked_scatter(inside[..., None], packed)
