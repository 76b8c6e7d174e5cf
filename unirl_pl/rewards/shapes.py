"""ShapesWorld GenEval-style reward: verify each image against the scene its ORIGINAL prompt asked for.

The refined prompt is deliberately ignored for scoring: a refiner must not be able to earn reward by
rewriting the request into something easier, only by helping the generator draw what the user asked.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch

from unirl_pl.rewards.base import Reward
from unirl_pl.shapes.prompts import spec_of
from unirl_pl.shapes.scenes import CATEGORIES, SceneSpec, requested_objects
from unirl_pl.shapes.verify import Verdict, grouped_scores, verify

SCORES: tuple[str, ...] = ("soft", "strict")
# Every key ``breakdown`` can report, in its order: validation logs one metric per key on every rank, so they
# must be known before any image is scored (a category missing from one rank's shard is still summed over ranks).
BREAKDOWN_KEYS: tuple[str, ...] = tuple(
    f"{score}/{name}" for name in (*CATEGORIES, "overall") for score in ("strict", "soft")
)


@lru_cache(maxsize=65536)
def _cached_spec(prompt: str) -> SceneSpec:
    # Prompt sets are small and revisited every epoch; parsing once per distinct prompt is enough.
    return spec_of(prompt)


def _images_to_numpy(images: torch.Tensor, n: int) -> np.ndarray:
    """(N, 3, H, W) float tensor in [0, 1] -> (N, H, W, 3) float32 numpy, refusing malformed input."""
    if not isinstance(images, torch.Tensor):
        raise TypeError(f"images must be a torch.Tensor, got {type(images).__name__}")
    if images.ndim != 4 or images.shape[1] != 3:
        raise ValueError(f"images must have shape (N, 3, H, W), got {tuple(images.shape)}")
    if images.shape[0] != n:
        raise ValueError(f"got {images.shape[0]} images for {n} prompts")
    if not images.is_floating_point():
        raise ValueError(f"images must be float in [0, 1], got dtype {images.dtype}")
    return images.detach().to(device="cpu", dtype=torch.float32).clamp(0, 1).permute(0, 2, 3, 1).numpy()


def _verdicts(prompts: list[str], images: torch.Tensor, penalize_extra: bool = False) -> list[Verdict]:
    arrays = _images_to_numpy(images, len(prompts))
    return [verify(_cached_spec(p), img, penalize_extra=penalize_extra) for p, img in zip(prompts, arrays, strict=True)]


class ShapesGenEval(Reward):
    """The ShapesWorld reward: per-image verifier score of the original prompt's scene.

    ``score="soft"`` returns the fraction of the scene's constraints that hold (a dense RL signal);
    ``score="strict"`` returns 1.0 only when all hold (GenEval's accuracy). ``per_category`` gives
    both as means per GenEval category for validation metrics.

    Args:
        score: ``soft`` or ``strict``, as above.
        penalize_extra: Add the constraint that the image holds no more objects than the scene names.
            GenEval (and the default) ignores unnamed objects outside counting, which a refiner can
            exploit by asking for extra copies of an object ("a circle and a circle" for "a circle").
            This image check also fails the generator's own stray shapes.
        penalize_requested_extra: Score 0 for a sample whose refined prompt asks for more objects than
            the user's prompt names (``requested_objects``): the same exploit, checked on the text the
            refiner wrote, so the generator's stray shapes cost nothing. It only ever lowers a reward,
            and only in ``__call__`` (the RL reward); ``breakdown``, which validation reports, has no
            refined prompts and stays the GenEval-style image check.
    """

    name = "shapes_geneval"

    breakdown_keys: tuple[str, ...] = BREAKDOWN_KEYS

    def __init__(
        self, score: str = "soft", penalize_extra: bool = False, penalize_requested_extra: bool = False
    ) -> None:
        if score not in SCORES:
            raise ValueError(f"score must be one of {SCORES}, got {score!r}")
        self.score, self.penalize_extra = score, penalize_extra
        self.penalize_requested_extra = penalize_requested_extra

    def __call__(self, prompts: list[str], refined_prompts: list[str], images: torch.Tensor) -> list[float]:
        """Score ``images`` (float (N, 3, H, W) in [0, 1]) against ``prompts``; ``refined_prompts`` only ever
        lowers a score (``penalize_requested_extra``).

        Returns N floats in [0, 1]. Raises ValueError when lengths disagree or a prompt is not a
        ShapesWorld prompt.
        """
        if len(refined_prompts) != len(prompts):
            raise ValueError(f"got {len(refined_prompts)} refined prompts for {len(prompts)} prompts")
        verdicts = _verdicts(prompts, images, self.penalize_extra)
        scores = [float(v.strict) if self.score == "strict" else float(v.soft) for v in verdicts]
        if self.penalize_requested_extra:
            named = [_cached_spec(p).num_objects for p in prompts]
            scores = [
                0.0 if requested_objects(r) > n else s for s, r, n in zip(scores, refined_prompts, named, strict=True)
            ]
        return scores

    def breakdown(self, prompts: list[str], images: torch.Tensor) -> dict[str, tuple[float, int]]:
        """``{key: (mean, count)}`` of strict and soft scores per category and overall (``strict/counting``).

        Counts let a caller average exactly over batches of different composition. Categories absent
        from the batch are left out; ``overall`` is the mean over images, matching the reward mean. Every
        key is one of :attr:`breakdown_keys`.
        """
        verdicts = _verdicts(prompts, images, self.penalize_extra)
        return grouped_scores([_cached_spec(p).category for p in prompts], verdicts, CATEGORIES)

    def per_category(self, prompts: list[str], images: torch.Tensor) -> dict[str, float]:
        """Mean strict and soft scores per category and overall, keyed like ``strict/counting``."""
        return {key: mean for key, (mean, _) in self.breakdown(prompts, images).items()}


def shapes_geneval(prompts: list[str], refined_prompts: list[str], images: torch.Tensor) -> list[float]:
    """Soft ShapesWorld GenEval reward: for each image, the fraction of its original prompt's constraints met.

    ``images`` is float (N, 3, H, W) in [0, 1]; each is scored against ``canonical_of(prompt)``
    parsed into a scene, never against the refined prompt.
    """
    return ShapesGenEval("soft")(prompts, refined_prompts, images)
