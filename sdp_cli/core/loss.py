"""Policy-gradient loss: PPO clip (with clip-higher and dual clip), REINFORCE, CISPO or DPPO
(docs/math.md §5, §9).

The ratio is r = π_θ / π_prox (the caller passes π_behav as the anchor in bypass mode); the
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


def _check_policy_loss_args(
    logprobs: Tensor,
    proximal_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    weights: Tensor | None,
    clip: float,
    clip_high: float | None,
    dual_clip: float | None,
    agg: str,
    loss_type: str,
    denominator: float | Tensor | None,
    ratio_level: str,
    dppo_kl_coef: float,
) -> Masked:
    """``policy_loss``'s boundary: ValueError naming the first bad argument; the wrapped mask."""
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
    check_number("clip_high", clip if clip_high is None else clip_high, above=0)
    if dual_clip is not None:
        check_number("dual_clip", dual_clip, above=1)
    check_number("dppo_kl_coef", dppo_kl_coef, above=0, inclusive=True)
    if dppo_kl_coef and loss_type != "dppo":
        raise ValueError(f"dppo_kl_coef is DPPO's penalty; got loss_type={loss_type!r}")
    return mk


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
    dppo_kl_coef: float = 0.0,
) -> tuple[Tensor, dict[str, float]]:
    """Aggregated policy loss and its metrics (docs/math.md §5).

    With r = exp(clamp(lp − prox, ±20)) (``proximal_logprobs`` is the mode's anchor):
    ppo_clip: ℓ = max(−A·r, −A·clip(r, 1−ε, 1+ε_high)); with dual clip c, ℓ = min(ℓ, c·|A|)
    where A < 0 (the other losses have no dual clip). ``ratio_level="sequence"`` (GSPO, docs/math.md §9.3) takes r per sequence, the
    length-normalised s_i = exp(mean_t(lp − prox)), for every token of row i.
    reinforce: ℓ = −A·lp, with ``weights`` the detached importance weight π_θ/π_behav (the caller
    recomputes it for every optimizer step). cispo (§9.5): ℓ = −sg(clip(r, 1−ε, 1+ε_high))·A·lp.
    dppo (§9.6): ℓ = −keep·A·r + ``dppo_kl_coef``·(lp − prox)², keep = 0 where A > 0 and
    π_θ − π_anchor > ε_high or A ≤ 0 and π_θ − π_anchor < −ε (probabilities).
    Then ℓ·w, and ``agg`` reduces over valid tokens, dividing by ``denominator`` when given
    (``_aggregate``). Only ``logprobs`` receives a gradient.
    Its arguments are checked once, here, the public entry point (``_check_policy_loss_args``);
    the trainer's loss settings come validated from the config (config/validation.py).
    """
    mk = _check_policy_loss_args(
        logprobs, proximal_logprobs, advantages, mask, weights, clip, clip_high, dual_clip, agg,
        loss_type, denominator, ratio_level, dppo_kl_coef,
    )
    clip_high = clip if clip_high is None else clip_high

    with torch.no_grad():
        # Every input is 0 at padding from here on, whatever it held there (NaN, inf).
        lp = mk.select(logprobs.detach())
        adv = mk.select(advantages.detach())
        anchor = mk.select(proximal_logprobs.detach())
        delta = lp - anchor
        counts: dict[str, Tensor] = {}
        # −A written as 0 − A: it is +0.0 (not −0.0) at padding, so every padded gradient is +0.
        neg_adv = 0.0 - adv
        if loss_type == "reinforce":
            slope = neg_adv
            value = slope * lp
        else:
            # GSPO: every token of a row sees the row's mean log ratio (padding stays 0)
            level_delta = delta if ratio_level == "token" else mk.select(mk.row_mean(delta).unsqueeze(-1).expand_as(delta))
            log_ratio = level_delta.clamp(-LOG_CLAMP, LOG_CLAMP)
            ratio = torch.exp(log_ratio)
            # ∂r/∂lp = r where the ±20 clamp is inactive (a clamp passes the gradient on its
            # closed interval, where it returns its input), 0 where it binds
            unclamped = log_ratio == level_delta
        if loss_type == "ppo_clip":
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
            # The gradient −A·r flows where no clip binds and the clamp is inactive.
            slope = unclipped * as_float(~was_clipped & unclamped, unclipped.dtype)
        elif loss_type == "cispo":
            # ŵ = sg(clip(r, 1−ε, 1+ε_high)) scales the gradient of every token, clipped or not
            # (padding has r = 1, inside the band)
            high, low = ratio > 1 + clip_high, ratio < 1 - clip
            counts["clipped"] = count(high | low)
            counts["high"] = count(high)
            slope = neg_adv * ratio.clamp(1 - clip, 1 + clip_high)
            value = slope * lp
        elif loss_type == "dppo":
            # the trust region on probabilities, by the sign of A (padding: π_θ − π_anchor = 0)
            gap = torch.exp(lp) - torch.exp(anchor)
            positive = adv > 0
            high, low = positive & (gap > clip_high), ~positive & (gap < -clip)
            counts["clipped"] = count(high | low)
            counts["high"] = count(high)
            value = neg_adv * ratio * as_float(~(high | low), ratio.dtype)
            slope = value * as_float(unclamped, value.dtype)
            if dppo_kl_coef:
                # prime-rl's kl_tau·(log π_θ/π_anchor)² on every valid token, kept or not
                value = value + dppo_kl_coef * delta.square()
                slope = slope + 2 * dppo_kl_coef * delta
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
        # high: the upper bound binds (ppo_clip, dppo: where A > 0; cispo: r > 1 + ε_high), low: the
        # lower one (docs/math.md §5.4)
        "pg_clipfrac": clipped_n / n,
        "pg_clipfrac_high": high_n / n,
        "pg_clipfrac_low": (clipped_n - high_n) / n,
        "pg_clipfrac_dual": host.get("dual", 0.0) / n,
        "ppo_kl": 0.0 - host["delta"] / n,  # not -x, which is -0.0 for x = 0
    }
    return loss, metrics
