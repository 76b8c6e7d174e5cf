"""Built-in rewards, the registry that names them, and the weighted sum a recipe configures.

How a term's values are checked, averaged over frames and normalized within groups is in
:mod:`unirl_pl.rewards.terms`; its public names are importable from here too, as they always were.
"""

from __future__ import annotations

import importlib
import inspect
import io
import math
from collections.abc import Callable
from functools import partial
from typing import Any, Literal

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from unirl_pl.rewards.metadata import Metadata, accepts_metadata
from unirl_pl.rewards.terms import (
    RewardFn,
    RewardTerms,
    as_values,
    frame_mean,
    group_normalize,
    is_real,
    term_stats,
    unique_prompt_groups,
)

# The names other modules (the experience source, the reward server) and tests import from here.
__all__ = [
    "REGISTRY",
    "Brightness",
    "ContainsWord",
    "RefinerFormat",
    "RewardFn",
    "RewardTerms",
    "WeightedSum",
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


class Brightness:
    """Mean pixel intensity in [0, 1] (optionally of one channel): a reward a generator can move quickly.

    Args:
        channel: 0/1/2 for red/green/blue only, or None for all channels.
    """

    def __init__(self, channel: int | None = None) -> None:
        if channel is not None and channel not in (0, 1, 2):
            raise ValueError(f"channel must be 0, 1, 2 or None, got {channel}")
        self.channel = channel

    def __call__(self, prompts: list[str], refined_prompts: list[str], images: Tensor) -> list[float]:
        x = images.float() if self.channel is None else images[:, self.channel : self.channel + 1].float()
        return x.mean(dim=(1, 2, 3)).tolist()


class ContainsWord:
    """1 if the refined prompt contains ``word`` as a whole word, else 0: a reward the refiner can learn.

    Args:
        word: The target word (matched case-insensitively).
    """

    def __init__(self, word: str = "red") -> None:
        if not word.strip() or " " in word.strip():
            raise ValueError(f"word must be a single non-empty word, got {word!r}")
        self.word = word.strip().lower()

    def __call__(self, prompts: list[str], refined_prompts: list[str], images: Tensor) -> list[float]:
        return [float(self.word in r.lower().split()) for r in refined_prompts]


class RefinerFormat:
    """Format/length reward for refinements: 1 inside ``[min_words, max_words]``, decaying outside.

    A refinement that repeats a word more than ``max_repeats`` times scores 0, which stops the
    refiner from collapsing into a repeated token.

    Args:
        min_words: Fewest words of a well-formed refinement.
        max_words: Most words of a well-formed refinement.
        max_repeats: Most occurrences of any one word.
    """

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


REGISTRY: dict[str, Callable[..., RewardFn]] = {
    "jpeg_compressibility": lambda: jpeg_compressibility,
    "jpeg_incompressibility": lambda: jpeg_incompressibility,
    "brightness": Brightness,
    "contains_word": ContainsWord,
    "refiner_format": RefinerFormat,
}


def _shapes_geneval(**kwargs: Any) -> RewardFn:
    from unirl_pl.rewards.shapes import ShapesGenEval

    return ShapesGenEval(**kwargs)


REGISTRY["shapes_geneval"] = _shapes_geneval


def _ocr(**kwargs: Any) -> RewardFn:
    # Imported on use: rapidocr-onnxruntime is an optional extra (pip install -e .[ocr]).
    from unirl_pl.rewards.ocr import OCRReward

    return OCRReward(**kwargs)


def _http(**kwargs: Any) -> RewardFn:
    from unirl_pl.rewards.http import HTTPReward

    return HTTPReward(**kwargs)


REGISTRY["ocr"] = _ocr
REGISTRY["http"] = _http


def _lazy(module: str, attr: str) -> Callable[..., RewardFn]:
    """A factory that imports ``module.attr`` only when a recipe names it (model libraries load slowly)."""

    def factory(**kwargs: Any) -> RewardFn:
        return getattr(importlib.import_module(module), attr)(**kwargs)

    factory.__name__ = attr
    return factory


REGISTRY["pickscore"] = _lazy("unirl_pl.rewards.clip_models", "PickScore")
REGISTRY["clip_score"] = _lazy("unirl_pl.rewards.clip_models", "CLIPScore")
REGISTRY["aesthetic"] = _lazy("unirl_pl.rewards.clip_models", "Aesthetic")
REGISTRY["hpsv2"] = _lazy("unirl_pl.rewards.hpsv2", "HPSv2")
REGISTRY["vlm_judge"] = _lazy("unirl_pl.rewards.vlm_judge", "VLMJudge")


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


class WeightedSum:
    """The scalar reward: ``sum_i w_i * reward_i``, keeping each term's values for logging.

    Every term's values are checked: a value that is not a real number (a string, None, a bool) is an
    error naming the reward and the value's type; a NaN or infinite value is an error naming the reward
    and the sample's prompt, or with ``nonfinite="drop"`` makes that sample's total NaN (the caller drops
    it) and is counted in :attr:`dropped`.

    With ``normalize="group"`` each term is normalized within its group before weighting (PromptRL's and
    verl-omni's way of combining rewards on different scales: a PickScore near 22 and an OCR score in
    [0, 1] then weigh as their weights say, not as their units do). The returned total stays the raw
    weighted sum (logged, and what validation reports); the normalized one is the parts' ``combined``.

    Per-sample ``metadata`` (each prompt's row of a JSONL prompt file: :mod:`unirl_pl.rewards.metadata`) goes
    only to the terms whose callable declares a ``metadata`` parameter; the others are called as before.

    Args:
        weights: Reward name (registry key or dotted path) -> weight.
        reward_args: Reward name -> constructor keyword arguments, for rewards that take some.
        nonfinite: ``error`` (stop at a NaN/inf reward) or ``drop`` (the sample's total is NaN).
        normalize: ``none`` or ``group``: centre each term within its group (the samples of one prompt) and
            scale it by its std over the batch before weighting (:func:`group_normalize`).
    """

    def __init__(
        self,
        weights: dict[str, float],
        reward_args: dict[str, dict[str, Any]] | None = None,
        nonfinite: Literal["error", "drop"] = "error",
        normalize: Literal["none", "group"] = "none",
    ) -> None:
        if not weights:
            raise ValueError("at least one reward is needed")
        if nonfinite not in ("error", "drop"):
            raise ValueError(f"nonfinite must be 'error' or 'drop', got {nonfinite!r}")
        if normalize not in ("none", "group"):
            raise ValueError(f"reward normalization must be 'none' or 'group', got {normalize!r}")
        reward_args = reward_args or {}
        stray = set(reward_args) - set(weights)
        if stray:
            raise ValueError(f"reward_args given for rewards not in the weights: {sorted(stray)}")
        bad_weights = {n: w for n, w in weights.items() if not is_real(w) or not math.isfinite(w)}
        if bad_weights:
            raise ValueError(f"reward weights must be finite numbers, got {bad_weights}")
        self.weights = dict(weights)
        self.nonfinite = nonfinite
        self.normalize = normalize
        self.dropped = 0  # samples whose total was set to NaN (nonfinite="drop"), over this object's life
        self.terms = {name: resolve_reward(name, reward_args.get(name)) for name in weights}
        # name -> (the term's callable, whether it declares ``metadata``): its signature is read once, and read
        # again only if the term is replaced after construction.
        self._wants: dict[str, tuple[RewardFn, bool]] = {}

    def wants_metadata(self, name: str) -> bool:
        """Whether term ``name`` declares a ``metadata`` parameter (and so is given each sample's)."""
        fn = self.terms[name]
        known = self._wants.get(name)
        if known is None or known[0] is not fn:
            known = self._wants[name] = (fn, accepts_metadata(fn))
        return known[1]

    def score_term(
        self,
        name: str,
        prompts: list[str],
        refined_prompts: list[str],
        images: Tensor,
        metadata: list[Metadata] | None = None,
    ) -> Tensor:
        """One term's raw values (N,) float32 on CPU; videos go frame by frame unless the reward reads them."""
        fn = self.terms[name]
        video = images.ndim == 5 and not getattr(fn, "accepts_video", False)
        if metadata is not None and self.wants_metadata(name):
            if len(metadata) != len(prompts):
                raise ValueError(f"reward {name!r}: {len(metadata)} metadata items for {len(prompts)} samples")
            # Frame by frame, every frame of a video is scored with its video's metadata.
            frames = images.shape[1] if video else 1
            fn = partial(fn, metadata=[m for m in metadata for _ in range(frames)])
        if video:
            return frame_mean(name, fn, prompts, refined_prompts, images)
        return as_values(name, fn(prompts, refined_prompts, images), len(prompts), "samples")

    def __call__(
        self,
        prompts: list[str],
        refined_prompts: list[str],
        images: Tensor,
        *,
        groups: Tensor | None = None,
        pending: dict[str, Callable[[], Tensor]] | None = None,
        batch_std: Callable[[Tensor], Tensor | None] | None = None,
        metadata: list[Metadata] | None = None,
    ) -> tuple[Tensor, RewardTerms]:
        """Return (total (N,), {name: raw values (N,)}); a reward returning the wrong count is an error.

        For videos (N, F, 3, H, W) an image reward scores every frame and the video gets the frames' mean.
        With ``nonfinite="drop"`` a sample with a NaN/inf term has total NaN (its raw terms are kept).
        ``groups`` (N,) are the samples' group ids for ``normalize="group"`` (default: samples with the
        same prompt form a group). ``pending`` holds terms already being scored (during decode): name ->
        a function returning their values, called here instead of the reward. ``batch_std`` returns a term's
        std over every rank (None on one process), the scale of ``normalize="group"``. ``metadata`` (N,) is each
        sample's prompt metadata, given to the terms that declare a ``metadata`` parameter.
        """
        pending = pending or {}
        parts = RewardTerms()
        for name in self.terms:
            if name in pending:
                parts[name] = as_values(name, pending[name](), len(prompts), "samples")
            else:
                parts[name] = self.score_term(name, prompts, refined_prompts, images, metadata)
        bad = torch.zeros(len(prompts), dtype=torch.bool)
        for name, values in parts.items():
            nonfinite = ~torch.isfinite(values)
            if nonfinite.any() and self.nonfinite == "error":
                i = int(nonfinite.nonzero()[0])
                raise ValueError(
                    f"reward {name!r} returned {values[i].item()} for sample {i} (prompt {prompts[i]!r}, "
                    f"refined {refined_prompts[i]!r}); {int(nonfinite.sum())} of {len(values)} values are not "
                    "finite. Fix the reward, or set nonfinite='drop' to leave such samples out"
                )
            bad |= nonfinite
        total = self._combine(parts, bad, None)
        parts.combined = total
        if self.normalize == "group":
            if groups is None:
                _, groups = unique_prompt_groups(prompts)
            parts.combined = self._combine(parts, bad, groups, batch_std)
        if bad.any():
            self.dropped += int(bad.sum())
        return total, parts

    def _combine(
        self,
        parts: dict[str, Tensor],
        bad: Tensor,
        groups: Tensor | None,
        batch_std: Callable[[Tensor], Tensor | None] | None = None,
    ) -> Tensor:
        """The weighted sum of the terms (group-normalized first when ``groups`` is given); NaN where bad."""
        total = torch.zeros(len(bad), dtype=torch.float32)
        for name, values in parts.items():
            v = torch.where(bad, torch.nan, values)
            if groups is not None:
                # Every rank takes part in the gather; a dropped sample enters it at the mean of the kept ones.
                kept = v[~bad]
                filled = torch.where(bad, kept.mean() if len(kept) else 0.0, v)
                v = group_normalize(v, groups, batch_std(filled) if batch_std is not None else None)
            total = total + self.weights[name] * torch.where(bad, 0.0, v)
        return torch.where(bad, torch.nan, total) if bad.any() else total
