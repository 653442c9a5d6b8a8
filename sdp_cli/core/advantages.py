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
    verl and TRL; Dr.GRPO (``scale_by_std=False``): r − mean_g. A group whose rewards are all
    equal (a singleton included) gets 0. ``rewards`` and ``group_ids`` are 1-D of equal length.
    """
    check_float_tensor("rewards", rewards)
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be a 1-D tensor; got shape {tuple(rewards.shape)}")
    if not isinstance(group_ids, Tensor) or group_ids.is_floating_point() or group_ids.is_complex():
        got = getattr(group_ids, "dtype", type(group_ids))
        raise ValueError(f"group_ids must be an integer tensor; got {got}")
    if group_ids.shape != rewards.shape:
        raise ValueError(
            f"group_ids has shape {tuple(group_ids.shape)} "
            f"but rewards has shape {tuple(rewards.shape)}"
        )
    check_number("eps", eps, above=0, inclusive=True)

    rewards = rewards.detach()
    _, group = torch.unique(group_ids, return_inverse=True)
    n_groups = int(group.max()) + 1 if group.numel() else 0
    per_group = torch.zeros(n_groups, dtype=rewards.dtype, device=rewards.device)
    count = per_group.index_add(0, group, torch.ones_like(rewards))
    least = per_group.scatter_reduce(0, group, rewards, "amin", include_self=False)
    # Centred on the group's least reward first: r − least is exact for rewards within a factor
    # of 2 of each other (Sterbenz). So a group whose rewards are all equal (a singleton
    # included: no signal) gets exactly 0, and rewards an ulp apart keep a mean that centres
    # them; the rounded mean of r itself can miss equal values by an ulp, or land on one of two.
    shifted = rewards - least[group]
    centred = shifted - (per_group.index_add(0, group, shifted) / count)[group]
    if scale_by_std:
        # Two-pass variance (sum of squared deviations) avoids E[r²] − E[r]² cancellation.
        std = (per_group.index_add(0, group, centred.square()) / (count - 1).clamp_min(1)).sqrt()
        denom = std[group] + eps
        # With eps = 0 an equal group's std is 0 and a tiny spread's can underflow to 0: no
        # resolvable signal, 0 (not 0/0).
        centred = torch.where(denom > 0, centred / denom, 0.0)
    return centred
