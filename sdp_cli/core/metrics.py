"""Off-policy diagnostics between the rollout and the training policy (docs/math.md §4).

Names and definitions follow verl's ``compute_offpolicy_metrics`` so dashboards compare across
frameworks; the differences (row statistics over non-empty rows only, a clamped k3, defined
values for an empty batch) are listed in docs/math.md §4.
"""

from __future__ import annotations

import torch
from torch import Tensor

from sdp_cli.core._masked import LOG_CLAMP, check_2d, check_float_tensor, check_like, masked, to_host

_NAMES = (
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


def offpolicy_metrics(rollout_logprobs: Tensor, training_logprobs: Tensor, mask: Tensor) -> dict[str, float]:
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
        # expm1(x) − x is e^x − 1 − x without the cancellation at small x; both it and
        # expm1(2x) = e^{2x} − 1 (chi2_token) are 0 at padding, where x = 0.
        k3 = torch.expm1(safe) - safe
        seq_log_ratio = log_ratio.sum(-1).clamp(-LOG_CLAMP, LOG_CLAMP)

        train_mean = mk.row_mean(training)
        rollout_mean = mk.row_mean(rollout)
        diff = rollout_mean - train_mean
        diff_stats = mk.row_stats(diff, with_std=False)
        # The per-row quantities averaged over non-empty rows, in one reduction.
        row_names = (
            "training_ppl",
            "training_log_ppl",
            "rollout_ppl",
            "rollout_log_ppl",
            "log_ppl_abs_diff",
            "ppl_ratio",
            "chi2_seq",
        )
        row_means = mk.rows_mean(
            torch.stack(
                [
                    torch.exp(-train_mean),
                    -train_mean,
                    torch.exp(-rollout_mean),
                    -rollout_mean,
                    diff.abs(),
                    torch.exp(diff),
                    torch.expm1(2 * seq_log_ratio),
                ]
            )
        )
        host = to_host(
            {
                "tokens": mk.token_count,
                "kl": -mk.mean(log_ratio),
                "k3_kl": mk.mean(k3),
                "log_ppl_diff": diff_stats["mean"],
                "log_ppl_diff_max": diff_stats["max"],
                "log_ppl_diff_min": diff_stats["min"],
                "chi2_token": mk.mean(torch.expm1(2 * safe)),
                **dict(zip(row_names, row_means.unbind(), strict=True)),
            }
        )
    if host.pop("tokens") == 0:
        # No valid token: no divergence, and every perplexity (ratio) is exp(0) = 1.
        return {name: 1.0 if name in _EXP_OF_ZERO else 0.0 for name in _NAMES}
    return {name: host[name] for name in _NAMES}
