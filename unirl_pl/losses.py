"""Advantages and policy losses as pure functions: GRPO for the LM's tokens, Flow-GRPO for the DiT's steps.

No module state lives here, so each formula is unit-tested on its own and the LightningModule only
feeds tensors in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor


def group_advantages(
    rewards: Tensor,
    group_ids: Tensor,
    *,
    global_std: bool = False,
    batch_std: Tensor | float | None = None,
    eps: float = 1e-4,
    clip_max: float = 5.0,
) -> Tensor:
    """Group-relative advantages ``(r - mean_group) / (std + eps)``, clipped to ``+-clip_max``.

    ``std`` is the group's (population) std, or the whole batch's with ``global_std`` (Flow-GRPO's
    option that keeps zero-variance groups from blowing up). With several ranks the caller passes the
    std of all ranks' rewards as ``batch_std`` so every rank normalizes by the same number.
    ``group_ids`` is a (N,) integer tensor; groups need not be contiguous.
    """
    if rewards.shape != group_ids.shape or rewards.ndim != 1:
        raise ValueError(f"rewards {tuple(rewards.shape)} and group_ids {tuple(group_ids.shape)} must be (N,)")
    r = rewards.double()
    _, inverse = torch.unique(group_ids, return_inverse=True)
    n_groups = int(inverse.max()) + 1
    count = torch.zeros(n_groups, dtype=r.dtype, device=r.device).index_add_(0, inverse, torch.ones_like(r))
    total = torch.zeros_like(count).index_add_(0, inverse, r)
    mean = (total / count)[inverse]
    if global_std:
        std = (r.std(unbiased=False) if batch_std is None else torch.as_tensor(batch_std, dtype=r.dtype)).expand_as(r)
    else:
        sq = torch.zeros_like(count).index_add_(0, inverse, (r - mean) ** 2)
        std = torch.sqrt(sq / count)[inverse]
    adv = (r - mean) / (std + eps)
    return adv.clamp(-clip_max, clip_max).to(rewards.dtype)


def zero_std_fraction(rewards: Tensor, group_ids: Tensor, tol: float = 1e-8) -> float:
    """Fraction of groups whose rewards are all equal: they carry no learning signal."""
    groups = torch.unique(group_ids)
    flat = [float(rewards[group_ids == g].std(unbiased=False)) <= tol for g in groups]
    return sum(flat) / max(len(flat), 1)


def k3_kl(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """Schulman's k3 estimator of KL(policy || reference) per token: ``exp(d) - d - 1`` with ``d = ref - logp``.

    Non-negative and exactly zero where the two log-probs agree.
    """
    d = ref_logp - logp
    return torch.exp(d) - d - 1


@dataclass(frozen=True)
class LossOutput:
    """A loss and its detached statistics (ratio mean, clip fractions, KL) for logging.

    ``backpropagated`` marks a loss whose gradients were already accumulated piece by piece (its ``loss``
    is then detached and only logged). ``logp`` holds the detached recomputed log-probs the loss was built
    from, in the record's shape, so the C2 gate checks them without a forward of its own.
    """

    loss: Tensor
    pg_loss: Tensor
    kl: Tensor
    ratio_mean: Tensor
    ratio_min: Tensor
    ratio_max: Tensor
    clip_frac_high: Tensor
    clip_frac_low: Tensor
    backpropagated: bool = False
    logp: Tensor | None = None

    @property
    def clip_frac(self) -> Tensor:
        """Fraction of terms where either side of the clip engaged."""
        return self.clip_frac_high + self.clip_frac_low


def _masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    return (x * mask).sum() / mask.sum().clamp_min(1)


def _policy_loss_output(
    loss: Tensor, pg: Tensor, kl: Tensor, ratios: Tensor, clip_frac_high: Tensor, clip_frac_low: Tensor
) -> LossOutput:
    """``LossOutput`` of a clipped policy loss: ``pg`` and ``kl`` detached, ``ratios`` (the detached
    importance ratios of the real terms) summarized by mean, min and max."""
    return LossOutput(
        loss=loss,
        pg_loss=pg.detach(),
        kl=kl.detach(),
        ratio_mean=ratios.mean(),
        ratio_min=ratios.min(),
        ratio_max=ratios.max(),
        clip_frac_high=clip_frac_high,
        clip_frac_low=clip_frac_low,
    )


def clipped_surrogate(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, clip_eps: float
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """PPO's clipped objective per element: ``max(-A*r, -A*clip(r, 1-eps, 1+eps))`` with ``r = exp(logp - old)``.

    Returns ``(loss, ratio, clipped_high, clipped_low)`` elementwise; the clipped masks mark where
    the clipped branch is the active (larger) one, split by side so a one-sided clip before any
    update (the signature of a biased recompute) is visible.
    """
    ratio = torch.exp(logp - old_logp)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - clip_eps, 1 + clip_eps)
    loss = torch.maximum(unclipped, clipped)
    active = clipped > unclipped
    high = (active & (ratio > 1 + clip_eps)).float()
    low = (active & (ratio < 1 - clip_eps)).float()
    return loss, ratio, high, low


def truncated_importance_weights(old_logp: Tensor, behavior_logp: Tensor, cap: float) -> Tensor:
    """Truncated importance weights of the rollout/train numerics mismatch: ``min(exp(old - behavior), cap)``.

    ``old_logp`` is the log-prob the trainer recomputes under the weights that produced the sample (before
    any update), ``behavior_logp`` the one rollout recorded while sampling; their ratio corrects for the
    sampler's numerics (bf16 kernels, a KV cache, another batch shape) differing from the trainer's. The
    weight is detached (a fixed per-term coefficient, as in verl's decoupled rollout correction and TRL's
    TIS) and truncated at ``cap`` so a rare term the sampler under-weighted cannot dominate the gradient;
    the cap is applied to the log ratio, so a huge mismatch cannot overflow. Equal log-probs give 1.
    """
    if cap <= 0:
        raise ValueError(f"cap must be > 0, got {cap}")
    log_ratio = (old_logp.detach() - behavior_logp.detach()).float()
    return torch.exp(log_ratio.clamp(max=math.log(cap)))


def rollout_correction_stats(
    old_logp: Tensor, behavior_logp: Tensor, mask: Tensor | None, cap: float
) -> dict[str, Tensor]:
    """Statistics of the behavior/recompute ratio ``r = exp(old - behavior)`` over the real terms of ``mask``.

    ``ratio_mean`` and ``ratio_max`` are of the untruncated ratio, ``clipped_frac`` the fraction of terms
    whose weight the cap truncates, ``kl`` the k3 estimate ``r - 1 - log r`` of KL(behavior || recompute)
    (the samples come from the behavior policy, so this is the direction their mean estimates; >= 0 and 0
    only where the two agree). All detached float32 scalars; no real term gives a ratio of 1 and zeros.
    """
    log_ratio = (old_logp.detach() - behavior_logp.detach()).float()
    if mask is not None:
        log_ratio = log_ratio[mask.bool()]
    if not log_ratio.numel():
        one, zero = torch.ones(()), torch.zeros(())
        return {"ratio_mean": one, "ratio_max": one, "clipped_frac": zero, "kl": zero}
    ratio = torch.exp(log_ratio)
    return {
        "ratio_mean": ratio.mean(),
        "ratio_max": ratio.max(),
        "clipped_frac": (log_ratio > math.log(cap)).float().mean(),
        "kl": (ratio - 1 - log_ratio).mean(),
    }


def grpo_token_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    ref_logp: Tensor | None = None,
    clip_eps: float = 0.2,
    beta: float = 0.0,
    is_weights: Tensor | None = None,
) -> LossOutput:
    """Token-level GRPO loss for the refiner LM.

    ``logp``, ``old_logp``, ``ref_logp`` and ``mask`` are (N, T) over generated tokens; ``advantages``
    is (N,), broadcast to every token of its sample. The loss averages over all real tokens of the
    batch (token-level, so long refinements weigh by their length) and adds ``beta`` times the k3
    KL to the adapter-disabled reference. ``is_weights`` (N, T), the detached
    :func:`truncated_importance_weights`, multiply each token's clipped surrogate (not the KL term).
    """
    mask = mask.to(logp.dtype)
    per_token, ratio, high, low = clipped_surrogate(logp, old_logp, advantages[:, None], clip_eps)
    if is_weights is not None:
        per_token = per_token * is_weights.detach()
    pg = _masked_mean(per_token, mask)
    kl = _masked_mean(k3_kl(logp, ref_logp), mask) if ref_logp is not None else logp.new_zeros(())
    loss = pg + beta * kl if ref_logp is not None else pg
    real = mask.bool()
    r = ratio.detach()[real] if real.any() else ratio.new_ones(1)
    return _policy_loss_output(loss, pg, kl, r, _masked_mean(high, mask).detach(), _masked_mean(low, mask).detach())


def flow_grpo_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    *,
    kl: Tensor | None = None,
    clip_eps: float = 1e-4,
    beta: float = 0.0,
    is_weights: Tensor | None = None,
) -> LossOutput:
    """Flow-GRPO's PPO loss for one denoising step over a batch of (N,) samples.

    ``logp``/``old_logp`` are the step's per-sample SDE log-probs, ``kl`` the per-sample
    :func:`unirl_pl.sampling.flow_kl` against the reference; the loss is the batch mean of the
    clipped surrogate plus ``beta`` times the mean KL. ``is_weights`` (N,), the detached
    :func:`truncated_importance_weights` of this step, multiply each sample's clipped surrogate.
    """
    per_sample, ratio, high, low = clipped_surrogate(logp, old_logp, advantages, clip_eps)
    if is_weights is not None:
        per_sample = per_sample * is_weights.detach()
    pg = per_sample.mean()
    kl_mean = kl.mean() if kl is not None else logp.new_zeros(())
    loss = pg + beta * kl_mean if kl is not None else pg
    return _policy_loss_output(loss, pg, kl_mean, ratio.detach(), high.mean(), low.mean())
