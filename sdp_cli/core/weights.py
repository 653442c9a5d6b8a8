"""Behavioural importance weights and rejection masks (docs/design.md §4, docs/math.md §1–§3).

The correction modes differ only in the log ratio of the behavioural weight; the kernels below
are the built-in modes' (declared, with what they read, in ``sdp_cli/modes.py``):

    bypass        no weight (the PPO ratio is anchored at π_behav instead)
    decoupled     lr = log π_prox   − log π_behav
    segment_wise  lr = log π_prox_t − log π_behav
                  with drift_clip κ: + clamp(log π_prox − log π_prox_t, ±log κ)

``importance_weights`` turns lr into detached weights (token / sequence / geometric, bounded by
truncation or masking, optionally batch-normalised); ``rejection_mask`` turns it, or verl's k2/k3
divergence estimates of it, into a 0/1 mask that drops whole tokens or sequences. The two are
independent: a caller may use either, both, or neither. The field's other masks and sources
(docs/math.md §9): ``second_moment_mask`` (M2PO), ``off_policy_sequence_mask`` (OPSM, from π_θ at
an optimizer step) and ``loglinear_proximal`` (A-3PO's π_prox without a forward).

The functions ``sdp_cli.core`` exports check their arguments, each in one ``_check_*`` helper
called first; the mode kernels and the other masks trust theirs, whose settings the config, the
CLI or the batch reader validated where they entered (``masked`` still checks every mask: its
shape guards the indexing, its 0/1 values are the contract of docs/math.md §0).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from sdp_cli.choices import IS_LEVELS, REJECTION_LEVELS, REJECTION_METRICS, WEIGHT_ACTIONS
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
    keep,
    masked,
    to_host,
)
from sdp_cli.modes import MODES, Mode, mode_names


def drift_log_factor(
    proximal_logprobs: Tensor, proximal_logprobs_t: Tensor, drift_clip: float
) -> tuple[Tensor, Tensor]:
    """The drift factor d = π_prox/π_prox_t in log space, clipped to [−log κ, log κ]
    (docs/math.md §1.1).

    Returns (log d clipped, clipped): ``clipped`` is True where the clip changed log d. Both are
    detached; callers select valid tokens (padding may hold anything). κ ≥ 1 and the shapes were
    checked where they entered: loss.drift_clip by the config, --drift-clip by the CLI,
    ``behavior_log_ratio``'s arguments by it, the log-probs by the batch reader.
    """
    bound = math.log(drift_clip)
    log_d = (proximal_logprobs - proximal_logprobs_t).detach()
    clipped_log_d = log_d.clamp(-bound, bound)
    return clipped_log_d, clipped_log_d != log_d


def bypass_log_ratio(old: Tensor, proximal: Tensor | None, proximal_t: Tensor | None, mask: Tensor) -> None:
    """No behavioural weight: the PPO ratio is anchored at π_behav instead."""
    return None


def decoupled_log_ratio(old: Tensor, proximal: Tensor, proximal_t: Tensor | None, mask: Tensor) -> Tensor:
    """log π_prox − log π_behav."""
    return proximal - old


def segment_wise_log_ratio(
    old: Tensor, proximal: Tensor | None, proximal_t: Tensor, mask: Tensor, drift_clip: float | None = None
) -> Tensor:
    """log π_prox_t − log π_behav; with ``drift_clip`` = κ, times the drift factor
    π_prox/π_prox_t clipped into [1/κ, κ] (docs/math.md §1.1). Where the clip does not bind the
    result is computed as log π_prox − log π_behav, so both limits hold bit for bit."""
    log_ratio = proximal_t - old
    if drift_clip is None:
        return log_ratio
    clipped_log_d, clipped = drift_log_factor(proximal, proximal_t, drift_clip)
    return torch.where(clipped, log_ratio + clipped_log_d, proximal - old)


def _check_mode_args(
    mode: str,
    old_logprobs: Tensor,
    proximal_logprobs: Tensor | None,
    proximal_logprobs_t: Tensor | None,
    drift_clip: float | None,
) -> Mode:
    """``behavior_log_ratio``'s boundary: the registered mode, with the inputs it reads shaped like
    ``old_logprobs`` and ``drift_clip`` ≥ 1 for a mode that takes it; ValueError otherwise."""
    check_choice("mode", mode, mode_names())
    check_float_tensor("old_logprobs", old_logprobs)
    spec = MODES[mode]
    if drift_clip is not None:
        if not spec.takes_drift_clip:
            takes = ", ".join(f"mode={m.name!r}" for m in MODES.values() if m.takes_drift_clip)
            raise ValueError(f"drift_clip applies to {takes} only; got mode={mode!r}")
        check_number("drift_clip", drift_clip, above=1.0, inclusive=True, finite=False)
    inputs = {"proximal_logprobs": proximal_logprobs, "proximal_logprobs_t": proximal_logprobs_t}
    needs = spec.needs + (("proximal_logprobs",) if drift_clip is not None else ())
    for name in needs:
        given = inputs[name]
        if given is None:
            why = f"mode={mode!r}" if name in spec.needs else "drift_clip"
            raise ValueError(f"{name} is required for {why}")
        check_like(name, given, old_logprobs, "old_logprobs")
    return spec


def behavior_log_ratio(
    old_logprobs: Tensor,
    proximal_logprobs: Tensor | None = None,
    proximal_logprobs_t: Tensor | None = None,
    *,
    mode: str,
    drift_clip: float | None = None,
    mask: Tensor | None = None,
) -> Tensor | None:
    """Log ratio of the behavioural weight of the registered ``mode`` (``sdp_cli.modes``;
    docs/design.md §1 table), detached; None for a mode without a weight (bypass).

    decoupled: log π_prox − log π_behav; segment_wise: log π_prox_t − log π_behav.
    ``drift_clip`` = κ ≥ 1 (modes that take it): κ = 1 is segment-wise, κ = ∞ decoupled
    (docs/math.md §1.1). ``mask`` marks valid tokens (default: all), for modes that aggregate.
    The public entry point: it checks its arguments (``_check_mode_args``); sdp's own callers
    call the registry's kernels (``Mode.log_ratio``) with config-validated settings.
    """
    spec = _check_mode_args(mode, old_logprobs, proximal_logprobs, proximal_logprobs_t, drift_clip)
    if mask is None:
        mask = torch.ones_like(old_logprobs, dtype=torch.bool)
    params = {} if drift_clip is None else {"drift_clip": drift_clip}
    return spec.log_ratio(old_logprobs, proximal_logprobs, proximal_logprobs_t, mask, **params)


def _level_log_ratio(log_ratio: Tensor, mk: Masked, level: str) -> Tensor:
    """The log ratio a weight is built from: per token [B, T], or per sequence [B] (docs §2).

    ``log_ratio`` must already be 0 at padding.
    """
    if level == "token":
        return log_ratio
    total = log_ratio.sum(-1)
    if level == "sequence":
        return total
    mean = total / mk.row_divisor
    return mean if mean.dtype == log_ratio.dtype else mean.to(log_ratio.dtype)


def _any_row(flags: Tensor) -> Tensor:
    """bool [B]: rows holding a True flag (uint8 max: much faster than ``any`` on CPU)."""
    if flags.shape[-1] == 0:  # rows without tokens hold no flag
        return flags.new_zeros(flags.shape[:-1])
    return flags.view(torch.uint8).amax(-1).bool()


def _check_inputs(log_ratio: Tensor, mask: Tensor, level: str, levels: tuple[str, ...]) -> Masked:
    """A float [B, T] log ratio, a 0/1 mask shaped like it and a known level; the wrapped mask."""
    check_float_tensor("log_ratio", log_ratio)
    check_2d("log_ratio", log_ratio)
    check_choice("level", level, levels)
    return masked(mask, log_ratio, "log_ratio")


def _check_weight_args(
    log_ratio: Tensor, mask: Tensor, level: str, cap: float | None, floor: float | None, action: str
) -> Masked:
    """``importance_weights``' boundary: ValueError naming the first bad argument."""
    mk = _check_inputs(log_ratio, mask, level, IS_LEVELS)
    check_choice("action", action, WEIGHT_ACTIONS)
    if cap is not None:
        check_number("cap", cap, above=0)
    if floor is not None:
        check_number("floor", floor, above=0, inclusive=True)
    if cap is not None and floor is not None and floor > cap:
        raise ValueError(f"floor must be <= cap; got floor={floor!r}, cap={cap!r}")
    return mk


def importance_weights(
    log_ratio: Tensor,
    mask: Tensor,
    *,
    level: str = "token",
    cap: float | None = None,
    floor: float | None = None,
    action: str = "truncate",
    batch_normalize: bool = False,
    all_reduce: Callable[[Tensor], Tensor] | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Detached behavioural weights w = exp(clamp(lr, ±20)) at ``level``, bounded to [floor, cap].

    token: w_t = exp(lr_t); sequence: w = exp(Σ_t lr_t) and geometric: w = exp(mean_t lr_t),
    broadcast over the row. ``truncate`` clamps into [floor, cap]; ``mask`` sets weights outside
    to 0. ``batch_normalize`` then divides by the mean weight (docs/math.md §2). Padding is 0.
    ``all_reduce`` (a sum over data-parallel shards) makes that mean the whole batch's.
    Metrics: mean/std/min/max/ESS describe the returned weights, fractions the raw ones.
    Its arguments are checked here (``_check_weight_args``), the public entry point; the
    trainer's come from the config's loss.* keys, validated there.
    """
    mk = _check_weight_args(log_ratio, mask, level, cap, floor, action)
    with torch.no_grad():
        lr = mk.select(log_ratio.detach())
        level_raw = torch.exp(_level_log_ratio(lr, mk, level).clamp(-LOG_CLAMP, LOG_CLAMP))
        # One bound decision per token (token level) or per sequence (sequence, geometric).
        high = level_raw > cap if cap is not None else None
        low = level_raw < floor if floor is not None else None
        out = high if low is None else low if high is None else high | low
        if out is None:
            level_weight = level_raw
        elif action == "mask":
            level_weight = keep(level_raw, ~out)
        else:
            level_weight = level_raw.clamp(min=floor, max=cap)
        if level != "token":
            level_weight = level_weight.unsqueeze(-1).expand_as(lr)
        weights = mk.select(level_weight)
        seq_weight = mk.row_mean(weights)

        factor = None
        if batch_normalize:
            if level == "token":
                total, among = weights.sum(), mk.token_count
            else:
                total, among = (seq_weight * mk.row_weight).sum(), mk.row_total
            if all_reduce is not None:
                dtype = torch.promote_types(total.dtype, among.dtype)
                total, among = all_reduce(torch.stack([total.to(dtype), among.to(dtype)])).unbind()
            mean = total / among.clamp_min(1)
            # Nothing to normalise when every weight is 0 or the batch is empty: factor 1.
            factor = torch.where(mean > 0, mean, 1.0)
            weights = weights / factor  # a 0-d factor keeps the dtype of the weights
            seq_weight = seq_weight / factor

        stats = mk.stats(weights)
        stats.update({f"seq_{name}": value for name, value in mk.row_stats(seq_weight).items()})
        if batch_normalize:
            stats["factor"] = factor
        # Bound fractions count raw weights: valid tokens at token level, non-empty rows at the
        # sequence levels (rollout_is_seq_* use each row's mean raw weight).
        if level == "token":
            among, seq_raw = mk.valid, mk.row_mean(mk.select(level_raw))
        else:
            among, seq_raw = mk.rows, level_raw
        counts = {"tokens": mk.token_count, "rows": mk.row_total}
        if high is not None:
            counts["high"] = count(high & among)
            counts["seq_high"] = count((seq_raw > cap) & mk.rows)
        if low is not None:
            counts["low"] = count(low & among)
            counts["seq_low"] = count((seq_raw < floor) & mk.rows)
        if action == "mask" and out is not None:
            # Tokens whose weight was masked to 0 (a masked sequence counts all its tokens).
            counts["masked"] = (
                count(out & mk.valid)
                if level == "token"
                else (as_float(out, mk.row_count.dtype) * mk.row_count).sum()
            )
        host = to_host({**stats, **counts})
    return weights, _is_metrics(host, level, action, batch_normalize)


def _is_metrics(
    host: dict[str, float], level: str, action: str, batch_normalize: bool
) -> dict[str, float]:
    """Name the importance-weight statistics as verl does (docs/math.md §2.3)."""
    tokens, rows = max(host["tokens"], 1.0), max(host["rows"], 1.0)
    among = tokens if level == "token" else rows
    mean, std = host["mean"], host["std"]
    # ESS = 1 / mean((w / mean w)²) = mean² / (mean² + std²); 1 for an empty batch and
    # 0 when every weight is 0 (no effective sample left).
    if host["tokens"] == 0:
        ess = 1.0
    else:
        ess = mean * mean / (mean * mean + std * std) if mean > 0 else 0.0
    seq_mean, seq_std = host["seq_mean"], host["seq_std"]
    if host["rows"] == 0:
        seq_ess = 1.0
    else:
        seq_ess = seq_mean * seq_mean / (seq_mean * seq_mean + seq_std * seq_std) if seq_mean > 0 else 0.0
    metrics = {
        "rollout_is_mean": mean,
        "rollout_is_std": std,
        "rollout_is_min": host["min"],
        "rollout_is_max": host["max"],
        "rollout_is_eff_sample_size": ess,
        # over sequences, each weighing its mean token weight: at the sequence and geometric
        # levels every token of a sequence has its weight, so this is the per-sequence ESS
        "rollout_is_seq_eff_sample_size": seq_ess,
        "rollout_is_ratio_fraction_high": host.get("high", 0.0) / among,
        "rollout_is_ratio_fraction_low": host.get("low", 0.0) / among,
        "rollout_is_seq_mean": seq_mean,
        "rollout_is_seq_std": seq_std,
        "rollout_is_seq_min": host["seq_min"],
        "rollout_is_seq_max": host["seq_max"],
        "rollout_is_seq_fraction_high": host.get("seq_high", 0.0) / rows,
        "rollout_is_seq_fraction_low": host.get("seq_low", 0.0) / rows,
    }
    if action == "mask":
        metrics["rollout_is_masked_fraction"] = host.get("masked", 0.0) / tokens
    if batch_normalize:
        metrics["rollout_is_batch_norm_factor"] = host["factor"]
    return metrics


def _divergence(lr: Tensor, metric: str) -> Tensor:
    """verl's per-token divergence estimates from lr = log π_x − log π_behav clamped to ±20
    (docs/math.md §3): k2 = ½ lr², k3 = e^lr − 1 − lr (computed as expm1(lr) − lr)."""
    x = lr.clamp(-LOG_CLAMP, LOG_CLAMP)
    return 0.5 * x.square() if metric == "k2" else torch.expm1(x) - x


def _rejection_statistic(lr: Tensor, mk: Masked, level: str, metric: str) -> Tensor:
    """What rejection bounds, per token [B, T] or per sequence [B] (docs/math.md §3): the ratio
    exp(s) with s as for a weight, or a divergence summed (sequence), averaged (geometric) or
    maximised (max) over the row's valid tokens. ``lr`` must already be 0 at padding."""
    if metric == "ratio":
        return torch.exp(_level_log_ratio(lr, mk, level).clamp(-LOG_CLAMP, LOG_CLAMP))
    per_token = mk.select(_divergence(lr, metric))
    if level == "token":
        return per_token
    if level == "max":  # every estimate is ≥ 0 and padding is 0, so an empty row gives 0
        return per_token.amax(-1) if per_token.shape[-1] else per_token.sum(-1)
    total = per_token.sum(-1)
    return total if level == "sequence" else total / mk.row_divisor.to(total.dtype)


def _check_rejection_args(
    log_ratio: Tensor,
    mask: Tensor,
    level: str | None,
    upper: float | None,
    lower: float | None,
    veto: float | None,
    metric: str,
) -> tuple[Masked, float | None]:
    """``rejection_mask``'s boundary: ValueError naming the first bad argument; the wrapped mask
    and the lower bound in use (a ratio's defaults to 1/upper)."""
    check_choice("metric", metric, REJECTION_METRICS)
    if level is None:
        if upper is not None or lower is not None:
            raise ValueError(f"upper and lower need a level; got upper={upper!r}, lower={lower!r}")
        if veto is None:
            raise ValueError("rejection_mask needs a level (with upper) or a veto")
    elif upper is None:
        raise ValueError(f"upper is required with a level; got level={level!r}")
    mk = _check_inputs(log_ratio, mask, "token" if level is None else level, REJECTION_LEVELS)
    if level == "max" and metric == "ratio":
        raise ValueError("level='max' takes a sequence's largest divergence; use metric='k2' or 'k3'")
    if level is not None:
        check_number("upper", upper, above=0)
        if metric != "ratio":
            if lower is not None:
                raise ValueError(f"metric={metric!r} is a divergence, bounded above only; got lower={lower!r}")
        else:
            lower = 1.0 / upper if lower is None else lower
            check_number("lower", lower, above=0, inclusive=True)
            if lower > upper:
                raise ValueError(f"lower must be <= upper; got lower={lower!r}, upper={upper!r}")
    if veto is not None:
        check_number("veto", veto, above=0)
    return mk, lower


def rejection_mask(
    log_ratio: Tensor,
    mask: Tensor,
    *,
    level: str | None = None,
    upper: float | None = None,
    lower: float | None = None,
    veto: float | None = None,
    metric: str = "ratio",
) -> tuple[Tensor, dict[str, float]]:
    """Mask that keeps the tokens/sequences whose statistic is within bounds (docs/math.md §3).

    ``metric="ratio"``: the ratio exp(clamp(s, ±20)), s built as in ``importance_weights``, kept
    in [lower, upper] (``lower`` defaults to 1/upper). ``"k2"``/``"k3"``: verl's divergence
    estimates of lr, kept where ≤ ``upper`` (nats; no lower bound), per token or aggregated per
    sequence by ``level`` (sequence: sum, geometric: mean, max: max). ``veto`` drops every
    sequence holding a valid token with raw lr < log(veto); with ``level`` None the veto is the
    only test (verl's token veto, which needs no bounds). The result has the dtype of ``mask``;
    it does not depend on any weight. Its arguments are checked here (``_check_rejection_args``),
    the public entry point; the trainer's come from loss.rejection, validated by the config.
    """
    mk, lower = _check_rejection_args(log_ratio, mask, level, upper, lower, veto, metric)
    with torch.no_grad():
        lr = mk.select(log_ratio.detach())
        stats: dict[str, Tensor] = {}
        if level is None:
            kept = torch.ones_like(mk.valid)
        else:
            # per token, or per row at the sequence levels
            statistic = _rejection_statistic(lr, mk, level, metric)
            kept = statistic <= upper if lower is None else (statistic >= lower) & (statistic <= upper)
            stats = (
                mk.stats(statistic, with_std=False)
                if level == "token"
                else mk.row_stats(statistic, with_std=False)
            )
        counts = {"tokens": mk.token_count, "rows": mk.row_total}
        if veto is not None:
            # The veto reads the raw (unclamped) log ratio of every valid token.
            catastrophic = (lr < math.log(veto)) & mk.valid
            vetoed = _any_row(catastrophic)
            kept = kept & (~vetoed if level not in (None, "token") else ~vetoed.unsqueeze(-1))
            counts["vetoed"] = count(vetoed)
            counts["catastrophic"] = count(catastrophic)
        if level in (None, "token"):
            dropped = mk.valid & ~kept
            counts["kept"] = mk.token_count - count(dropped)
            counts["seq_dropped"] = count(_any_row(dropped))
        else:
            # Whole rows are kept or dropped: count in rows and in the rows' tokens.
            kept_weight = as_float(kept, mk.row_count.dtype)
            counts["kept"] = (mk.row_count * kept_weight).sum()
            counts["seq_dropped"] = mk.row_total - (mk.row_weight * kept_weight).sum()
            kept = kept.unsqueeze(-1)
        new_mask = mask * as_float(kept, mask.dtype) if mask.is_floating_point() else mask & kept
        host = to_host({**stats, **counts})
    tokens, rows = max(host["tokens"], 1.0), max(host["rows"], 1.0)
    metrics = {
        "rollout_rs_masked_fraction": (host["tokens"] - host["kept"]) / tokens,
        "rollout_rs_seq_masked_fraction": host["seq_dropped"] / rows,
        "rollout_rs_veto_fraction": host.get("vetoed", 0.0) / rows,
        "rollout_rs_catastrophic_token_fraction": host.get("catastrophic", 0.0) / tokens,
    }
    if level is not None:
        metrics.update(
            rollout_rs_mean=host["mean"], rollout_rs_min=host["min"], rollout_rs_max=host["max"]
        )
    return new_mask, metrics


def second_moment_mask(log_ratio: Tensor, mask: Tensor, threshold: float) -> tuple[Tensor, dict[str, float]]:
    """M2PO's token mask (docs/math.md §9.2; arXiv 2510.01161, AReaL ``m2_threshold``): drop the
    valid tokens with the largest squared log ratio lr², fewest first, until the mean lr² of the
    tokens kept is below ``threshold`` (strictly); at least one token is kept.

    With the kept values sorted ascending, their running means never decrease, so the kept set is
    the longest prefix whose mean is below the threshold. The result has the dtype of ``mask``.
    """
    mk = masked(mask, log_ratio, "log_ratio")
    with torch.no_grad():
        m2 = mk.select(log_ratio.detach()).square()
        flat_valid = mk.valid.flatten()
        values = m2.flatten()[flat_valid].double()
        n = values.numel()
        kept_flat = torch.zeros_like(flat_valid)
        before = after = 0.0
        if n:
            ascending, order = torch.sort(values, stable=True)
            running_mean = ascending.cumsum(0) / torch.arange(1, n + 1, dtype=ascending.dtype)
            keep_n = max(int((running_mean < threshold).sum()), 1)
            positions = flat_valid.nonzero().squeeze(-1)
            kept_flat[positions[order[:keep_n]]] = True
            before, after = float(values.mean()), float(running_mean[keep_n - 1])
        kept = kept_flat.view_as(mk.valid)
        new_mask = mask * as_float(kept, mask.dtype) if mask.is_floating_point() else mask & kept
        masked_n = n - int(kept.sum())
    return new_mask, {
        "m2_before": before,
        "m2_after": after,
        "masked_fraction": masked_n / max(n, 1),
    }


def off_policy_sequence_mask(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, delta: float
) -> tuple[Tensor, dict[str, float]]:
    """OPSM's loss multiplier (docs/math.md §9.4; DeepSeek-V3.2 Eq. 9, TRL
    ``off_policy_mask_threshold``): 0 on the negative-advantage tokens of every sequence whose
    D_i = mean_t(log π_behav − log π_θ) over its valid tokens exceeds ``delta``, 1 elsewhere.

    π_θ is read detached, at the optimizer step it is called for. The caller multiplies the
    behavioural weight by the result, so a dropped token stays in the loss denominator (as in
    TRL and slime). Padding is 0.
    """
    mk = masked(mask, logprobs, "logprobs")
    with torch.no_grad():
        divergence = mk.row_mean(mk.select(old_logprobs - logprobs.detach()))  # D_i, [B]
        dropped = (divergence > delta).unsqueeze(-1) & (mk.select(advantages.detach()) < 0) & mk.valid
        multiplier = mk.select(as_float(~dropped, logprobs.dtype))
        host = to_host(
            {
                "dropped": count(dropped),
                "seq_dropped": count(_any_row(dropped)),
                "tokens": mk.token_count,
                "rows": mk.row_total,
                "divergence": mk.rows_mean(divergence),
            }
        )
    return multiplier, {
        "masked_fraction": host["dropped"] / max(host["tokens"], 1.0),
        "seq_masked_fraction": host["seq_dropped"] / max(host["rows"], 1.0),
        "seq_kl_mean": host["divergence"],
    }


def loglinear_proximal(
    old_logprobs: Tensor, logprobs: Tensor, lag: Tensor, mask: Tensor
) -> tuple[Tensor, dict[str, float]]:
    """A-3PO's π_prox without a forward (docs/math.md §9.7; arXiv 2512.06547, AReaL
    ``prox_logp_method: loglinear``), detached:

        log π̂_prox = log π_behav + α·(log π_θ − log π_behav),  α = clamp((k − 1)/k, 0, 1)

    for a token k = c − v versions stale (α = 0 for k ≤ 1: a fresh or one-step-stale token is
    anchored at π_behav). ``logprobs`` is the training forward's π_θ at this optimizer step.
    Returns log π̂_prox (0 at padding) and the mean α over valid tokens.
    """
    mk = masked(mask, logprobs, "logprobs")
    with torch.no_grad():
        k = lag.to(logprobs.dtype)
        alpha = mk.select(((k - 1) / k.clamp_min(1)).clamp(0, 1))
        old = mk.select(old_logprobs)
        proximal = old + alpha * (mk.select(logprobs.detach()) - old)
        host = to_host({"alpha": mk.mean(alpha)})
    return proximal, {"alpha_mean": host["alpha"]}
