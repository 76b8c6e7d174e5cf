"""Group statistics of one step's rewards as pure functions: group-relative advantages, which groups carry a
reward spread, and the fraction that do not.
"""

from __future__ import annotations

import torch
from torch import Tensor


def group_advantages(
    rewards: Tensor,
    group_ids: Tensor,
    *,
    global_std: bool = False,
    batch_std: Tensor | float | None = None,
    eps: float = 1e-4,
    clip_max: float = 5.0,
) -> Tensor:
    """Group-relative advantages ``(r - mean_group) / (std + eps)``, clipped to ``+-clip_max``.

    ``std`` is the group's (population) std, or the whole batch's with ``global_std`` (Flow-GRPO's
    option that keeps zero-variance groups from blowing up). With several ranks the caller passes the
    std of all ranks' rewards as ``batch_std`` so every rank normalizes by the same number.
    ``group_ids`` is a (N,) integer tensor; groups need not be contiguous.
    """
    if rewards.shape != group_ids.shape or rewards.ndim != 1:
        raise ValueError(f"rewards {tuple(rewards.shape)} and group_ids {tuple(group_ids.shape)} must be (N,)")
    r = rewards.double()
    _, inverse = torch.unique(group_ids, return_inverse=True)
    n_groups = int(inverse.max()) + 1
    count = torch.zeros(n_groups, dtype=r.dtype, device=r.device).index_add_(0, inverse, torch.ones_like(r))
    total = torch.zeros_like(count).index_add_(0, inverse, r)
    mean = (total / count)[inverse]
    if global_std:
        std = (r.std(unbiased=False) if batch_std is None else torch.as_tensor(batch_std, dtype=r.dtype)).expand_as(r)
    else:
        sq = torch.zeros_like(count).index_add_(0, inverse, (r - mean) ** 2)
        std = torch.sqrt(sq / count)[inverse]
    adv = (r - mean) / (std + eps)
    return adv.clamp(-clip_max, clip_max).to(rewards.dtype)


def informative_groups(rewards: Tensor, groups: Tensor, tol: float = 1e-8) -> Tensor:
    """(G,) bool over the group ids ``0..max(groups)``: which have a reward spread (population std) above ``tol``.

    ``rewards`` and ``groups`` are per sample; a group with one sample, with all rewards equal, or with no
    sample has none. A non-finite spread counts as a spread (it is not a group of equal rewards).
    """
    count = int(groups.max()) + 1 if groups.numel() else 0
    rewards, groups = rewards.double().cpu(), groups.cpu()
    n = torch.zeros(count, dtype=torch.float64).index_add_(0, groups, torch.ones_like(rewards))
    mean = torch.zeros(count, dtype=torch.float64).index_add_(0, groups, rewards) / n.clamp_min(1)
    var = torch.zeros(count, dtype=torch.float64).index_add_(0, groups, (rewards - mean[groups]) ** 2) / n.clamp_min(1)
    return ~(var.sqrt() <= tol)


def zero_std_fraction(rewards: Tensor, group_ids: Tensor, tol: float = 1e-8) -> float:
    """Fraction of the groups present whose rewards are all equal: they carry no learning signal."""
    present = torch.bincount(group_ids.cpu()) > 0 if group_ids.numel() else torch.zeros(0, dtype=torch.bool)
    flat = ~informative_groups(rewards, group_ids, tol)[present]
    return int(flat.sum()) / len(flat) if len(flat) else 0.0
