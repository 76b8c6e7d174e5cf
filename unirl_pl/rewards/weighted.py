"""The reward a run trains on: the weighted sum of its terms, each checked, optionally group-normalized, logged."""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from typing import Any, Literal

import torch
from torch import Tensor

from unirl_pl.rewards.base import RewardTerm
from unirl_pl.rewards.builtin import resolve_reward
from unirl_pl.rewards.metadata import Metadata, accepts_keyword
from unirl_pl.rewards.replies import Reply
from unirl_pl.rewards.sources import Source
from unirl_pl.rewards.terms import (
    RewardFn,
    RewardTerms,
    as_values,
    frame_mean,
    group_normalize,
    is_real,
    unique_prompt_groups,
)


def _component_weights(terms: list[RewardTerm]) -> dict[str, float]:
    """Each component term's name -> weight; two terms with one name are refused (their metrics would merge)."""
    named: dict[str, float] = {}
    for term in terms:
        if not isinstance(term, RewardTerm):
            raise ValueError(f"a reward term must be a RewardTerm (reward, weight, name), got {type(term).__name__}")
        name = term.term_name()
        if name in named:
            raise ValueError(f"two reward terms are named {name!r}: give one of them its own name")
        named[name] = term.weight
    return named


def _checked(term: RewardTerm) -> RewardFn:
    """A component term's reward, refused when it cannot be called as a reward."""
    if not callable(term.reward):
        raise ValueError(f"reward {term.term_name()!r} (type {type(term.reward).__name__}) is not callable")
    return term.reward


class WeightedSum:
    """The scalar reward: ``sum_i w_i * reward_i``, keeping each term's values for logging.

    Every term's values are checked: a value that is not a real number (a string, None, a bool) is an
    error naming the reward and the value's type; a NaN or infinite value is an error naming the reward
    and the sample's prompt, or with ``nonfinite="drop"`` makes that sample's total NaN (the caller drops
    it) and is counted in :attr:`dropped`.

    With ``normalize="group"`` each term is normalized within its group before weighting (verl-omni's way of
    combining rewards on different scales: a PickScore near 22 and an OCR score in [0, 1] then weigh as their
    weights say, not as their units do). PromptRL instead sums the weighted terms first and normalizes the total
    within its group (its trainer, G-U-N/UniRL ``unirl/trainer/geneval_grpo_trainer.py`` @53c28c9, line 376):
    ``normalize="none"``, the default, with the group advantage on the sum. The returned total stays the raw
    weighted sum (logged, and what validation reports); the normalized one is the parts' ``combined``.

    Per-sample ``metadata`` (each prompt's row of a JSONL prompt file: :mod:`unirl_pl.rewards.metadata`) goes
    only to the terms whose callable declares a ``metadata`` parameter; the others are called as before. The
    refiner's raw ``replies`` (:mod:`unirl_pl.rewards.replies`) go the same way to terms declaring ``replies``, and
    an editing run's source images (``sources``, :mod:`unirl_pl.rewards.sources`) to terms declaring ``sources``.

    Args:
        weights: The terms, as components (a list of :class:`~unirl_pl.rewards.base.RewardTerm`: a built reward,
            its weight and name) or in the short form: reward name (registry key or dotted path) -> weight.
        reward_args: Short form only: reward name -> constructor keyword arguments, for rewards that take some.
        nonfinite: ``error`` (stop at a NaN/inf reward) or ``drop`` (the sample's total is NaN).
        normalize: ``none`` or ``group``: centre each term within its group (the samples of one prompt) and
            scale it by its std over the batch before weighting (:func:`group_normalize`).
    """

    def __init__(
        self,
        weights: dict[str, float] | list[RewardTerm],
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
        if isinstance(weights, dict):
            stray = set(reward_args) - set(weights)
            if stray:
                raise ValueError(f"reward_args given for rewards not in the weights: {sorted(stray)}")
            named = dict(weights)
            negative = {n: w for n, w in named.items() if is_real(w) and w < 0}
            if negative:
                raise ValueError(
                    f"negative reward weights {negative}: a negative weight trains the run to lower the reward. For a "
                    "penalty term give it as a component with allow_negative: true (rewards: [{reward: {class_path: "
                    "...}, weight: -1.0, allow_negative: true}]); else give weights >= 0"
                )
        else:
            if reward_args:
                raise ValueError(
                    "reward_args is for the short form (rewards: {name: weight}); a reward given as a component "
                    f"takes its arguments as init_args (got reward_args for {sorted(reward_args)})"
                )
            named = _component_weights(weights)
        bad_weights = {n: w for n, w in named.items() if not is_real(w) or not math.isfinite(w)}
        if bad_weights:
            raise ValueError(f"reward weights must be finite numbers, got {bad_weights}")
        self.weights = named
        self.nonfinite = nonfinite
        self.normalize = normalize
        self.dropped = 0  # samples whose total was set to NaN (nonfinite="drop"), over this object's life
        if isinstance(weights, dict):
            self.terms = {name: resolve_reward(name, reward_args.get(name)) for name in weights}
        else:
            self.terms = {term.term_name(): _checked(term) for term in weights}
        # (name, keyword) -> (the term's callable, whether it declares the keyword): its signature is read once,
        # and read again only if the term is replaced after construction.
        self._declared: dict[tuple[str, str], tuple[RewardFn, bool]] = {}

    def declares(self, name: str, keyword: str) -> bool:
        """Whether term ``name`` declares the keyword parameter ``keyword`` (``metadata``, ``replies``, ``sources``)."""
        fn = self.terms[name]
        known = self._declared.get((name, keyword))
        if known is None or known[0] is not fn:
            known = self._declared[(name, keyword)] = (fn, accepts_keyword(fn, keyword))
        return known[1]

    def wants_metadata(self, name: str) -> bool:
        """Whether term ``name`` declares a ``metadata`` parameter (and so is given each sample's)."""
        return self.declares(name, "metadata")

    def wants_replies(self, name: str) -> bool:
        """Whether term ``name`` declares a ``replies`` parameter (and so is given each sample's raw reply)."""
        return self.declares(name, "replies")

    def wants_sources(self, name: str) -> bool:
        """Whether term ``name`` declares a ``sources`` parameter (and so is given each sample's source image)."""
        return self.declares(name, "sources")

    def score_term(
        self,
        name: str,
        prompts: list[str],
        refined_prompts: list[str],
        images: Tensor,
        metadata: list[Metadata] | None = None,
        replies: list[Reply] | None = None,
        sources: list[Source] | None = None,
    ) -> Tensor:
        """One term's raw values (N,) float32 on CPU; videos go frame by frame unless the reward reads them."""
        fn = self.terms[name]
        video = images.ndim == 5 and not getattr(fn, "accepts_video", False)
        if sources is not None and self.wants_sources(name):
            if len(sources) != len(prompts):
                raise ValueError(f"reward {name!r}: {len(sources)} source images for {len(prompts)} samples")
            frames = images.shape[1] if video else 1
            fn = partial(fn, sources=[s for s in sources for _ in range(frames)])
        if replies is not None and self.wants_replies(name):
            if len(replies) != len(prompts):
                raise ValueError(f"reward {name!r}: {len(replies)} replies for {len(prompts)} samples")
            frames = images.shape[1] if video else 1
            fn = partial(fn, replies=[r for r in replies for _ in range(frames)])
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
        replies: list[Reply] | None = None,
        sources: list[Source] | None = None,
    ) -> tuple[Tensor, RewardTerms]:
        """Return (total (N,), {name: raw values (N,)}); a reward returning the wrong count is an error.

        For videos (N, F, 3, H, W) an image reward scores every frame and the video gets the frames' mean.
        With ``nonfinite="drop"`` a sample with a NaN/inf term has total NaN (its raw terms are kept).
        ``groups`` (N,) are the samples' group ids for ``normalize="group"`` (default: samples with the
        same prompt form a group). ``pending`` holds terms already being scored (during decode): name ->
        a function returning their values, called here instead of the reward. ``batch_std`` returns a term's
        std over every rank (None on one process), the scale of ``normalize="group"``. ``metadata`` (N,) is each
        sample's prompt metadata, given to the terms that declare a ``metadata`` parameter; ``replies`` (N,) each
        sample's raw refiner reply (None where unrefined), given to the terms that declare ``replies``; ``sources``
        (N,) each sample's source image (editing), given to the terms that declare ``sources``.
        """
        pending = pending or {}
        parts = RewardTerms()
        for name in self.terms:
            if name in pending:
                parts[name] = as_values(name, pending[name](), len(prompts), "samples")
            else:
                parts[name] = self.score_term(name, prompts, refined_prompts, images, metadata, replies, sources)
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
