"""Joint GRPO: each loop's policy loss on its behavior record, with the expert's own settings.

``ar_decode`` records train with token-level GRPO (clipped ratio, k3 KL to the adapter-disabled
reference); ``diffusion_denoise`` records with Flow-GRPO (clipped ratio per SDE step, KL of the step
means to the adapter-disabled reference). The formulas are the pure functions of :mod:`unirl_pl.losses`;
this module only feeds them the recomputed log-probs.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass

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
    return grpo_token_loss(
        logp,
        record.old_logp,
        advantages,
        record.gen_mask,
        ref_logp=ref,
        clip_eps=settings.clip_eps,
        beta=settings.beta,
    )


def dit_loss(
    loop: DiffusionDenoise, record: DiTRecord, advantages: Tensor, settings: ExpertLoss, reference: Reference
) -> LossOutput:
    """Flow-GRPO of the generator over every recorded SDE step of ``record``."""
    logps, kls = [], []
    for step in range(record.num_steps):
        step_logp, step_kl = [], []
        for chunk in record.chunks:
            logp, mean, std = loop.step_logprob(record, step, chunk)
            step_logp.append(logp)
            if settings.beta > 0:
                with torch.no_grad(), reference():
                    _, ref_mean, _ = loop.step_logprob(record, step, chunk)
                step_kl.append(flow_kl(mean, ref_mean, std))
        logps.append(torch.cat(step_logp))
        if step_kl:
            kls.append(torch.cat(step_kl))
    # Averaging over (sample, step) pairs matches Flow-GRPO's gradient accumulation over timesteps.
    logp = torch.stack(logps, 1).flatten()
    adv = advantages.repeat_interleave(record.num_steps)
    kl = torch.stack(kls, 1).flatten() if kls else None
    return flow_grpo_loss(logp, record.old_logp.flatten(), adv, kl=kl, clip_eps=settings.clip_eps, beta=settings.beta)
