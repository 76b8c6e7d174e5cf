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
    registered_rewards,
    resolve_reward,
)
from unirl_pl.rewards.http import HTTPReward, RewardServerError
from unirl_pl.rewards.ocr import OCRReward

__all__ = [
    "REGISTRY",
    "Brightness",
    "ContainsWord",
    "HTTPReward",
    "OCRReward",
    "RefinerFormat",
    "RewardFn",
    "RewardServerError",
    "WeightedSum",
    "jpeg_compressibility",
    "jpeg_incompressibility",
    "registered_rewards",
    "resolve_reward",
]
