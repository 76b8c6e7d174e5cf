"""Rewards: typed callables ``reward(prompts, refined_prompts, images) -> list[float]``.

``images`` is a float tensor (N, 3, H, W) in [0, 1]; ``prompts`` are the original user prompts and
``refined_prompts`` what the generator was conditioned on; a reward that declares a ``metadata``
parameter also gets each sample's prompt metadata (:mod:`unirl_pl.rewards.metadata`), one that declares
``replies`` the refiner's raw reply of each sample (:mod:`unirl_pl.rewards.replies`), one that declares ``sources``
an editing sample's source image (:mod:`unirl_pl.rewards.sources`). A recipe names
rewards as components (``class_path`` + ``init_args`` + ``weight``: :class:`RewardTerm` of a :class:`Reward`)
or in the short form, registry names or dotted paths (``mypkg.rewards.my_reward``) with a weight each; their
weighted sum is the scalar the advantages are computed from (after per-term group normalization when asked).
Preference scorers run in process (``clip_models``, ``hpsv2``, ``hpsv3``, ``imagereward``; ``clip_directional``
for edits), VLM judges over an OpenAI-compatible API (``vlm_judge``; ``edit_judge`` for edits), anything else
behind the reference server (``server``, ``http``).
"""

from unirl_pl.rewards.base import Reward, RewardTerm
from unirl_pl.rewards.builtin import (
    REGISTRY,
    Brightness,
    ContainsWord,
    JPEGCompressibility,
    JPEGIncompressibility,
    PromptRLEditFormat,
    PromptRLFormat,
    RefinerFormat,
    RewardFn,
    RewardTerms,
    jpeg_compressibility,
    jpeg_incompressibility,
    registered_rewards,
    resolve_reward,
)
from unirl_pl.rewards.clip_directional import CLIPDirectional
from unirl_pl.rewards.clip_models import Aesthetic, CLIPScore, PickScore
from unirl_pl.rewards.edit_judge import EditJudge
from unirl_pl.rewards.hpsv2 import HPSv2
from unirl_pl.rewards.hpsv3 import HPSv3
from unirl_pl.rewards.http import HTTPReward, RewardServerError
from unirl_pl.rewards.imagereward import ImageReward
from unirl_pl.rewards.ocr import OCRReward
from unirl_pl.rewards.shapes import ShapesGenEval
from unirl_pl.rewards.shapes_edit import ShapesEdit
from unirl_pl.rewards.vlm_judge import VLMJudge
from unirl_pl.rewards.weighted import WeightedSum

__all__ = [
    "REGISTRY",
    "Aesthetic",
    "Brightness",
    "CLIPDirectional",
    "CLIPScore",
    "ContainsWord",
    "EditJudge",
    "HPSv2",
    "HPSv3",
    "HTTPReward",
    "ImageReward",
    "JPEGCompressibility",
    "JPEGIncompressibility",
    "OCRReward",
    "PickScore",
    "PromptRLEditFormat",
    "PromptRLFormat",
    "RefinerFormat",
    "Reward",
    "RewardFn",
    "RewardServerError",
    "RewardTerm",
    "RewardTerms",
    "ShapesEdit",
    "ShapesGenEval",
    "VLMJudge",
    "WeightedSum",
    "jpeg_compressibility",
    "jpeg_incompressibility",
    "registered_rewards",
    "resolve_reward",
]
