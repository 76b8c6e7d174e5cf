"""The serve path and what validation scores: greedy refinement, the ODE sampler, the reward per term.

The same loops as training run in the deterministic ``serve`` profile. Shard padding (every rank runs
the same number of batches) is sampled but never scored.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from unirl_pl.conditioning import Conditioner
from unirl_pl.data import PromptBatch
from unirl_pl.loops import ARDecode, DiffusionDenoise
from unirl_pl.rewards import WeightedSum


def serve(
    ar_decode: ARDecode | None,
    diffusion_denoise: DiffusionDenoise,
    conditioning: Conditioner,
    batch: PromptBatch,
    guided: bool,
) -> tuple[list[str], Tensor]:
    """Refined prompts (the prompts themselves without a refiner) and pixels for ``batch``."""
    n = len(batch.prompts)
    refined = list(batch.prompts)
    if ar_decode is not None:
        refined, _ = ar_decode.sample(refined, batch.request_ids, [0] * n, "serve", seed=batch.seed)
    latents, _ = diffusion_denoise.sample(
        conditioning.encode(refined),
        batch.request_ids,
        [0] * n,
        "serve",
        seed=batch.seed,
        uncond=conditioning.uncond(guided),
    )
    return refined, conditioning.decode(latents)


def validation_scores(
    reward: WeightedSum, prompts: list[str], refined: list[str], images: Tensor
) -> tuple[dict[str, Tensor], list[tuple[str, float, int]], Tensor]:
    """``(means, breakdown, total)`` of the real samples of one validation batch.

    ``means`` has ``mean`` and every reward term (zeros when the batch is all padding: every rank must log
    the same keys to sync them); ``breakdown`` is ``(key, mean, count)`` from rewards that report one (the
    ShapesWorld verifier per GenEval category); ``total`` the per-sample reward.
    """
    means = {name: torch.zeros(()) for name in ["mean", *reward.terms]}
    if not prompts:
        return means, [], torch.zeros(0)
    total, parts = reward(prompts, refined, images)
    means = {"mean": total.nanmean()} | {name: values.nanmean() for name, values in parts.items()}
    breakdown: list[tuple[str, float, int]] = []
    for name, term in reward.terms.items():
        report: Any = getattr(term, "breakdown", None)
        if report is not None:
            breakdown += [(f"{name}/{key}", mean, count) for key, (mean, count) in report(prompts, images).items()]
    return means, breakdown, total
