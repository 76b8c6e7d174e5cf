"""Rewards: typed callables ``reward(prompts, refined_prompts, images) -> list[float]``.

``images`` is a float tensor (N, 3, H, W) in [0, 1]; ``prompts`` are the original user prompts and
``refined_prompts`` what the generator was conditioned on; a reward that declares a ``metadata``
parameter also gets each sample's prompt metadata (:mod:`unirl_pl.rewards.metadata`). A recipe names
rewards from the registry or by dotted path (``mypkg.rewards.my_reward``) with a weight each; their
weighted sum is the scalar the advantages are computed from (after per-term group normalization when asked).
Preference scorers run in process (``clip_models``, ``hpsv2``), VLM judges over an OpenAI-compatible
API (``vlm_judge``), anything else behind the reference server (``server``, ``http``).
"""

from unirl_pl.rewards.builtin import (
    REGISTRY,
    Brightness,
    ContainsWord,
    RefinerFormat,
    RewardFn,
    RewardTerms,
    WeightedSum,
    jpeg_compressibility,
    jpeg_incompressibility,
    registered_rewards,
    resolve_reward,
)
from unirl_pl.rewards.clip_models import Aesthetic, CLIPScore, PickScore
from unirl_pl.rewards.hpsv2 import HPSv2
from unirl_pl.rewards.http import HTTPReward, RewardServerError
from unirl_pl.rewards.ocr import OCRReward
from unirl_pl.rewards.vlm_judge import VLMJudge

__all__ = [
    "REGISTRY",
    "Aesthetic",
    "Brightness",
    "CLIPScore",
    "ContainsWord",
    "HPSv2",
    "HTTPReward",
    "OCRReward",
    "PickScore",
    "RefinerFormat",
    "RewardFn",
    "RewardServerError",
    "RewardTerms",
    "VLMJudge",
    "WeightedSum",
    "jpeg_compressibility",
    "jpeg_incompressibility",
    "registered_rewards",
    "resolve_reward",
]
