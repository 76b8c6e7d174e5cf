"""The per-step metric dictionaries: names are ``<component or topic>/<name>``."""

from __future__ import annotations

import math
from collections.abc import Collection
from typing import Any

import torch
from torch import Tensor
from torchmetrics import Metric
from torchmetrics.utilities import dim_zero_cat

from unirl_pl.losses import LossOutput
from unirl_pl.records import Experience
from unirl_pl.rewards.terms import term_stats


def loss_metrics(name: str, out: LossOutput, grad_norm: Tensor) -> dict[str, Tensor]:
    """An expert's loss, its parts, ratio statistics, clip fractions, gradient norm and its algorithm's extras."""
    return {
        f"{name}/loss": out.loss.detach(),
        f"{name}/pg_loss": out.pg_loss,
        f"{name}/kl": out.kl,
        f"{name}/ratio_mean": out.ratio_mean,
        f"{name}/ratio_min": out.ratio_min,
        f"{name}/ratio_max": out.ratio_max,
        f"{name}/clip_frac": out.clip_frac,
        f"{name}/clip_frac_high": out.clip_frac_high,
        f"{name}/clip_frac_low": out.clip_frac_low,
        f"{name}/grad_norm": grad_norm,
        **{f"{name}/{key}": value for key, value in out.extras.items()},
    }


def update_metrics(name: str, updates: list[tuple[LossOutput, Tensor]]) -> dict[str, Tensor]:
    """An expert's :func:`loss_metrics` over the step's optimizer updates (PPO epochs x mini-batches): means of
    the losses, ratio means, clip fractions, gradient norms and extras, the ratio's min and max over all, and
    ``<name>/updates``. With one update it is that update's metrics exactly (and no ``updates`` key). The first
    update is on-policy (ratio 1 up to numerics); the clip fractions and ratio spread come from the stale later
    ones."""
    first = loss_metrics(name, *updates[0])
    if len(updates) == 1:
        return first
    rows = [loss_metrics(name, out, norm) for out, norm in updates]
    merged: dict[str, Tensor] = {}
    for key in first:
        values = torch.stack([torch.as_tensor(r[key]).detach().float().reshape(()) for r in rows if key in r])
        merged[key] = (
            values.min()
            if key.endswith("/ratio_min")
            else values.max()
            if key.endswith("/ratio_max")
            else values.mean()
        )
    merged[f"{name}/updates"] = torch.tensor(float(len(updates)))
    return merged


def nonfinite_report(losses: dict[str, Tensor], grad_norms: dict[str, Tensor]) -> str:
    """Which of a step's losses and gradient norms were not finite, for the message of a skipped step.

    Names each non-finite value (``transformer/grad_norm=nan``); the skip is agreed across ranks, so
    when every value here is finite it says so and lists them (another rank's value was the bad one).
    Values are read detached: a loss still holds its graph when the step is skipped.
    """
    values = {f"{name}/loss": loss for name, loss in losses.items()}
    values.update({f"{name}/grad_norm": norm for name, norm in grad_norms.items()})
    numbers = {key: float(value.detach()) for key, value in values.items()}
    bad = [f"{key}={value:.3g}" for key, value in numbers.items() if not math.isfinite(value)]
    if bad:
        return ", ".join(bad)
    finite = ", ".join(f"{key}={value:.3g}" for key, value in numbers.items())
    return f"all finite on this rank ({finite}): another rank's were not"


def rollout_correction_metrics(name: str, stats: dict[str, float]) -> dict[str, float]:
    """An expert's rollout-correction statistics (:func:`unirl_pl.rollout_correction.rollout_correction_stats`) under
    ``rollout_corr/<name>_<stat>``: ``ratio_mean``, ``ratio_max``, ``clipped_frac`` and ``kl``."""
    return {f"rollout_corr/{name}_{key}": value for key, value in stats.items()}


def reward_moments(exp: Experience) -> dict[tuple[str, str | None], tuple[float, float, float]]:
    """This rank's reward statistics as ``(mean key, std key or None) -> (count, mean, population std)``:
    the total (``reward/mean``, ``reward/std``) and each term (``reward/<name>``, ``reward/<name>_std``) over
    their finite values, and with ``exp.count_unscored`` each term's unscored fraction over all its samples.
    Each number is computed as one process has always logged it (the total in float32, the terms in float64)."""
    finite = exp.rewards[exp.rewards.isfinite()]
    total = (len(finite), float(exp.rewards.nanmean()), float(finite.std(unbiased=False)))
    rows = {("reward/mean", "reward/std"): total}
    stats = term_stats(exp.reward_parts, unscored=exp.count_unscored)
    for name, values in exp.reward_parts.items():
        scored = int(values.isfinite().sum())
        rows[f"reward/{name}", f"reward/{name}_std"] = (scored, stats[name], stats[f"{name}_std"])
        if exp.count_unscored:
            rows[f"reward/{name}_unscored", None] = (len(values), stats[f"{name}_unscored"], 0.0)
    return rows


def pool_moments(moments: Tensor) -> Tensor:
    """Pool ``(ranks, K, 3)`` rows of (count, mean, population std) into ``(K, 2)`` (mean, std) over every
    rank's samples, as one process holding them all would compute them. Ranks with no sample are left out; a
    statistic no rank saw is NaN. One rank's rows come back untouched, bit for bit."""
    if moments.shape[0] == 1:
        return moments[0, :, 1:].clone()
    n, mean, std = moments.unbind(-1)
    total = n.sum(0)
    weight = n / total.clamp(min=1)
    # Samples of an empty rank carry NaN statistics with weight 0: zero them so they do not poison the sums.
    mean, std = torch.where(n > 0, mean, 0.0), torch.where(n > 0, std, 0.0)
    pooled = (weight * mean).sum(0)
    var = (weight * (std**2 + (mean - pooled) ** 2)).sum(0)
    nan = torch.full_like(pooled, math.nan)
    return torch.stack([torch.where(total > 0, pooled, nan), torch.where(total > 0, var.sqrt(), nan)], -1)


class RewardStatistics(Metric):
    """A step's reward statistics (:func:`reward_moments`) pooled over ranks.

    Averaging each rank's std (what one all-reduce of the logged row did) is not the std of the batch, and a
    rank that dropped samples weighed as much as one that kept them all. Each rank adds its rows of (count,
    mean, std); :meth:`compute` gathers every rank's rows (``dist_reduce_fx="cat"``) and pools them with
    :func:`pool_moments`. On one process the values are this rank's own, unchanged. Reset after each step.
    """

    full_state_update = False
    moments: list[Tensor]

    def __init__(self) -> None:
        super().__init__()
        self.add_state("moments", default=[], dist_reduce_fx="cat")
        self.keys: list[tuple[str, str | None]] = []

    def update(self, exp: Experience) -> None:
        rows = reward_moments(exp)
        self.keys = list(rows)
        self.moments.append(torch.tensor(list(rows.values()), dtype=torch.float64, device=self.device))

    def compute(self) -> dict[str, float]:
        moments = dim_zero_cat(self.moments)
        pooled = pool_moments(moments.reshape(-1, len(self.keys), 3)).tolist()
        out: dict[str, float] = {}
        for (mean_key, std_key), (mean, std) in zip(self.keys, pooled, strict=True):
            out[mean_key] = mean
            if std_key is not None:
                out[std_key] = std
        return out


def rollout_metrics(
    exp: Experience,
    versions: dict[str, int],
    staleness: dict[str, float],
    hit_rate: float,
    rewards: dict[str, float],
    records: dict[str, Tensor | float] | None = None,
) -> dict[str, Tensor | float]:
    """Reward spread and terms (``rewards``: :class:`RewardStatistics`' values, ``reward/mean`` left to the
    caller), advantage statistics, cache hit rate, versions, staleness, refinements; ``records`` are the
    algorithms' metrics of their records (e.g. ``llm/response_tokens``)."""
    metrics: dict[str, Tensor | float] = {
        "reward/std": rewards["reward/std"],
        "reward/dropped": float(exp.dropped),
        "advantage/zero_std_frac": exp.zero_std_frac,
        "cache/text_encoder_hit_rate": hit_rate,
    }
    if exp.image_advantages is not None:
        metrics["advantage/abs_mean"] = exp.image_advantages.abs().mean()
    metrics.update({k: v for k, v in rewards.items() if k not in ("reward/mean", "reward/std")})
    metrics.update({f"version/{n}": float(v) for n, v in versions.items()})
    metrics.update({f"version/{n}_staleness": v for n, v in staleness.items()})
    metrics.update(records or {})
    if exp.fallback_frac is not None:
        metrics["llm/fallback_frac"] = exp.fallback_frac
    return metrics


def log_step(
    trainer: Any,
    metrics: dict[str, Tensor | float],
    step: int,
    device: torch.device,
    pooled: Collection[str] = (),
) -> None:
    """A step's metrics straight to the trainer's loggers, averaged over ranks in one all-reduce; the keys in
    ``pooled`` are already the same on every rank (:class:`RewardStatistics`) and are logged as they are.

    ``LightningModule.log_dict`` of ~35 keys costs ~10 ms a step (per-key bookkeeping); nothing monitors
    these keys, so they skip it (``reward/mean`` still goes through ``self.log`` for the progress bar).
    """
    values = torch.stack([torch.as_tensor(v, dtype=torch.float32).detach().reshape(()).cpu() for v in metrics.values()])
    if trainer.world_size > 1:
        own = values.clone()
        values = trainer.strategy.reduce(values.to(device), reduce_op="mean").cpu()
        keep = torch.tensor([key in pooled for key in metrics])
        values = torch.where(keep, own, values)
    row = dict(zip(metrics, values.tolist(), strict=True))
    for logger in trainer.loggers:
        logger.log_metrics(row, step=step)
