"""Group-normalised outcome advantages: GRPO and Dr.GRPO (docs/math.md §7)."""

from __future__ import annotations

import torch
from torch import Tensor

from sdp_cli.core._masked import check_float_tensor, check_number


def group_advantages(
    rewards: Tensor, group_ids: Tensor, *, scale_by_std: bool = True, eps: float = 1e-6
) -> Tensor:
    """Per-sample advantage within its group of samples for the same prompt.

    GRPO: (r − mean_g) / (std_g + eps) with the unbiased (Bessel-corrected) group std, as in
    verl and TRL; Dr.GRPO (``scale_by_std=False``): r − mean_g. A group of one sample has no
    baseline and gets 0. ``rewards`` and ``group_ids`` are 1-D of equal length.
    """
    check_float_tensor("rewards", rewards)
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be a 1-D tensor; got shape {tuple(rewards.shape)}")
    if not isinstance(group_ids, Tensor) or group_ids.is_floating_point() or group_ids.is_complex():
        raise ValueError(f"group_ids must be an integer tensor; got {getattr(group_ids, 'dtype', type(group_ids))}")
    if group_ids.shape != rewards.shape:
        raise ValueError(f"group_ids has shape {tuple(group_ids.shape)} but rewards has shape {tuple(rewards.shape)}")
    check_number("eps", eps, above=0, inclusive=True)

    rewards = rewards.detach()
    _, group = torch.unique(group_ids, return_inverse=True)
    n_groups = int(group.max()) + 1 if group.numel() else 0
    count = torch.zeros(n_groups, dtype=rewards.dtype, device=rewards.device).index_add_(
        0, group, torch.ones_like(rewards)
    )
    total = torch.zeros_like(count).index_add_(0, group, rewards)
    centred = rewards - (total / count)[group]
    size = count[group]
    if scale_by_std:
        # Two-pass variance (sum of squared deviations) avoids E[r²] − E[r]² cancellation.
        sq_dev = torch.zeros_like(count).index_add_(0, group, centred.square())
        std = (sq_dev / (count - 1).clamp_min(1)).sqrt()
        denom = std[group] + eps
        # With eps = 0 a group of equal rewards has std 0: its advantages are 0, not 0/0.
        centred = torch.where(denom > 0, centred / denom, 0.0)
    return torch.where(size > 1, centred, 0.0)
