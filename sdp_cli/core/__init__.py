"""Pure-torch correction math of sdp (docs/design.md §4, docs/math.md): no I/O, no config objects.

weights      behavioural log ratio per mode, importance weights, rejection masks
loss         PPO-clip / REINFORCE policy loss and its aggregations
metrics      verl-named off-policy diagnostics (kl, k3_kl, ppl family, chi2)
logprobs     chunked log-probabilities and entropy from logits or from hidden states
advantages   GRPO / Dr.GRPO group-normalised advantages
regularizers KL to a reference policy (verl's k1/k2/k3 estimators) and the entropy bonus
"""

from sdp_cli.core.advantages import group_advantages
from sdp_cli.core.logprobs import logprobs_from_hidden, logprobs_from_logits
from sdp_cli.core.loss import aggregate_loss, loss_count, policy_loss
from sdp_cli.core.metrics import offpolicy_metrics
from sdp_cli.core.regularizers import kl_penalty, regularizer_loss
from sdp_cli.core.weights import behavior_log_ratio, importance_weights, rejection_mask

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
