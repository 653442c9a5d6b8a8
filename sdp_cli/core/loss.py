"""Policy-gradient loss: PPO clip (with clip-higher and dual clip) or REINFORCE (docs/math.md §5).

The clip ratio is r = π_θ / π_prox (the caller passes π_behav as the anchor in bypass mode); the
behavioural weight w (``weights``, from ``sdp_cli.core.weights``) multiplies the per-token loss
and is never differentiated.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from sdp_cli.choices import LOSS_AGGS, LOSS_TYPES, RATIO_LEVELS
from sdp_cli.core._masked import (
    LOG_CLAMP,
    Masked,
    as_float,
    check_2d,
    check_choice,
    check_float_tensor,
    check_like,
    check_number,
    count,
    masked,
    to_host,
)


def loss_count(mask: Tensor, agg: str) -> Tensor:
    """This batch's count in the denominator of ``agg`` (docs/math.md §5.2), before the ≥ 1 floor.

    Valid tokens (token-mean) or non-empty rows (seq-mean-token-sum, seq-mean-token-mean), as a
    0-d float tensor: summed over data-parallel shards it is the count of the whole minibatch.
    seq-mean-token-sum-norm divides by a constant instead and has no count.
    """
    check_choice("agg", agg, LOSS_AGGS)
    if agg == "seq-mean-token-sum-norm":
        raise ValueError("agg='seq-mean-token-sum-norm' divides by a constant, not by a count")
    check_2d("mask", mask)
    mk = masked(mask, torch.empty(mask.shape, dtype=torch.float32), "mask")
    return mk.token_count if agg == "token-mean" else mk.row_total


def _check_denominator(agg: str, denominator: float | Tensor | None) -> None:
    if denominator is None:
        if agg == "seq-mean-token-sum-norm":
            raise ValueError(
                "agg='seq-mean-token-sum-norm' needs its constant denominator "
                "(norm_length × sequences per optimizer step, docs/math.md §5.2)"
            )
        return
    if isinstance(denominator, Tensor) and denominator.dim() == 0:
        denominator = float(denominator)
    check_number("denominator", denominator, above=0)


def _aggregate(
    per_token: Tensor, mk: Masked, agg: str, denominator: float | Tensor | None = None
) -> Tensor:
    """Reduce a [B, T] per-token loss, 0 at padding, to a scalar (docs/math.md §5.2).

    The numerator is this batch's; the denominator is ``denominator`` when given (the count of
    the whole minibatch across data-parallel shards, or the constant of
    seq-mean-token-sum-norm) and this batch's own count (at least 1) otherwise.
    """
    if agg == "token-mean":
        total, count = per_token.sum(), mk.n_tokens
    else:
        seq_sum = per_token.sum(-1)
        if agg == "seq-mean-token-mean":
            seq_sum = seq_sum / mk.row_divisor
        # n_rows counts only rows with ≥ 1 valid token, so padding rows do not dilute the loss.
        total, count = seq_sum.sum(), mk.n_rows
    return total / (count if denominator is None else denominator)


def aggregate_loss(
    values: Tensor,
    mask: Tensor,
    agg: str = "token-mean",
    *,
    denominator: float | Tensor | None = None,
) -> Tensor:
    """Aggregate any per-token [B, T] loss term exactly as ``policy_loss`` does (docs §5.2)."""
    check_float_tensor("values", values)
    check_2d("values", values)
    check_choice("agg", agg, LOSS_AGGS)
    _check_denominator(agg, denominator)
    mk = masked(mask, values, "values")
    return _aggregate(torch.where(mk.valid, values, 0.0), mk, agg, denominator)


class _TokenLoss(torch.autograd.Function):
    """Per-token loss ℓ whose derivative ∂ℓ/∂log π_θ was computed with it (docs §5.3).

    Every branch of the PPO objective (clip, dual clip, the ±20 clamp, the mask) only decides
    whether a token passes −A·w·r or nothing, so the derivative is known in closed form; one
    node replaces the dozen autograd would record (each a full pass, in backward too).
    """

    @staticmethod
    def forward(ctx, logprobs: Tensor, value: Tensor, slope: Tensor) -> Tensor:
        ctx.save_for_backward(slope)
        return value

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:
        (slope,) = ctx.saved_tensors
        return grad * slope, None, None


def policy_loss(
    logprobs: Tensor,
    proximal_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    weights: Tensor | None = None,
    clip: float = 0.2,
    clip_high: float | None = None,
    dual_clip: float | None = None,
    agg: str = "token-mean",
    loss_type: str = "ppo_clip",
    denominator: float | Tensor | None = None,
    ratio_level: str = "token",
) -> tuple[Tensor, dict[str, float]]:
    """Aggregated policy loss and its metrics (docs/math.md §5).

    ppo_clip: ℓ = max(−A·r, −A·clip(r, 1−ε, 1+ε_high)) with r = exp(clamp(lp − prox, ±20));
    with dual clip c, ℓ = min(ℓ, c·|A|) where A < 0. ``ratio_level="sequence"`` (GSPO,
    docs/math.md §9.3) takes r per sequence, the length-normalised s_i = exp(mean_t(lp − prox)),
    for every token of row i. reinforce: ℓ = −A·lp, with ``weights`` the detached importance
    weight π_θ/π_behav (the caller recomputes it for every optimizer step). Then ℓ·w, and
    ``agg`` reduces over valid tokens, dividing by ``denominator`` when given (``_aggregate``).
    Only ``logprobs`` receives a gradient.
    """
    check_float_tensor("logprobs", logprobs)
    check_2d("logprobs", logprobs)
    check_like("proximal_logprobs", proximal_logprobs, logprobs, "logprobs")
    check_like("advantages", advantages, logprobs, "logprobs")
    if weights is not None:
        check_like("weights", weights, logprobs, "logprobs")
    mk = masked(mask, logprobs, "logprobs")
    check_choice("agg", agg, LOSS_AGGS)
    check_choice("loss_type", loss_type, LOSS_TYPES)
    check_choice("ratio_level", ratio_level, RATIO_LEVELS)
    if ratio_level == "sequence" and loss_type != "ppo_clip":
        raise ValueError(f"ratio_level='sequence' is a PPO-clip ratio; got loss_type={loss_type!r}")
    _check_denominator(agg, denominator)
    check_number("clip", clip, above=0)
    clip_high = clip if clip_high is None else clip_high
    check_number("clip_high", clip_high, above=0)
    if dual_clip is not None:
        check_number("dual_clip", dual_clip, above=1)

    with torch.no_grad():
        # Every input is 0 at padding from here on, whatever it held there (NaN, inf).
        lp = mk.select(logprobs.detach())
        adv = mk.select(advantages.detach())
        delta = lp - mk.select(proximal_logprobs.detach())
        counts: dict[str, Tensor] = {}
        # −A written as 0 − A: it is +0.0 (not −0.0) at padding, so every padded gradient is +0.
        neg_adv = 0.0 - adv
        if loss_type == "ppo_clip":
            # GSPO: every token of a row sees the row's mean log ratio (padding stays 0)
            level_delta = delta if ratio_level == "token" else mk.select(mk.row_mean(delta).unsqueeze(-1).expand_as(delta))
            log_ratio = level_delta.clamp(-LOG_CLAMP, LOG_CLAMP)
            ratio = torch.exp(log_ratio)
            unclipped = neg_adv * ratio
            clipped = neg_adv * ratio.clamp(1 - clip, 1 + clip_high)
            # At padding A = 0: both branches are 0, nothing is clipped or gets a gradient.
            was_clipped = clipped > unclipped
            value = torch.maximum(unclipped, clipped)
            counts["clipped"] = count(was_clipped)
            counts["high"] = count(was_clipped & (adv > 0))
            if dual_clip is not None:
                # The dual clip bounds the loss of negative-advantage tokens by c·|A|; for A ≥ 0
                # the loss is ≤ 0 ≤ c·|A| already, so the bound can be applied everywhere.
                bound = dual_clip * adv.abs()
                dual_bound = value > bound
                value = torch.minimum(value, bound)
                was_clipped |= dual_bound
                counts["dual"] = count(dual_bound)
            # The gradient −A·r flows where no clip binds and the ±20 clamp is inactive (a
            # clamp passes the gradient on its closed interval, where it returns its input).
            slope = unclipped * as_float(~was_clipped & (log_ratio == level_delta), unclipped.dtype)
        else:
            slope = neg_adv
            value = slope * lp
        if weights is not None:
            w = mk.select(weights.detach())
            value = value * w
            slope = slope * w
        if ratio_level == "sequence":
            # ∂s_i/∂lp_u = s_i/|y_i| for every valid token u of row i, and every sdp aggregation
            # weighs the tokens of a row alike, so token u's slope is the row mean of the
            # token slopes (docs/math.md §9.3)
            slope = mk.select(mk.row_mean(slope).unsqueeze(-1).expand_as(slope))

    loss = _aggregate(_TokenLoss.apply(logprobs, value, slope), mk, agg, denominator)
    host = to_host({"loss": loss, "n": mk.n_tokens, "delta": delta.sum(), **counts})
    n, clipped_n, high_n = host["n"], host.get("clipped", 0.0), host.get("high", 0.0)
    metrics = {
        "pg_loss": host["loss"],
        # Clipped with A > 0 means r > 1 + ε_high; with A < 0 it means r < 1 − ε.
        "pg_clipfrac": clipped_n / n,
        "pg_clipfrac_high": high_n / n,
        "pg_clipfrac_low": (clipped_n - high_n) / n,
        "pg_clipfrac_dual": host.get("dual", 0.0) / n,
        "ppo_kl": 0.0 - host["delta"] / n,  # not -x, which is -0.0 for x = 0
    }
    return loss, metrics
