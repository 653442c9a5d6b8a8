"""Every ValueError path of sdp_cli.core names the offending argument."""

import pytest
import torch

from sdp_cli.core import (
    aggregate_loss,
    behavior_log_ratio,
    group_advantages,
    importance_weights,
    logprobs_from_logits,
    loss_count,
    offpolicy_metrics,
    policy_loss,
    rejection_mask,
)

X = torch.zeros(2, 3)
M = torch.ones(2, 3)
X64 = torch.zeros(2, 3, dtype=torch.float64)
LOGITS = torch.zeros(2, 3, 5)
TARGETS = torch.zeros(2, 3, dtype=torch.long)

CASES = {
    # behavior_log_ratio
    "mode unknown": (lambda: behavior_log_ratio(X, X, mode="recompute"), "mode"),
    "old not a tensor": (lambda: behavior_log_ratio([0.0], X, mode="decoupled"), "old_logprobs"),
    "old integer": (
        lambda: behavior_log_ratio(torch.zeros(2, dtype=torch.long), mode="bypass"),
        "old_logprobs",
    ),
    "decoupled without prox": (
        lambda: behavior_log_ratio(X, mode="decoupled"),
        "proximal_logprobs is required",
    ),
    "segment_wise without prox_t": (
        lambda: behavior_log_ratio(X, X, mode="segment_wise"),
        "proximal_logprobs_t is required",
    ),
    "prox shape": (
        lambda: behavior_log_ratio(X, torch.zeros(2, 4), mode="decoupled"),
        "proximal_logprobs has shape",
    ),
    "prox_t dtype": (
        lambda: behavior_log_ratio(X, None, X64, mode="segment_wise"),
        "proximal_logprobs_t has dtype",
    ),
    # importance_weights
    "log_ratio integer": (
        lambda: importance_weights(torch.zeros(2, 3, dtype=torch.long), M),
        "log_ratio",
    ),
    "log_ratio 1-D": (
        lambda: importance_weights(torch.zeros(3), torch.ones(3)),
        r"log_ratio must be a \[B, T\]",
    ),
    "mask shape": (lambda: importance_weights(X, torch.ones(2, 4)), "mask has shape"),
    "mask not a tensor": (
        lambda: importance_weights(X, [[1, 1, 1]]),
        "mask must be a torch.Tensor",
    ),
    "mask values": (lambda: importance_weights(X, M * 0.5), "mask must contain only 0 and 1"),
    "mask nan": (
        lambda: importance_weights(X, torch.full((2, 3), float("nan"))),
        "mask must contain only 0 and 1",
    ),
    "mask int values": (
        lambda: importance_weights(X, torch.full((2, 3), 2)),
        "mask must contain only 0 and 1",
    ),
    "mask complex": (
        lambda: importance_weights(X, torch.ones(2, 3, dtype=torch.complex64)),
        "mask must be bool",
    ),
    "level": (lambda: importance_weights(X, M, level="row"), "level"),
    "action": (lambda: importance_weights(X, M, action="clip"), "action"),
    "cap zero": (lambda: importance_weights(X, M, cap=0.0), "cap must be > 0"),
    "cap nan": (lambda: importance_weights(X, M, cap=float("nan")), "cap must be a finite number"),
    "cap bool": (lambda: importance_weights(X, M, cap=True), "cap must be a finite number"),
    "floor negative": (lambda: importance_weights(X, M, floor=-0.1), "floor must be >= 0"),
    "floor above cap": (
        lambda: importance_weights(X, M, cap=1.0, floor=2.0),
        "floor must be <= cap",
    ),
    # rejection_mask
    "rs upper zero": (lambda: rejection_mask(X, M, level="token", upper=0.0), "upper must be > 0"),
    "rs upper none": (
        lambda: rejection_mask(X, M, level="token", upper=None),
        "upper is required with a level",
    ),
    "rs lower negative": (
        lambda: rejection_mask(X, M, level="token", upper=2.0, lower=-1.0),
        "lower must be >= 0",
    ),
    "rs lower above upper": (
        lambda: rejection_mask(X, M, level="token", upper=2.0, lower=3.0),
        "lower must be <= upper",
    ),
    "rs veto zero": (
        lambda: rejection_mask(X, M, level="token", upper=2.0, veto=0.0),
        "veto must be > 0",
    ),
    "rs level": (lambda: rejection_mask(X, M, level="tok", upper=2.0), "level"),
    "rs nothing to reject": (lambda: rejection_mask(X, M), r"needs a level \(with upper\) or a veto"),
    "rs bounds without level": (
        lambda: rejection_mask(X, M, upper=2.0, veto=0.1),
        "upper and lower need a level",
    ),
    # offpolicy_metrics
    "rollout integer": (
        lambda: offpolicy_metrics(torch.zeros(2, 3, dtype=torch.long), X, M),
        "rollout_logprobs",
    ),
    "rollout 1-D": (
        lambda: offpolicy_metrics(torch.zeros(3), torch.zeros(3), torch.ones(3)),
        r"rollout_logprobs must be a \[B, T\]",
    ),
    "training shape": (
        lambda: offpolicy_metrics(X, torch.zeros(3, 2), M),
        "training_logprobs has shape",
    ),
    "training dtype": (lambda: offpolicy_metrics(X, X64, M), "training_logprobs has dtype"),
    # policy_loss
    "logprobs 1-D": (
        lambda: policy_loss(torch.zeros(3), torch.zeros(3), torch.zeros(3), torch.ones(3)),
        r"logprobs must be a \[B, T\]",
    ),
    "proximal shape": (
        lambda: policy_loss(X, torch.zeros(2, 2), X, M),
        "proximal_logprobs has shape",
    ),
    "advantages dtype": (lambda: policy_loss(X, X, X64, M), "advantages has dtype"),
    "weights shape": (lambda: policy_loss(X, X, X, M, weights=torch.zeros(3)), "weights has shape"),
    "loss mask": (lambda: policy_loss(X, X, X, torch.ones(3, 2)), "mask has shape"),
    "agg": (lambda: policy_loss(X, X, X, M, agg="sum"), "agg"),
    "loss_type": (lambda: policy_loss(X, X, X, M, loss_type="grpo"), "loss_type"),
    "clip": (lambda: policy_loss(X, X, X, M, clip=0.0), "clip must be > 0"),
    "clip_high": (lambda: policy_loss(X, X, X, M, clip_high=-0.1), "clip_high must be > 0"),
    "dual_clip": (lambda: policy_loss(X, X, X, M, dual_clip=1.0), "dual_clip must be > 1"),
    "aggregate values": (
        lambda: aggregate_loss(torch.zeros(3), torch.ones(3)),
        r"values must be a \[B, T\]",
    ),
    "aggregate agg": (lambda: aggregate_loss(X, M, "mean"), "agg"),
    "norm without its constant": (
        lambda: policy_loss(X, X, X, M, agg="seq-mean-token-sum-norm"),
        "needs its constant denominator",
    ),
    "denominator zero": (
        lambda: aggregate_loss(X, M, "token-mean", denominator=0.0),
        "denominator must be > 0",
    ),
    "denominator nan": (
        lambda: policy_loss(X, X, X, M, denominator=torch.tensor(float("nan"))),
        "denominator must be a finite number",
    ),
    "count of the norm": (
        lambda: loss_count(M, "seq-mean-token-sum-norm"),
        "divides by a constant",
    ),
    # logprobs_from_logits
    "logits integer": (
        lambda: logprobs_from_logits(torch.zeros(2, 5, dtype=torch.long), TARGETS[0]),
        "logits",
    ),
    "logits no vocab": (
        lambda: logprobs_from_logits(torch.zeros(2, 0), TARGETS[0]),
        "logits must have a non-empty vocabulary",
    ),
    "targets float": (
        lambda: logprobs_from_logits(LOGITS, TARGETS.float()),
        "targets must be an int32/int64",
    ),
    "targets shape": (lambda: logprobs_from_logits(LOGITS, TARGETS[0]), "targets has shape"),
    "targets range": (
        lambda: logprobs_from_logits(LOGITS, TARGETS + 5),
        r"targets must be token ids in \[0, 5\)",
    ),
    "targets negative": (
        lambda: logprobs_from_logits(LOGITS, TARGETS - 100),
        "targets must be token ids",
    ),
    "temperature": (
        lambda: logprobs_from_logits(LOGITS, TARGETS, temperature=0.0),
        "temperature must be > 0",
    ),
    "chunk_size": (
        lambda: logprobs_from_logits(LOGITS, TARGETS, chunk_size=0),
        "chunk_size must be a positive integer",
    ),
    "chunk_size bool": (
        lambda: logprobs_from_logits(LOGITS, TARGETS, chunk_size=True),
        "chunk_size",
    ),
    # group_advantages
    "rewards integer": (
        lambda: group_advantages(
            torch.zeros(3, dtype=torch.long), torch.zeros(3, dtype=torch.long)
        ),
        "rewards",
    ),
    "rewards 2-D": (
        lambda: group_advantages(X, torch.zeros(2, 3, dtype=torch.long)),
        "rewards must be a 1-D",
    ),
    "group_ids float": (
        lambda: group_advantages(torch.zeros(3), torch.zeros(3)),
        "group_ids must be an integer",
    ),
    "group_ids shape": (
        lambda: group_advantages(torch.zeros(3), torch.zeros(4, dtype=torch.long)),
        "group_ids has shape",
    ),
    "eps negative": (
        lambda: group_advantages(torch.zeros(3), torch.zeros(3, dtype=torch.long), eps=-1.0),
        "eps must be >= 0",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_value_error_names_the_argument(case):
    call, message = CASES[case]
    with pytest.raises(ValueError, match=message):
        call()
