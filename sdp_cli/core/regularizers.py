"""Regularisers added to the policy loss: KL to a frozen reference policy and an entropy bonus
(docs/math.md §8).

The KL estimators are those of verl's ``kl_penalty`` (after Schulman, "Approximating KL
divergence", 2020), evaluated at the sampled tokens with d = log π_θ − log π_ref:

    k1 = d                  unbiased for KL(π_θ ‖ π_ref), can be negative
    k2 = ½ d²               biased, but its gradient is the KL's expected gradient
    k3 = e^{−d} + d − 1     unbiased, ≥ 0, low variance; −d is clamped to ±20 before exp
                            and the result to [−10, 10] (``low_var_kl`` is the same estimator)

Both terms are reduced with the policy loss's aggregation (``loss.agg``) over the same tokens.
"""

from __future__ import annotations

import torch
from torch import Tensor

from sdp_cli.choices import KL_TYPES
from sdp_cli.core._masked import LOG_CLAMP, check_choice, check_float_tensor, check_like, check_number
from sdp_cli.core.loss import aggregate_loss

#: bound of the k3 estimate, as in verl (stops one wild token from dominating the loss)
KL_CLAMP = 10.0


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, kl_type: str = "low_var_kl") -> Tensor:
    """Per-token estimate of KL(π_θ ‖ π_ref) at the sampled tokens (module docstring).

    Differentiable in ``logprobs``; ``ref_logprobs`` is treated as a constant.
    """
    check_float_tensor("logprobs", logprobs)
    check_like("ref_logprobs", ref_logprobs, logprobs, "logprobs")
    check_choice("kl_type", kl_type, KL_TYPES)
    diff = logprobs - ref_logprobs.detach()
    if kl_type == "k1":
        return diff
    if kl_type == "k2":
        return 0.5 * diff.square()
    neg = (-diff).clamp(-LOG_CLAMP, LOG_CLAMP)
    return (torch.exp(neg) - neg - 1).clamp(-KL_CLAMP, KL_CLAMP)


def regularizer_loss(
    logprobs: Tensor,
    mask: Tensor,
    *,
    ref_logprobs: Tensor | None = None,
    entropy: Tensor | None = None,
    kl_coef: float = 0.0,
    kl_type: str = "low_var_kl",
    entropy_coef: float = 0.0,
    agg: str = "token-mean",
    denominator: float | Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """kl_coef·agg(k) − entropy_coef·agg(H) over the valid tokens of ``mask`` (docs/math.md §8).

    ``ref_logprobs`` is needed when kl_coef > 0 and ``entropy`` (H of π_θ per token, with its
    gradient) when entropy_coef > 0; whichever is given is also reported as a metric
    (``kl_ref``, ``entropy``: the aggregated values before the coefficient). ``denominator`` is
    the policy loss's (``aggregate_loss``): the count of the whole minibatch across data-parallel
    shards, or the seq-mean-token-sum-norm constant. Returns a 0-d tensor to add to the policy
    loss (0 when both coefficients are 0) and the metrics.
    """
    check_number("kl_coef", kl_coef, above=0, inclusive=True)
    check_number("entropy_coef", entropy_coef, above=0, inclusive=True)
    if kl_coef > 0 and ref_logprobs is None:
        raise ValueError("kl_coef > 0 needs ref_logprobs (log-probs of the reference policy)")
    if entropy_coef > 0 and entropy is None:
        raise ValueError("entropy_coef > 0 needs entropy (the policy's entropy per token)")
    term = logprobs.new_zeros(())
    metrics: dict[str, float] = {}
    if ref_logprobs is not None:
        kl = aggregate_loss(kl_penalty(logprobs, ref_logprobs, kl_type), mask, agg, denominator=denominator)
        metrics["kl_ref"] = float(kl.detach())
        if kl_coef > 0:
            term = term + kl_coef * kl
    if entropy is not None:
        check_like("entropy", entropy, logprobs, "logprobs")
        ent = aggregate_loss(entropy, mask, agg, denominator=denominator)
        metrics["entropy"] = float(ent.detach())
        if entropy_coef > 0:
            term = term - entropy_coef * ent
    return term, metrics
