"""Policy losses as pure functions: one token loss for the refiner (GRPO, DAPO and GSPO are its modes),
Flow-GRPO, GRPO-Guard and DiffusionNFT for the DiT's steps (the group statistics of advantages are
:mod:`unirl_pl.group_stats`, the rollout correction's weights :mod:`unirl_pl.rollout_correction`).

No module state lives here, so each formula is unit-tested on its own and the LightningModule only
feeds tensors in.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

import torch
from torch import Tensor


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
    from, in the record's shape, so the C2 gate checks them without a forward of its own. ``extras`` are an
    algorithm's own detached statistics, logged as ``<expert>/<key>``.
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
    extras: dict[str, Tensor] = field(default_factory=dict)

    @property
    def clip_frac(self) -> Tensor:
        """Fraction of terms where either side of the clip engaged."""
        return self.clip_frac_high + self.clip_frac_low


def _masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    return _on_real(x, mask).sum() / mask.sum().clamp_min(1)


def _on_real(x: Tensor, mask: Tensor, fill: float = 0.0) -> Tensor:
    """``x`` on the real positions of ``mask`` (0/1 or bool) and ``fill`` on the padded ones.

    A where, never a product with the mask: a padded position may hold -inf (a finished row's pad token
    outside the top-k has log-prob -inf), and ``-inf * 0`` is NaN in the loss, or in the gradient of every
    term it passes through. Applied to a loss's inputs, padded positions contribute exact zeros to both.
    """
    return torch.where(mask.bool(), x, torch.full_like(x, fill))


def _real_inputs(
    mask: Tensor, logp: Tensor, old_logp: Tensor, ref_logp: Tensor | None, is_weights: Tensor | None
) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
    """A token loss's (N, T) inputs with their padded positions replaced (log-probs 0, importance weights 1),
    so that whatever the record holds there (-inf, NaN) reaches neither the loss nor its gradient."""
    return (
        _on_real(logp, mask),
        _on_real(old_logp, mask),
        None if ref_logp is None else _on_real(ref_logp, mask),
        None if is_weights is None else _on_real(is_weights, mask, 1.0),
    )


def _per_step_loss(
    per_sample: Tensor,
    ratio: Tensor,
    high: Tensor,
    low: Tensor,
    *,
    kl: Tensor | None,
    beta: float,
    is_weights: Tensor | None,
) -> LossOutput:
    """The shared tail of the per-sample (one denoising step) policy losses: each sample's clipped
    surrogate times its truncated importance weight (detached), averaged, plus ``beta`` times the mean KL."""
    if is_weights is not None:
        per_sample = per_sample * is_weights.detach()
    pg = per_sample.mean()
    kl_mean = kl.mean() if kl is not None else per_sample.new_zeros(())
    loss = pg + beta * kl_mean if kl is not None else pg
    return _policy_loss_output(loss, pg, kl_mean, ratio.detach(), high.mean(), low.mean())


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
    return _per_step_loss(per_sample, ratio, high, low, kl=kl, beta=beta, is_weights=is_weights)


def grpo_guard_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mean: Tensor,
    old_mean: Tensor,
    scale: Tensor,
    dt: Tensor,
    *,
    kl: Tensor | None = None,
    clip_eps: float = 1e-4,
    beta: float = 0.0,
    is_weights: Tensor | None = None,
) -> LossOutput:
    """GRPO-Guard's regulated clipping of one Flow-GRPO step (RatioNorm and per-step reweighting).

    With ``scale`` (N,) the step's noise scale ``std * sqrt(-dt)`` and ``b = mean((mean - old_mean)^2) /
    (2 scale^2)`` (the second-order term that shifts the log-ratio of a Gaussian step below 0), the ratio is
    ``exp((logp - old_logp + b) * scale)``: centred at 1 whatever the step's noise, so the clip range means
    the same at every step. Each sample's clipped surrogate is divided by ``-dt`` (N,) (the gradient
    reweighting that balances the steps); the KL term is added unscaled. At ``mean == old_mean`` the ratio is
    exactly ``exp((logp - old_logp) * scale)``. ``old_mean`` is detached.
    """
    bias = ((mean - old_mean.detach()) ** 2).mean(dim=tuple(range(1, mean.ndim))) / (2 * scale**2)
    log_ratio = (logp - old_logp + bias) * scale
    per_sample, ratio, high, low = clipped_surrogate(log_ratio, torch.zeros_like(log_ratio), advantages, clip_eps)
    per_sample = per_sample / (-dt)
    return _per_step_loss(per_sample, ratio, high, low, kl=kl, beta=beta, is_weights=is_weights)


def asymmetric_clipped_surrogate(
    ratio: Tensor, advantages: Tensor, eps_low: float, eps_high: float
) -> tuple[Tensor, Tensor, Tensor]:
    """PPO's clipped objective with DAPO's asymmetric range ``[1 - eps_low, 1 + eps_high]`` on given ratios.

    Returns ``(loss, clipped_high, clipped_low)`` elementwise, the masks marking where the clipped branch is
    the active one, by side (as :func:`clipped_surrogate`).
    """
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - eps_low, 1 + eps_high)
    active = clipped > unclipped
    return (
        torch.maximum(unclipped, clipped),
        (active & (ratio > 1 + eps_high)).float(),
        (active & (ratio < 1 - eps_low)).float(),
    )


def _sequence_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Mean over rows of each row's masked token mean; rows without a real token are left out (so a
    micro-batch's share of the mean is its share of the real rows)."""
    per_row = _on_real(x, mask).sum(1) / mask.sum(1).clamp_min(1)
    return per_row.sum() / (mask.sum(1) > 0).sum().clamp_min(1)


Aggregation = Literal["token_mean", "sequence_mean", "sequence_ratio"]
"""How :func:`token_policy_loss` forms and averages its terms (see there)."""

AGGREGATIONS: tuple[str, ...] = get_args(Aggregation)


def aggregation_units(mask: Tensor, aggregation: str) -> Tensor:
    """The units :func:`token_policy_loss` averages over, as a mask whose sum counts them: the (N, T) real
    tokens for ``token_mean``, the (N,) refinements with a real token for the two per-sequence modes."""
    return mask if aggregation == "token_mean" else mask.bool().any(1)


def token_policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    ref_logp: Tensor | None = None,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    beta: float = 0.0,
    aggregation: Aggregation = "token_mean",
    is_weights: Tensor | None = None,
) -> LossOutput:
    """The refiner's clipped policy loss over generated tokens, one function for its three aggregations.

    ``logp``, ``old_logp``, ``ref_logp``, ``is_weights`` and ``mask`` are (N, T) over generated tokens,
    ``advantages`` (N,). The surrogate is ``max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))`` (DAPO's
    clip-higher when ``eps_high > eps_low``), times the detached ``is_weights`` (not the KL term), plus
    ``beta`` times the k3 KL to the reference. ``aggregation``:

    - ``token_mean``: a ratio ``r = exp(logp - old)`` per token, every real token of the batch weighing the
      same (a long refinement weighs by its length; the project's GRPO default and DAPO's choice);
    - ``sequence_mean``: the same per-token terms, each refinement's token mean first, then the mean over
      refinements (the original GRPO);
    - ``sequence_ratio``: GSPO's one ratio per refinement, the geometric mean of its token ratios ``exp(mean_t(
      logp - old))`` (length-normalized, so it clips on a narrow range such as GSPO's ``3e-4 / 4e-4``), each
      refinement's weight the geometric mean of its tokens' ``is_weights``, refinements averaged.

    The KL term is a token mean for ``token_mean`` and a per-refinement mean for the other two (in each case
    the policy term's units). Rows without a real token are left out of every per-refinement mean.
    """
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")
    logp, old_logp, ref_logp, is_weights = _real_inputs(mask, logp, old_logp, ref_logp, is_weights)
    maskf = mask.to(logp.dtype)
    if aggregation == "sequence_ratio":
        # Only GSPO's ratio is formed per row: the tokens' log-ratios (and log-weights) are averaged first,
        # and the terms are then over the (N,) rows that have a real token.
        length = maskf.sum(1).clamp_min(1)
        log_ratio = _on_real(logp - old_logp, mask).sum(1) / length
        if is_weights is not None:
            is_weights = torch.exp(_on_real(torch.log(is_weights.detach()), mask).sum(1) / length)
        adv, terms = advantages, aggregation_units(maskf, aggregation).to(logp.dtype)
    else:
        log_ratio, adv, terms = logp - old_logp, advantages[:, None], maskf
    ratio = torch.exp(log_ratio)
    per_term, high, low = asymmetric_clipped_surrogate(ratio, adv, eps_low, eps_high)
    if is_weights is not None:
        per_term = per_term * is_weights.detach()
    # A mean over the real terms, except sequence_mean's per-token terms: each row's mean first.
    reduce = _sequence_mean if aggregation == "sequence_mean" else _masked_mean
    pg = reduce(per_term, terms)
    # The KL is per token in every mode; averaged in the policy term's units (tokens, or rows).
    kl_reduce = _masked_mean if aggregation == "token_mean" else _sequence_mean
    kl = kl_reduce(k3_kl(logp, ref_logp), maskf) if ref_logp is not None else logp.new_zeros(())
    loss = pg + beta * kl if ref_logp is not None else pg
    real = terms.bool()
    r = ratio.detach()[real] if real.any() else ratio.new_ones(1)
    return _policy_loss_output(loss, pg, kl, r, reduce(high, terms).detach(), reduce(low, terms).detach())


def optimality_probability(advantages: Tensor, clip_max: float) -> Tensor:
    """DiffusionNFT's reward-to-optimality map: ``clamp(clamp(A, +-clip_max) / clip_max / 2 + 0.5, 0, 1)``.

    A sample at the group mean is optimal with probability 1/2; ``+clip_max`` and above is surely positive,
    ``-clip_max`` and below surely negative.
    """
    if clip_max <= 0:
        raise ValueError(f"clip_max must be > 0, got {clip_max}")
    a = advantages.clamp(-clip_max, clip_max)
    return (a / clip_max / 2 + 0.5).clamp(0, 1)


def nft_loss(
    velocity: Tensor,
    old_velocity: Tensor,
    xt: Tensor,
    x0: Tensor,
    t: Tensor,
    r: Tensor,
    *,
    nft_beta: float = 1.0,
    clip_max: float = 5.0,
    ref_velocity: Tensor | None = None,
    kl_beta: float = 0.0,
) -> LossOutput:
    """DiffusionNFT's negative-aware fine-tuning loss at one forward-process point per sample.

    With the current prediction ``v`` and the old policy's ``v_old`` (detached), the implicit positive policy
    is ``v+ = beta v + (1 - beta) v_old`` and the implicit negative one ``v- = (1 + beta) v_old - beta v``. Each
    predicts ``x0`` as ``xt - t v``; its squared error to the sample's ``x0`` is divided by the detached mean
    absolute error (adaptive weighting, computed in float64, floored at 1e-5). The loss is
    ``clip_max * mean(r * err+ / beta + (1 - r) * err- / beta)`` with ``r`` (N,) the optimality probability
    (:func:`optimality_probability`), plus ``kl_beta`` times the mean squared distance of ``v`` to the
    reference's prediction. ``t`` is (N,). Statistics: ``pg_loss`` the policy term, ``kl`` the KL term; the
    ratio fields are 1 and the clip fractions 0 (there is no ratio).
    """
    if nft_beta <= 0:
        raise ValueError(f"nft_beta must be > 0, got {nft_beta}")
    dims = tuple(range(1, x0.ndim))
    tt = t.reshape(-1, *([1] * (x0.ndim - 1))).to(velocity.dtype)
    old = old_velocity.detach()
    positive = nft_beta * velocity + (1 - nft_beta) * old
    negative = (1 + nft_beta) * old - nft_beta * velocity

    def weighted_error(v: Tensor) -> Tensor:
        pred = xt - tt * v
        with torch.no_grad():
            weight = (pred.double() - x0.double()).abs().mean(dim=dims, keepdim=True).clamp_min(1e-5)
        return ((pred - x0) ** 2 / weight).mean(dim=dims)

    per_sample = r * weighted_error(positive) / nft_beta + (1 - r) * weighted_error(negative) / nft_beta
    pg = (per_sample * clip_max).mean()
    if ref_velocity is not None:
        kl = ((velocity - ref_velocity.detach()) ** 2).mean(dim=dims).mean()
        loss = pg + kl_beta * kl
    else:
        kl, loss = velocity.new_zeros(()), pg
    one, zero = velocity.new_ones(()), velocity.new_zeros(())
    return LossOutput(
        loss=loss,
        pg_loss=pg.detach(),
        kl=kl.detach(),
        ratio_mean=one,
        ratio_min=one,
        ratio_max=one,
        clip_frac_high=zero,
        clip_frac_low=zero,
        extras={"old_deviation": ((velocity.detach() - old) ** 2).mean()},
    )
