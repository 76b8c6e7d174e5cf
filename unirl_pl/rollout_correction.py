"""The rollout correction's math as pure functions: truncated importance weights of the rollout/train
numerics mismatch and the statistics the C2 gate logs of it (``model.<expert>_loss.rollout_correction: tis``).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


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
