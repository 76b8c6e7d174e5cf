"""The advantage scheme with its settings, over the group layout of one step (:mod:`unirl_pl.layout`).

A step holds P prompts; each gets K text samples (the first ``num_skip_refinement`` keep the original
prompt, the rest are refined by the LM), and each text sample gets M images. The LM's group is the
prompt; the DiT's group is the prompt (``shared``, PromptRL: one advantage per sample for both experts)
or the refinement (``hierarchical``: M images of one text compete with each other).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from unirl_pl.group_stats import group_advantages
from unirl_pl.layout import GroupLayout


@dataclass(frozen=True)
class AdvantageConfig:
    """How rewards become advantages.

    Args:
        scheme: ``shared``: one advantage per sample, grouped by prompt, feeds both experts (PromptRL).
            ``hierarchical``: the LM's advantage is grouped by prompt over the mean image reward of each
            refinement, the DiT's is grouped by refinement over its M images (needs M >= 2).
        global_std: Normalize by the whole batch's reward std (all ranks) instead of each group's.
        clip_max: Clip advantages to ``[-clip_max, clip_max]``.
    """

    scheme: Literal["shared", "hierarchical"] = "shared"
    global_std: bool = False
    clip_max: float = 5.0

    def __post_init__(self) -> None:
        if self.scheme not in ("shared", "hierarchical"):
            raise ValueError(f"advantage scheme must be 'shared' or 'hierarchical', got {self.scheme!r}")
        if self.clip_max <= 0:
            raise ValueError(f"advantage clip_max must be > 0, got {self.clip_max}")


def check_scheme(config: AdvantageConfig, layout: GroupLayout) -> None:
    """Refuse a scheme the layout cannot support: ``hierarchical`` groups M images of one refinement."""
    if config.scheme == "hierarchical" and layout.images_per_refinement < 2:
        raise ValueError(
            "model.advantage.scheme 'hierarchical' groups the DiT by refinement: it needs "
            f"data.images_per_refinement >= 2, got {layout.images_per_refinement}"
        )


def fill_dropped(rewards: Tensor, groups: Tensor) -> tuple[Tensor, Tensor]:
    """Non-finite rewards replaced by their group's mean finite reward (0 for a group with none), and the
    mask of the replaced ones.

    A filled sample sits exactly at its group's mean, so its advantage is 0 and the others' are those of
    the group without it, up to the std, which the filled value does not widen.
    """
    bad = ~torch.isfinite(rewards)
    if not bool(bad.any()):
        return rewards, bad
    _, inverse = torch.unique(groups, return_inverse=True)
    good = (~bad).to(rewards.dtype)
    zeros = torch.zeros(int(inverse.max()) + 1, dtype=rewards.dtype)
    total = zeros.index_add(0, inverse, torch.where(bad, torch.zeros_like(rewards), rewards))
    count = zeros.index_add(0, inverse, good)
    mean = (total / count.clamp_min(1))[inverse]
    return torch.where(bad, mean, rewards), bad


def drop_rewards(rewards: Tensor, layout: GroupLayout, p: int, groups: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(image_rewards, text_rewards, dropped)`` with the non-finite image rewards left out of their groups.

    A text sample's reward is the mean of its kept images, or its prompt's mean (over texts) when none is
    kept. A dropped image sits at the mean of the kept rewards of ``groups``, its group for the DiT's
    advantage (the prompt for ``shared``, the text sample for ``hierarchical``), so it adds nothing to that
    group's mean or squared deviations; when its group kept none it sits at its text's reward.
    """
    m = layout.images_per_refinement
    dropped = ~torch.isfinite(rewards)
    kept = (~dropped).view(-1, m)
    text_rewards = torch.where(dropped, torch.zeros_like(rewards), rewards).view(-1, m).sum(1)
    text_rewards = (text_rewards / kept.sum(1).clamp_min(1)).masked_fill(~kept.any(1), torch.nan)
    text_rewards, _ = fill_dropped(text_rewards, layout.text_prompt(p))
    images, _ = fill_dropped(rewards, groups)
    _, inverse = torch.unique(groups, return_inverse=True)
    none_kept = torch.zeros(int(inverse.max()) + 1).index_add(0, inverse, (~dropped).float())[inverse] == 0
    images = torch.where(none_kept, text_rewards[layout.image_text(p)], images)
    return images, text_rewards, dropped


def text_advantages(
    text_rewards: Tensor,
    layout: GroupLayout,
    p: int,
    config: AdvantageConfig,
    batch_std: Callable[[Tensor], Tensor | None],
    dropped: Tensor,
) -> Tensor:
    """The LM's (P*K,) advantages from its text samples' rewards, grouped by prompt; exactly 0 for a text none
    of whose images was kept (``dropped``: the (P*K*M,) dropped images of :func:`compute_advantages`)."""
    # Exact zeros: the group means of filled values agree with them only up to rounding.
    text_dropped = dropped.view(-1, layout.images_per_refinement).all(1)
    std = batch_std(text_rewards) if config.global_std else None
    advantages = group_advantages(
        text_rewards, layout.text_prompt(p), batch_std=std, global_std=config.global_std, clip_max=config.clip_max
    )
    return advantages.masked_fill(text_dropped, 0.0)


def compute_advantages(
    rewards: Tensor,
    layout: GroupLayout,
    p: int,
    config: AdvantageConfig,
    batch_std: Callable[[Tensor], Tensor | None],
    drop_nonfinite: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(text_rewards, text_advantages, image_advantages, dropped)`` from the (P*K*M,) image rewards.

    ``batch_std`` returns the std of the global batch (all ranks) for ``global_std``, or None on one process.
    With ``drop_nonfinite`` a non-finite reward is left out of its groups (:func:`drop_rewards`; ``dropped``
    marks it) and its advantage is exactly 0, as is the LM's for a text with no image kept; otherwise it
    propagates, and the step's non-finite loss skips the update.
    """
    check_scheme(config, layout)
    m = layout.images_per_refinement
    prompt_of_text, img_text = layout.text_prompt(p), layout.image_text(p)
    # The DiT's group: the prompt (shared, PromptRL) or the refinement (hierarchical: M images of one text).
    groups = prompt_of_text[img_text] if config.scheme == "shared" else img_text
    dropped = torch.zeros_like(rewards, dtype=torch.bool)
    text_rewards = rewards.view(-1, m).mean(1)
    if drop_nonfinite and not bool(torch.isfinite(rewards).all()):
        rewards, text_rewards, dropped = drop_rewards(rewards, layout, p, groups)
    text_adv = text_advantages(text_rewards, layout, p, config, batch_std, dropped)
    kwargs = {"global_std": config.global_std, "clip_max": config.clip_max}
    if config.scheme == "shared" and m == 1:
        # PromptRL: literally one advantage per sample for both experts.
        return text_rewards, text_adv, text_adv, dropped
    std = batch_std(rewards) if config.global_std else None
    image_adv = group_advantages(rewards, groups, batch_std=std, **kwargs).masked_fill(dropped, 0.0)
    return text_rewards, text_adv, image_adv, dropped
