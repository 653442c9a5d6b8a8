"""Pure-torch correction math of sdp (docs/design.md §4, docs/math.md): no I/O, no config objects.

weights      behavioural log ratio per mode, importance weights, rejection masks
loss         PPO-clip / REINFORCE policy loss and its aggregations
metrics      verl-named off-policy diagnostics (kl, k3_kl, ppl family, chi2)
logprobs     chunked log-probabilities and entropy from logits or from hidden states
advantages   GRPO / Dr.GRPO group-normalised advantages
regularizers KL to a reference policy (verl's k1/k2/k3 estimators) and the entropy bonus
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # for type checkers: the names, as ``__getattr__`` gives them
    from sdp_cli.core.advantages import group_advantages
    from sdp_cli.core.logprobs import logprobs_from_hidden, logprobs_from_logits
    from sdp_cli.core.loss import aggregate_loss, loss_count, policy_loss
    from sdp_cli.core.metrics import offpolicy_metrics
    from sdp_cli.core.regularizers import kl_penalty, regularizer_loss
    from sdp_cli.core.weights import behavior_log_ratio, importance_weights, rejection_mask

# Each name imports its module when first asked for: ``token_status`` (plain Python) is read by
# the rollout process, which has no torch.
_HOME = {
    "group_advantages": "advantages",
    "logprobs_from_hidden": "logprobs",
    "logprobs_from_logits": "logprobs",
    "aggregate_loss": "loss",
    "loss_count": "loss",
    "policy_loss": "loss",
    "offpolicy_metrics": "metrics",
    "kl_penalty": "regularizers",
    "regularizer_loss": "regularizers",
    "behavior_log_ratio": "weights",
    "importance_weights": "weights",
    "rejection_mask": "weights",
}

__all__ = [
    "aggregate_loss",
    "behavior_log_ratio",
    "group_advantages",
    "importance_weights",
    "kl_penalty",
    "logprobs_from_hidden",
    "logprobs_from_logits",
    "loss_count",
    "offpolicy_metrics",
    "policy_loss",
    "regularizer_loss",
    "rejection_mask",
]


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)
