"""Joint GRPO: each loop's policy loss on its behavior record, with the expert's own settings.

``ar_decode`` records train with token-level GRPO (clipped ratio, k3 KL to the adapter-disabled
reference); ``diffusion_denoise`` records with Flow-GRPO (clipped ratio per SDE step, KL of the step
means to the adapter-disabled reference). The formulas are the pure functions of :mod:`unirl_pl.losses`;
this module only feeds them the recomputed log-probs.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from unirl_pl.loops import ARDecode, DiffusionDenoise
from unirl_pl.losses import LossOutput, flow_grpo_loss, grpo_token_loss
from unirl_pl.records import DiTRecord, LMRecord
from unirl_pl.sampling import flow_kl


@dataclass(frozen=True)
class ExpertLoss:
    """Per-expert policy-loss settings.

    Args:
        clip_eps: PPO ratio clip range ``[1-eps, 1+eps]`` (GRPO uses ~0.2, Flow-GRPO ~1e-4).
        beta: Weight of the KL to the adapter-disabled reference policy (0 skips the reference forward).
        grad_clip: Clip this expert's gradient norm to this value (None: no clipping, norm still logged).
    """

    clip_eps: float = 0.2
    beta: float = 0.01
    grad_clip: float | None = 1.0

    def __post_init__(self) -> None:
        if self.clip_eps <= 0:
            raise ValueError(f"clip_eps must be > 0, got {self.clip_eps}")
        if self.beta < 0:
            raise ValueError(f"beta must be >= 0 (0 turns the KL term off), got {self.beta}")
        if self.grad_clip is not None and self.grad_clip <= 0:
            raise ValueError(f"grad_clip must be > 0 or null, got {self.grad_clip}")


Reference = Callable[[], AbstractContextManager[None]]
"""A context in which the expert is its reference policy (its adapter disabled)."""


def lm_loss(
    loop: ARDecode, record: LMRecord, advantages: Tensor, settings: ExpertLoss, reference: Reference
) -> LossOutput:
    """Token-level GRPO of the refiner over the generated tokens of ``record``."""
    logp = loop.score(record)
    ref = None
    if settings.beta > 0:
        with torch.no_grad(), reference():
            ref = loop.score(record)
    out = grpo_token_loss(
        logp,
        record.old_logp,
        advantages,
        record.gen_mask,
        ref_logp=ref,
        clip_eps=settings.clip_eps,
        beta=settings.beta,
    )
    return replace(out, logp=logp.detach())


def dit_loss(
    loop: DiffusionDenoise,
    record: DiTRecord,
    advantages: Tensor,
    settings: ExpertLoss,
    reference: Reference,
    backward: Callable[[Tensor], None] | None = None,
) -> LossOutput:
    """Flow-GRPO of the generator over every recorded SDE step of ``record``.

    The loss is the mean over (sample, step) pairs, which matches Flow-GRPO's gradient accumulation over
    timesteps. With ``backward`` each (step, micro-batch) term is backpropagated as soon as it is computed
    and its graph freed, so peak memory holds one step's activations whatever the window (the returned
    loss is then detached and marked ``backpropagated``); without it the terms are summed into one graph.
    """
    total = record.old_logp.numel()
    parts: list[tuple[float, LossOutput]] = []
    recomputed = torch.empty_like(record.old_logp)
    for step, (a, b) in record.steps():
        logp, mean, std = loop.step_logprob(record, step, (a, b))
        recomputed[a:b, step] = logp.detach()
        kl = None
        if settings.beta > 0:
            with torch.no_grad(), reference():
                _, ref_mean, _ = loop.step_logprob(record, step, (a, b))
            kl = flow_kl(mean, ref_mean, std)
        out = flow_grpo_loss(
            logp, record.old_logp[a:b, step], advantages[a:b], kl=kl, clip_eps=settings.clip_eps, beta=settings.beta
        )
        weight = (b - a) / total
        if backward is not None:
            backward(weight * out.loss)
        parts.append((weight, out))
    return replace(weighted_loss(parts, backpropagated=backward is not None), logp=recomputed)


def weighted_loss(parts: list[tuple[float, LossOutput]], backpropagated: bool = False) -> LossOutput:
    """One loss from terms that are means over disjoint slices: ``sum(w * term)`` with ``w`` the slice's share.

    Means and fractions combine the same way; the ratio's min and max are over all slices.
    """
    loss = sum(w * o.loss for w, o in parts)
    assert isinstance(loss, Tensor)
    return LossOutput(
        loss=loss.detach() if backpropagated else loss,
        pg_loss=sum(w * o.pg_loss for w, o in parts),
        kl=sum(w * o.kl for w, o in parts),
        ratio_mean=sum(w * o.ratio_mean for w, o in parts),
        ratio_min=torch.stack([o.ratio_min for _, o in parts]).min(),
        ratio_max=torch.stack([o.ratio_max for _, o in parts]).max(),
        clip_frac_high=sum(w * o.clip_frac_high for w, o in parts),
        clip_frac_low=sum(w * o.clip_frac_low for w, o in parts),
        backpropagated=backpropagated,
    )
