"""The serve path and what validation scores: greedy refinement, the ODE sampler, the reward per term.

The same loops as training run in the deterministic ``serve`` profile. Shard padding (every rank runs
the same number of batches) is sampled but never scored. Each score is a :class:`PooledMean`, a torchmetrics
metric whose sum and count are summed over ranks, so a sharded validation reports what one process would.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import Tensor
from torchmetrics import Metric

from unirl_pl.conditioning import Conditioner
from unirl_pl.data import PromptBatch
from unirl_pl.loops import ARDecode, DiffusionDenoise
from unirl_pl.rewards import WeightedSum
from unirl_pl.rewards.metadata import accepts_metadata


def serve(
    ar_decode: ARDecode | None,
    diffusion_denoise: DiffusionDenoise,
    conditioning: Conditioner,
    batch: PromptBatch,
    guided: bool,
) -> tuple[list[str], Tensor, list[str | None]]:
    """Refined prompts (the prompts themselves without a refiner), pixels and the refiner's raw replies (None
    without a refiner) for ``batch``."""
    n = len(batch.prompts)
    refined, replies = list(batch.prompts), [None] * n
    if ar_decode is not None:
        sees = batch.sources is not None and getattr(ar_decode.llm, "sees_images", False)
        images = {"images": [source.pixels for source in batch.sources]} if sees else {}  # type: ignore[union-attr]
        refined, record = ar_decode.sample(refined, batch.request_ids, [0] * n, "serve", seed=batch.seed, **images)
        replies = list(record.replies) or replies
    latents, _ = diffusion_denoise.sample(
        conditioning.encode(refined, batch.sources),
        batch.request_ids,
        [0] * n,
        "serve",
        seed=batch.seed,
        uncond=conditioning.uncond(guided),
    )
    return refined, conditioning.decode(latents), replies


def validation_keys(reward: WeightedSum) -> list[str]:
    """Every key :func:`validation_scores` can report for ``reward``, known before anything is scored.

    ``reward_mean``, ``reward_<term>`` for every term, and ``<term>/<key>`` for each key a term with a
    ``breakdown`` declares in ``breakdown_keys`` (the ShapesWorld verifier's ``strict/<category>``). Every rank
    logs exactly these, so their all-reduces line up whatever categories its shard holds.
    """
    keys = ["reward_mean", *(f"reward_{name}" for name in reward.terms)]
    for name, term in reward.terms.items():
        if getattr(term, "breakdown", None) is None:
            continue
        declared = getattr(term, "breakdown_keys", None)
        if declared is None:
            raise ValueError(
                f"reward {name!r} has a breakdown() but no breakdown_keys: declare every key it can report "
                "(e.g. ('strict/overall', 'soft/overall')), so that every rank logs the same validation metrics"
            )
        keys += [f"{name}/{key}" for key in declared]
    return list(dict.fromkeys(keys))


def validation_scores(
    reward: WeightedSum, prompts: list[str], refined: list[str], images: Tensor
) -> tuple[dict[str, tuple[Tensor | float, int]], Tensor]:
    """``(scores, total)`` of the real samples of one validation batch.

    ``scores`` maps keys of :func:`validation_keys` to ``(mean, count)``: the reward's and each term's mean
    over the batch's samples, and each key a term's ``breakdown`` reports (the ShapesWorld verifier's per
    GenEval category) with its own count; ``total`` is the per-sample reward. A batch that is all padding
    has no scores.

    A ``breakdown`` that declares a ``metadata`` keyword gets the batch's metadata, which validation binds to
    ``reward`` (a ``WithMetadata``): a score that depends on the prompt row, not the prompt text (the
    ShapesWorld-Edit verifier's placements), cannot be broken down without it. Others get ``(prompts, images)``.
    """
    if not prompts:
        return {}, torch.zeros(0)
    total, parts = reward(prompts, refined, images)
    n = len(prompts)
    scores: dict[str, tuple[Tensor | float, int]] = {"reward_mean": (total.nanmean(), n)}
    scores |= {f"reward_{name}": (values.nanmean(), n) for name, values in parts.items()}
    metadata = getattr(reward, "metadata", None)
    for name, term in reward.terms.items():
        report: Any = getattr(term, "breakdown", None)
        if report is not None:
            # Only when there is some, as WeightedSum.score_term does: the breakdown's own default then applies.
            extra = {"metadata": metadata} if metadata is not None and accepts_metadata(report) else {}
            found = report(prompts, images, **extra)
            scores |= {f"{name}/{key}": (mean, count) for key, (mean, count) in found.items()}
    return scores, total


class PooledMean(Metric):
    """The mean of one validation score over every rank's samples: a sum and a count, each summed over ranks
    (``dist_reduce_fx="sum"``), so uneven shards weigh by their samples and not by their ranks.

    :meth:`compute` is None when no rank had a sample (a category missing from the whole validation set):
    Lightning then logs nothing under the key, as when only the keys present were logged.
    """

    full_state_update = False
    total: Tensor
    count: Tensor

    def __init__(self) -> None:
        # compute() syncs itself once per epoch and keeps its answer, None included: torchmetrics' own sync runs
        # again at every read of a None, and a read on one rank only (a rank-zero callback reading
        # callback_metrics) would leave the other ranks' all-gather unmatched.
        super().__init__(sync_on_compute=False)
        # Lightning's batch_size-weighted mean summed ``mean * batch_size`` in float32 (float64 under a float64
        # default dtype) over an int64 count: the same arithmetic keeps one process's values bit for bit.
        dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
        self.add_state("total", torch.zeros((), dtype=dtype), dist_reduce_fx="sum")
        self.add_state("count", torch.zeros((), dtype=torch.int64), dist_reduce_fx="sum")
        self._pooled: tuple[Tensor | None] | None = None

    def update(self, mean: Tensor | float, count: int) -> None:
        """Add ``count`` samples whose mean is ``mean``; a count of 0 adds nothing."""
        if count:
            value = torch.as_tensor(mean, dtype=self.total.dtype, device=self.total.device)
            self.total = self.total + value * count
            self.count = self.count + count

    def compute(self) -> Tensor | None:
        if self._pooled is None:
            with self.sync_context(dist_sync_fn=self.dist_sync_fn, process_group=self.process_group):
                total, count = self.total.clone(), self.count.clone()
            self._pooled = (total / count if count > 0 else None,)
        return self._pooled[0]

    def reset(self) -> None:
        super().reset()
        self._pooled = None


class ValidationMetrics(torch.nn.Module):
    """A :class:`PooledMean` per validation key, the same keys on every rank.

    The module owns it as a submodule, so Lightning moves it to the device and finds each metric when it is
    logged; Lightning computes them when the epoch's metrics are first read and resets them after it.
    """

    def __init__(self, keys: list[str]) -> None:
        super().__init__()
        self.keys = list(keys)
        # A list, not a dict by key: a reward named by a dotted path would put a dot in a submodule's name.
        self.means = torch.nn.ModuleList(PooledMean() for _ in self.keys)

    def update(self, scores: dict[str, tuple[Tensor | float, int]]) -> None:
        """Add one batch's ``{key: (mean, count)}``; a key it lacks adds nothing, an unknown key is an error."""
        unknown = sorted(set(scores) - set(self.keys))
        if unknown:
            raise ValueError(f"validation reported keys its reward did not declare: {unknown}")
        for key, metric in zip(self.keys, self.means, strict=True):
            # Every metric is updated, present or not, so none warns that it is computed before an update.
            metric.update(*scores.get(key, (0.0, 0)))

    def items(self) -> list[tuple[str, PooledMean]]:
        """``(key, metric)`` pairs in the keys' order."""
        return [(key, cast(PooledMean, metric)) for key, metric in zip(self.keys, self.means, strict=True)]
