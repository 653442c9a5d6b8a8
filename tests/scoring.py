"""The reference scorer tests compare recorded log-probabilities with: each token's log-prob
under a model, from one plain full-sequence forward in float32 (no cache, no chunking)."""

from __future__ import annotations

import torch


def target_logprobs(model, ids: torch.Tensor) -> torch.Tensor:
    """log π(ids[t] | ids[:t]) for t = 1 … len(ids) − 1 (the first token has no prediction)."""
    with torch.no_grad():
        logits = model(input_ids=ids[None]).logits[0, :-1]
    return torch.log_softmax(logits.float(), -1).gather(-1, ids[1:, None])[:, 0]
