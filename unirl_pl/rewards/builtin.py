"""Built-in rewards and the registry of short names (aliases of the component classes).

The weighted sum a recipe configures is :mod:`unirl_pl.rewards.weighted`; how a term's values are checked,
averaged over frames and normalized within groups is in :mod:`unirl_pl.rewards.terms` (its public names are
importable from here too, as they always were).
"""

from __future__ import annotations

import importlib
import inspect
import io
import math
import re
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from unirl_pl.rewards.base import Reward
from unirl_pl.rewards.replies import Reply
from unirl_pl.rewards.sources import Source, unique_sources
from unirl_pl.rewards.terms import (
    RewardFn,
    RewardTerms,
    group_normalize,
    term_stats,
    unique_prompt_groups,
)

# The names other modules (the experience source, the reward server) and tests import from here.
__all__ = [
    "REGISTRY",
    "Brightness",
    "ContainsWord",
    "PromptRLEditFormat",
    "PromptRLFormat",
    "RefinerFormat",
    "RewardFn",
    "RewardTerms",
    "group_normalize",
    "jpeg_compressibility",
    "jpeg_incompressibility",
    "registered_rewards",
    "resolve_reward",
    "term_stats",
    "unique_prompt_groups",
]


def _to_uint8(images: Tensor) -> np.ndarray:
    arr = (images.detach().float().clamp(0, 1) * 255).round().to(torch.uint8)
    return arr.permute(0, 2, 3, 1).cpu().numpy()


def _jpeg_kb(images: Tensor, quality: int = 95) -> list[float]:
    sizes = []
    for img in _to_uint8(images):
        buf = io.BytesIO()
        Image.fromarray(img).save(buf, format="JPEG", quality=quality)
        sizes.append(buf.tell() / 1000)
    return sizes


def jpeg_compressibility(prompts: list[str], refined_prompts: list[str], images: Tensor) -> list[float]:
    """DDPO's compressibility: minus the JPEG size (kB, quality 95) of each image; simpler images score higher."""
    return [-s for s in _jpeg_kb(images)]


def jpeg_incompressibility(prompts: list[str], refined_prompts: list[str], images: Tensor) -> list[float]:
    """DDPO's incompressibility: the JPEG size (kB, quality 95); detailed images score higher."""
    return _jpeg_kb(images)


class JPEGCompressibility(Reward):
    """DDPO's compressibility as a component: minus the JPEG size (kB, quality 95); simpler images score higher."""

    name = "jpeg_compressibility"

    def __call__(self, prompts: list[str], refined_prompts: list[str], images: Tensor) -> list[float]:
        return jpeg_compressibility(prompts, refined_prompts, images)


class JPEGIncompressibility(Reward):
    """DDPO's incompressibility as a component: the JPEG size (kB, quality 95); detailed images score higher."""

    name = "jpeg_incompressibility"

    def __call__(self, prompts: list[str], refined_prompts: list[str], images: Tensor) -> list[float]:
        return jpeg_incompressibility(prompts, refined_prompts, images)


class Brightness(Reward):
    """Mean pixel intensity in [0, 1] (optionally of one channel): a reward a generator can move quickly.

    Args:
        channel: 0/1/2 for red/green/blue only, or None for all channels.
    """

    name = "brightness"

    def __init__(self, channel: int | None = None) -> None:
        if channel is not None and channel not in (0, 1, 2):
            raise ValueError(f"channel must be 0, 1, 2 or None, got {channel}")
        self.channel = channel

    def __call__(self, prompts: list[str], refined_prompts: list[str], images: Tensor) -> list[float]:
        x = images.float() if self.channel is None else images[:, self.channel : self.channel + 1].float()
        return x.mean(dim=(1, 2, 3)).tolist()


class ContainsWord(Reward):
    """1 if the refined prompt contains ``word`` as a whole word, else 0: a reward the refiner can learn.

    Args:
        word: The target word (matched case-insensitively).
    """

    name = "contains_word"

    def __init__(self, word: str = "red") -> None:
        if not word.strip() or " " in word.strip():
            raise ValueError(f"word must be a single non-empty word, got {word!r}")
        self.word = word.strip().lower()

    def __call__(self, prompts: list[str], refined_prompts: list[str], images: Tensor) -> list[float]:
        return [float(self.word in r.lower().split()) for r in refined_prompts]


class RefinerFormat(Reward):
    """Format/length reward for refinements: 1 inside ``[min_words, max_words]``, decaying outside.

    A refinement that repeats a word more than ``max_repeats`` times scores 0, which stops the
    refiner from collapsing into a repeated token.

    Args:
        min_words: Fewest words of a well-formed refinement.
        max_words: Most words of a well-formed refinement.
        max_repeats: Most occurrences of any one word.
    """

    name = "refiner_format"

    def __init__(self, min_words: int = 3, max_words: int = 16, max_repeats: int = 3) -> None:
        if not 0 < min_words <= max_words:
            raise ValueError(f"need 0 < min_words <= max_words, got {min_words}, {max_words}")
        self.min_words, self.max_words, self.max_repeats = min_words, max_words, max_repeats

    def __call__(self, prompts: list[str], refined_prompts: list[str], images: Tensor) -> list[float]:
        scores = []
        for text in refined_prompts:
            words = text.split()
            if words and max(words.count(w) for w in set(words)) > self.max_repeats:
                scores.append(0.0)
                continue
            n = len(words)
            gap = self.min_words - n if n < self.min_words else max(0, n - self.max_words)
            scores.append(math.exp(-gap / 2))
        return scores


class PromptRLFormat(Reward):
    """PromptRL's format reward: 1.0 when the refiner's raw reply holds a closed ``<answer>...</answer>`` (its
    ``format_reward``: ``re.search`` of ``<answer>.*?</answer>`` across lines), else 0.0.

    It reads the reply before parsing (the ``replies`` keyword, :mod:`unirl_pl.rewards.replies`): the refined
    prompt has lost its tags by then. PromptRL refines every sample; here a sample that kept the original prompt
    (``num_skip_refinement``) has no reply and scores ``unrefined``, 1.0 by default, so this term only ever
    marks a malformed reply down and never moves an unrefined sample's advantage (nor its image's) against
    the refined ones. Validation and ``predict`` pass the greedy replies too; a caller that passes none gets
    the refined prompts read in their place (0 for refinements parsed out of tags).

    Args:
        tag: The tag name (``answer``: ``<answer>...</answer>``).
        unrefined: The value of a sample the refiner did not refine.
    """

    name = "promptrl_format"

    def __init__(self, tag: str = "answer", unrefined: float = 1.0) -> None:
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.-]*", tag):
            raise ValueError(f"tag must be a tag name such as 'answer' (no brackets or spaces), got {tag!r}")
        if not math.isfinite(unrefined):
            raise ValueError(f"unrefined must be a finite number, got {unrefined}")
        self.tag, self.unrefined = tag, float(unrefined)
        self._pattern = re.compile(f"<{re.escape(tag)}>.*?</{re.escape(tag)}>", re.DOTALL)

    def __call__(
        self,
        prompts: list[str],
        refined_prompts: list[str],
        images: Tensor,
        replies: list[Reply] | None = None,
    ) -> list[float]:
        texts: list[Reply] = list(refined_prompts) if replies is None else list(replies)
        return [self.unrefined if t is None else float(self._pattern.search(t) is not None) for t in texts]


class PromptRLEditFormat(PromptRLFormat):
    """PromptRL's format reward as its *edit* trainer gives it: a refined sample scores its own reply (1.0 when it
    holds a closed ``<answer>...</answer>``, as :class:`PromptRLFormat`), and a sample that kept the original
    instruction scores the mean of its group's refined samples (``no_refined`` when none of the group was refined).

    G-U-N/UniRL @53c28c9: the pattern is ``format_reward`` of ``unirl/train_edit.py`` (the same as the text-to-image
    one), and ``EditJointGRPOTrainer.compute_rewards`` (``unirl/trainer/edit_grpo_trainer.py``, the ``format``
    branch) fills each prompt's unrefined rows with its refined rows' mean, 0.0 for a prompt without any. An
    unrefined sample then sits at its group's mean of this term: the term moves only the refined samples'
    advantages against each other, never the unrefined ones' against the refined, whatever ``unrefined`` value
    :class:`PromptRLFormat` would have fixed.

    A group is the samples of one instruction and one source image (the ``sources`` keyword; an edit prompt file
    may give one instruction to several images); without sources, of one instruction. A caller that passes no
    replies gets the refined prompts read as every sample's reply (as :class:`PromptRLFormat`).

    Args:
        tag: The tag name (``answer``: ``<answer>...</answer>``).
        no_refined: The value of the samples of a group none of which was refined.
    """

    name = "promptrl_edit_format"

    def __init__(self, tag: str = "answer", no_refined: float = 0.0) -> None:
        super().__init__(tag=tag)
        if not math.isfinite(no_refined):
            raise ValueError(f"no_refined must be a finite number, got {no_refined}")
        self.no_refined = float(no_refined)

    def __call__(  # type: ignore[override]
        self,
        prompts: list[str],
        refined_prompts: list[str],
        images: Tensor,
        replies: list[Reply] | None = None,
        sources: list[Source] | None = None,
    ) -> list[float]:
        if replies is None:
            return super().__call__(prompts, refined_prompts, images)
        own = [None if r is None else float(self._pattern.search(r) is not None) for r in replies]
        present = [s for s in sources or [] if s is not None]
        _, index = unique_sources(present)
        where = iter(index)
        picture = [None if sources is None or s is None else next(where) for s in sources or [None] * len(prompts)]
        refined: dict[tuple[str, int | None], list[float]] = {}
        for prompt, key, score in zip(prompts, picture, own, strict=True):
            if score is not None:
                refined.setdefault((prompt, key), []).append(score)
        out = []
        for prompt, key, score in zip(prompts, picture, own, strict=True):
            group = refined.get((prompt, key))
            out.append(score if score is not None else sum(group) / len(group) if group else self.no_refined)
        return out


REGISTRY: dict[str, Callable[..., RewardFn]] = {
    "jpeg_compressibility": JPEGCompressibility,
    "jpeg_incompressibility": JPEGIncompressibility,
    "brightness": Brightness,
    "contains_word": ContainsWord,
    "refiner_format": RefinerFormat,
    "promptrl_format": PromptRLFormat,
    "promptrl_edit_format": PromptRLEditFormat,
}


def _lazy(module: str, attr: str) -> Callable[..., RewardFn]:
    """A factory that imports ``module.attr`` only when a recipe names it (model libraries load slowly)."""

    def factory(**kwargs: Any) -> RewardFn:
        return getattr(importlib.import_module(module), attr)(**kwargs)

    factory.__name__ = attr
    factory.__module__ = module
    return factory


# The short names, each an alias of a component class (its ``name``); imported on first use (the OCR extra is
# optional, and model libraries load slowly).
REGISTRY["shapes_geneval"] = _lazy("unirl_pl.rewards.shapes", "ShapesGenEval")
REGISTRY["shapes_edit"] = _lazy("unirl_pl.rewards.shapes_edit", "ShapesEdit")
REGISTRY["ocr"] = _lazy("unirl_pl.rewards.ocr", "OCRReward")
REGISTRY["http"] = _lazy("unirl_pl.rewards.http", "HTTPReward")
REGISTRY["pickscore"] = _lazy("unirl_pl.rewards.clip_models", "PickScore")
REGISTRY["clip_score"] = _lazy("unirl_pl.rewards.clip_models", "CLIPScore")
REGISTRY["aesthetic"] = _lazy("unirl_pl.rewards.clip_models", "Aesthetic")
REGISTRY["hpsv2"] = _lazy("unirl_pl.rewards.hpsv2", "HPSv2")
REGISTRY["hpsv3"] = _lazy("unirl_pl.rewards.hpsv3", "HPSv3")
REGISTRY["imagereward"] = _lazy("unirl_pl.rewards.imagereward", "ImageReward")
REGISTRY["vlm_judge"] = _lazy("unirl_pl.rewards.vlm_judge", "VLMJudge")
REGISTRY["edit_judge"] = _lazy("unirl_pl.rewards.edit_judge", "EditJudge")
REGISTRY["clip_directional"] = _lazy("unirl_pl.rewards.clip_directional", "CLIPDirectional")


def registered_rewards() -> list[str]:
    """The names a recipe can use without a dotted path, sorted."""
    return sorted(REGISTRY)


def resolve_reward(name: str, kwargs: dict[str, Any] | None = None) -> RewardFn:
    """A reward from its registry name or dotted path; classes are instantiated with ``kwargs``.

    A dotted path to a plain function uses it as is (``kwargs`` must then be empty).
    """
    kwargs = dict(kwargs or {})
    if name in REGISTRY:
        factory = REGISTRY[name]
    elif "." in name:
        module_name, _, attr = name.rpartition(".")
        try:
            module = importlib.import_module(module_name)
        except ImportError as err:
            raise ValueError(
                f"reward {name!r}: cannot import module {module_name!r} ({err}); is it installed or on PYTHONPATH?"
            ) from None
        try:
            factory = getattr(module, attr)
        except AttributeError:
            raise ValueError(f"reward {name!r}: module {module_name!r} has no attribute {attr!r}") from None
        if not callable(factory):
            raise ValueError(f"reward {name!r} is not a function or class (type {type(factory).__name__})")
        if not inspect.isclass(factory):
            if kwargs:
                raise ValueError(f"reward {name!r} is a function; it takes no reward_args")
            return factory
    else:
        known = ", ".join(sorted(REGISTRY))
        raise ValueError(f"unknown reward {name!r}; built-in rewards are {known}, or give a dotted path")
    try:
        reward = factory(**kwargs)
    except TypeError as err:
        raise ValueError(f"reward {name!r}: bad reward_args {kwargs}: {err}") from None
    if not callable(reward):
        raise ValueError(
            f"reward {name!r}: its instances (type {type(reward).__name__}) are not callable; a reward class needs "
            "__call__(prompts, refined_prompts, images) returning one number per sample"
        )
    return reward
