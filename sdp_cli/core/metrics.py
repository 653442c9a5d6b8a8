"""Off-policy diagnostics between the rollout and the training policy (docs/math.md §4).

Names and definitions follow verl's ``compute_offpolicy_metrics`` so dashboards compare across
frameworks; the differences (row statistics over non-empty rows only, a clamped k3, defined
values for an empty batch) are listed in docs/math.md §4.
"""

from __future__ import annotations

import torch
from torch import Tensor

from sdp_cli.core._masked import (
    LOG_CLAMP,
    check_2d,
    check_float_tensor,
    check_like,
    extremes,
    masked,
    to_host,
)
from sdp_cli.core.weights import importance_weights

#: the keys of ``offpolicy_metrics``, in its order
OFFPOLICY_METRIC_NAMES = (
    "kl",
    "k3_kl",
    "training_ppl",
    "training_log_ppl",
    "rollout_ppl",
    "rollout_log_ppl",
    "log_ppl_diff",
    "log_ppl_abs_diff",
    "log_ppl_diff_max",
    "log_ppl_diff_min",
    "ppl_ratio",
    "chi2_token",
    "chi2_seq",
)

_EXP_OF_ZERO = ("training_ppl", "rollout_ppl", "ppl_ratio")


def offpolicy_metrics(
    rollout_logprobs: Tensor, training_logprobs: Tensor, mask: Tensor
) -> dict[str, float]:
    """verl's mismatch metrics between π_rollout (the sampler) and π_train (docs/math.md §4).

    With lr = log π_train − log π_rollout over valid tokens: kl = mean(−lr), k3_kl =
    mean(e^lr − 1 − lr), chi2_token = mean(e^{2 lr}) − 1, chi2_seq = mean_rows(e^{2 Σ lr}) − 1,
    and per-row perplexities exp(−mean log π) averaged over rows with ≥ 1 valid token.
    """
    check_float_tensor("rollout_logprobs", rollout_logprobs)
    check_2d("rollout_logprobs", rollout_logprobs)
    check_like("training_logprobs", training_logprobs, rollout_logprobs, "rollout_logprobs")
    mk = masked(mask, rollout_logprobs, "rollout_logprobs")

    with torch.no_grad():
        rollout = mk.select(rollout_logprobs.detach())
        training = mk.select(training_logprobs.detach())
        log_ratio = training - rollout
        safe = log_ratio.clamp(-LOG_CLAMP, LOG_CLAMP)
        train_mean = mk.row_mean(training)
        rollout_mean = mk.row_mean(rollout)
        diff = rollout_mean - train_mean
        # Per-row values, averaged over non-empty rows in one reduction: −a_i, −b_i (log ppl),
        # d_i, 2·Σ_t lr (clamped), |d_i|, e^{−a_i}, e^{−b_i}, e^{d_i}, e^{2Σ lr} − 1.
        logs = torch.stack(
            [-train_mean, -rollout_mean, diff, 2 * log_ratio.sum(-1).clamp(-LOG_CLAMP, LOG_CLAMP)]
        )
        per_row = torch.cat([logs, diff.abs().unsqueeze(0), logs[:3].exp(), torch.expm1(logs[3:])])
        row_sums = (per_row * mk.row_weight).sum(-1)
        diff_min, diff_max = extremes(diff, mk.row_weight, row_sums[2] / mk.n_rows)
        # e^x − 1 − x as expm1(x) − x and e^{2x} − 1 as expm1(x)·(expm1(x) + 2): no
        # cancellation at small x, and both are 0 at padding, where x = 0.
        em1 = torch.expm1(safe)
        host = to_host(
            {
                "tokens": mk.token_count,
                "rows": mk.row_total,
                "lr": log_ratio.sum(),
                "k3": (em1 - safe).sum(),
                "chi2": (em1 * (em1 + 2)).sum(),
                "diff_min": diff_min,
                "diff_max": diff_max,
                "row_sums": row_sums,
            }
        )
    if host["tokens"] == 0:
        # No valid token: no divergence, and every perplexity (ratio) is exp(0) = 1.
        return {name: 1.0 if name in _EXP_OF_ZERO else 0.0 for name in OFFPOLICY_METRIC_NAMES}
    tokens, rows = host["tokens"], host["rows"]
    (
        train_log_ppl,
        rollout_log_ppl,
        diff_sum,
        _,
        abs_diff,
        train_ppl,
        rollout_ppl,
        ratio,
        chi2_seq,
    ) = (value / rows for value in host["row_sums"])
    return {
        "kl": -host["lr"] / tokens,  # mean(log π_rollout − log π_train)
        "k3_kl": host["k3"] / tokens,
        "training_ppl": train_ppl,
        "training_log_ppl": train_log_ppl,
        "rollout_ppl": rollout_ppl,
        "rollout_log_ppl": rollout_log_ppl,
        "log_ppl_diff": diff_sum,
        "log_ppl_abs_diff": abs_diff,
        "log_ppl_diff_max": host["diff_max"],
        "log_ppl_diff_min": host["diff_min"],
        "ppl_ratio": ratio,
        "chi2_token": host["chi2"] / tokens,
        "chi2_seq": chi2_seq,
    }


def lag_weight_stats(log_ratio: Tensor, selected: Tensor, lag: Tensor) -> dict[int, dict[str, float]]:
    """Per lag ℓ = c − v among the ``selected`` tokens: the raw token weight w = exp(clamp(lr, ±20))
    (``importance_weights`` at token level, unbounded) and its log, as

        tokens, mean, std (population), ess = mean² / (mean² + std²), log_mean = mean(lr)

    log_mean is AReaL's behave_approx_kl sign convention, mean(log π_x − log π_behav). Lags with no
    selected token are absent. The trainer's ``shadow/<mode>/lag<ℓ>/*`` metrics and the
    inspect-weights staleness table both come from here (docs/training.md, docs/inspect-weights.md).
    """
    out: dict[int, dict[str, float]] = {}
    for value in torch.unique(lag[selected]).tolist():
        sel = selected & (lag == value)
        metrics = importance_weights(log_ratio, sel, level="token")[1]
        out[int(value)] = {
            "tokens": float(sel.sum()),
            "mean": metrics["rollout_is_mean"],
            "std": metrics["rollout_is_std"],
            "ess": metrics["rollout_is_eff_sample_size"],
            "log_mean": float(log_ratio[sel].mean()),
        }
    return out


def lag0_mismatch(engine_logprobs: Tensor, trainer_logprobs: Tensor, selected: Tensor) -> dict[str, float]:
    """The engine/trainer numeric mismatch on the same tokens (docs/training.md "Run directory"): over the
    ``selected`` tokens, with d = log π_trainer − log π_engine (clamped to ±20 before exp),

        tokens, abs_mean = mean |d|, abs_max = max |d|, k3_kl = mean(e^d − 1 − d)

    k3_kl is Schulman's k3 estimator of KL(π_engine ‖ π_trainer) from tokens the engine sampled:
    unbiased, and ≥ 0 token by token. The trainer passes its lag-0 tokens (version = its own), where
    both sides hold the same weights, so d is numerics alone. No selected token: ``{"tokens": 0}``.
    Computed in float64: d is ~1e-7 between two float32 forwards, and k3 ≈ d²/2.
    """
    d = (trainer_logprobs.detach()[selected].double() - engine_logprobs.detach()[selected].double())
    if d.numel() == 0:
        return {"tokens": 0.0}
    safe = d.clamp(-LOG_CLAMP, LOG_CLAMP)
    host = to_host(
        {"abs_mean": d.abs().mean(), "abs_max": d.abs().max(), "k3_kl": (torch.expm1(safe) - safe).mean()}
    )
    return {"tokens": float(d.numel()), **host}
