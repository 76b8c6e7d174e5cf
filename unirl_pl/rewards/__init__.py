"""Rewards: typed callables ``reward(prompts, refined_prompts, images) -> list[float]``.

``images`` is a float tensor (N, 3, H, W) in [0, 1]; ``prompts`` are the original user prompts and
``refined_prompts`` what the generator was conditioned on. A recipe names rewards from the
registry or by dotted path (``mypkg.rewards.my_reward``) with a weight each; their weighted sum is
the scalar the advantages are computed from.
"""

from unirl_pl.rewards.builtin import (
    REGISTRY,
    Brightness,
    ContainsWord,
    RefinerFormat,
    RewardFn,
    WeightedSum,
    jpeg_compressibility,
    jpeg_incompressibility,
    resolve_reward,
)

__all__ = [
    "REGISTRY",
    "Brightness",
    "ContainsWord",
    "RefinerFormat",
    "RewardFn",
    "WeightedSum",
    "jpeg_compressibility",
    "jpeg_incompressibility",
    "resolve_reward",
]
