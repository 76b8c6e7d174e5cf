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
from typing import Any, Literal

import torch
from torch import Tensor

from unirl_pl.loops import ARDecode, DiffusionDenoise
from unirl_pl.losses import LossOutput, flow_grpo_loss, grpo_token_loss
from unirl_pl.records import DiTRecord, LMRecord
from unirl_pl.rollout_correction import truncated_importance_weights
from unirl_pl.sampling import flow_kl


@dataclass(frozen=True)
class ExpertLoss:
    """Per-expert policy-loss settings.

    Args:
        clip_eps: PPO ratio clip range ``[1-eps, 1+eps]`` (GRPO uses ~0.2, Flow-GRPO ~1e-4).
        beta: Weight of the KL to the adapter-disabled reference policy (0 skips the reference forward).
        grad_clip: Clip this expert's gradient norm to this value (None: no clipping, norm still logged).
        rollout_correction: ``off`` anchors the PPO ratio at the behavior log-prob rollout recorded (on-policy
            by construction: the C2 gate proves the two agree). ``tis`` corrects a numerics mismatch between
            rollout and training (bf16 kernels, KV-cache decode, other batch shapes) instead: the ratio is
            anchored at the log-prob the trainer recomputes before any update, and each term's policy loss is
            weighted by the truncated importance weight ``min(exp(recomputed - behavior), tis_cap)`` (per
            token for the LM, per SDE step for the DiT), as verl's decoupled rollout correction
            (``rollout_is: token``) and TRL's ``vllm_importance_sampling_correction`` do. The C2 gate then
            measures and logs (``rollout_corr/*``) and stops only on a mismatch far beyond numerics.
        tis_cap: Upper truncation of the importance weight (verl's ``rollout_is_threshold`` and TRL's
            ``vllm_importance_sampling_cap``, both 2.0 by default); >= 1 so agreeing terms keep weight 1.
        mini_batches: Optimizer steps per PPO epoch over one rollout: the expert's records split into this many
            mini-batches, prompt groups kept whole (:mod:`unirl_pl.method.minibatch`). The first is on-policy
            (the C2 gate proves it on the whole rollout, before any update); the later ones are stale by design,
            which is what the clip range acts on. 1: the whole rollout in one step.
    """

    clip_eps: float = 0.2
    beta: float = 0.01
    grad_clip: float | None = 1.0
    rollout_correction: Literal["off", "tis"] = "off"
    tis_cap: float = 2.0
    mini_batches: int = 1

    def __post_init__(self) -> None:
        if self.mini_batches < 1:
            raise ValueError(f"mini_batches must be >= 1, got {self.mini_batches}")
        if self.rollout_correction not in ("off", "tis"):
            raise ValueError(f"rollout_correction must be 'off' or 'tis', got {self.rollout_correction!r}")
        if not self.tis_cap >= 1.0:
            raise ValueError(f"tis_cap must be >= 1 (agreeing log-probs have weight 1), got {self.tis_cap}")
        if self.clip_eps <= 0:
            raise ValueError(f"clip_eps must be > 0, got {self.clip_eps}")
        if self.beta < 0:
            raise ValueError(f"beta must be >= 0 (0 turns the KL term off), got {self.beta}")
        if self.grad_clip is not None and self.grad_clip <= 0:
            raise ValueError(f"grad_clip must be > 0 or null, got {self.grad_clip}")


Reference = Callable[[], AbstractContextManager[None]]
"""A context in which the expert is its reference policy (its adapter disabled)."""


@dataclass(frozen=True)
class LossInputs:
    """What one expert's loss reads: its loop, its record of the rollout, the advantages of the record's rows,
    its loss settings (``ExpertLoss``), its reference policy and, under a rollout correction, the anchor (the
    first PPO epoch's recomputed log-probs, None before that). For a mini-batch, ``whole`` is the rollout's
    whole record and ``index`` the rows of it that ``record`` holds (None: ``record`` is the whole record)."""

    loop: Any
    record: Any
    advantages: Tensor
    settings: Any
    reference: Reference
    anchor: Tensor | None = None
    whole: Any = None
    index: Tensor | None = None

    def rows(self, a: int, b: int) -> LossInputs:
        """The same inputs restricted to record rows ``[a, b)``."""
        anchor = None if self.anchor is None else self.anchor[a:b]
        return replace(self, record=self.record.slice(a, b), advantages=self.advantages[a:b], anchor=anchor)


def anchor_and_weights(
    logp: Tensor, behavior: Tensor, settings: ExpertLoss, anchor: Tensor | None
) -> tuple[Tensor, Tensor | None]:
    """The PPO ratio's denominator and the importance weights of one loss term.

    Without a rollout correction the denominator is the behavior log-prob and there are no weights. With
    ``tis`` it is ``anchor`` (the recompute of the first PPO epoch, kept for the later ones) or, on the
    first epoch, this forward's own detached log-prob (the weights have not moved yet, so it is the "old"
    policy); the weights are its truncated ratio to the behavior log-prob.
    """
    if settings.rollout_correction == "off":
        return behavior, None
    old = logp.detach() if anchor is None else anchor
    return old, truncated_importance_weights(old, behavior, settings.tis_cap)


def score_with_reference(
    loop: ARDecode, record: LMRecord, settings: ExpertLoss, reference: Reference
) -> tuple[Tensor, Tensor | None]:
    """The record's token log-probs under the current weights (with grad) and, when ``settings.beta > 0``,
    under the reference (no grad)."""
    logp = loop.score(record)
    ref = None
    if settings.beta > 0:
        with torch.no_grad(), reference():
            ref = loop.score(record)
    return logp, ref


def lm_loss(
    loop: ARDecode,
    record: LMRecord,
    advantages: Tensor,
    settings: ExpertLoss,
    reference: Reference,
    anchor: Tensor | None = None,
) -> LossOutput:
    """Token-level GRPO of the refiner over the generated tokens of ``record``; ``anchor`` is the first PPO
    epoch's recomputed log-probs when a rollout correction is on (see :func:`anchor_and_weights`)."""

    def term(logp: Tensor, old: Tensor, ref: Tensor | None, weights: Tensor | None) -> LossOutput:
        return grpo_token_loss(
            logp,
            old,
            advantages,
            record.gen_mask,
            ref_logp=ref,
            clip_eps=settings.clip_eps,
            beta=settings.beta,
            is_weights=weights,
        )

    return token_loss(LossInputs(loop, record, advantages, settings, reference, anchor), term)


# (recomputed token log-probs, old log-probs, reference log-probs or None, importance weights or None)
TokenTerm = Callable[[Tensor, Tensor, Any, Any], LossOutput]


def token_loss(inputs: LossInputs, term: TokenTerm) -> LossOutput:
    """A refiner loss ``term(logp, old, ref, weights)`` of ``record``'s tokens re-scored under the current
    weights, the reference scored when ``settings.beta > 0`` and the old log-probs the behavior ones (or
    the anchor under a rollout correction); its log-probs are the detached recomputed ones (what C2 compares)."""
    logp, ref = score_with_reference(inputs.loop, inputs.record, inputs.settings, inputs.reference)
    old, weights = anchor_and_weights(logp, inputs.record.old_logp, inputs.settings, inputs.anchor)
    return replace(term(logp, old, ref, weights), logp=logp.detach())


def dit_loss(
    loop: DiffusionDenoise,
    record: DiTRecord,
    advantages: Tensor,
    settings: ExpertLoss,
    reference: Reference,
    backward: Callable[[Tensor], None] | None = None,
    anchor: Tensor | None = None,
) -> LossOutput:
    """Flow-GRPO of the generator over every recorded SDE step of ``record``.

    The loss is the mean over (sample, step) pairs, which matches Flow-GRPO's gradient accumulation over
    timesteps. With ``backward`` each (step, micro-batch) term is backpropagated as soon as it is computed
    and its graph freed, so peak memory holds one step's activations whatever the window (the returned
    loss is then detached and marked ``backpropagated``); without it the terms are summed into one graph.
    ``anchor`` (N, S) is the first PPO epoch's recompute when a rollout correction is on.
    """

    def term(
        step: int, rows: slice, logp: Tensor, mean: Tensor, std: Tensor, kl: Tensor | None, old: Tensor, weights: Any
    ) -> LossOutput:
        return flow_grpo_loss(
            logp, old, advantages[rows], kl=kl, clip_eps=settings.clip_eps, beta=settings.beta, is_weights=weights
        )

    return per_step_loss(LossInputs(loop, record, advantages, settings, reference, anchor), term, backward)


# (step, rows, recomputed log-prob, step mean, step std, KL or None, old log-prob, importance weights or None)
StepTerm = Callable[[int, slice, Tensor, Tensor, Tensor, Any, Tensor, Any], LossOutput]


def per_step_loss(inputs: LossInputs, term: StepTerm, backward: Callable[[Tensor], None] | None = None) -> LossOutput:
    """The mean over the recorded (sample, step) pairs of ``term``, one (step, micro-batch) at a time.

    For each slice the step is re-scored under the current weights (log-prob, mean, std), its KL to the
    reference is built when ``settings.beta > 0``, and the behavior (or, with a rollout correction, the
    anchor) log-prob and its importance weights are chosen; ``term(step, rows, logp, mean, std, kl, old,
    weights)`` turns them into the slice's loss. The log-probs of the returned loss are the recomputed ones
    (what C2 compares).
    """
    loop, record, settings, anchor = inputs.loop, inputs.record, inputs.settings, inputs.anchor
    total = record.old_logp.numel()
    parts: list[tuple[float, LossOutput]] = []
    recomputed = torch.empty_like(record.old_logp)
    for step, (a, b) in record.steps():
        logp, mean, std = loop.step_logprob(record, step, (a, b))
        recomputed[a:b, step] = logp.detach()
        kl = step_kl(loop, record, step, (a, b), mean, std, settings.beta, inputs.reference)
        behavior = record.old_logp[a:b, step]
        old, weights = anchor_and_weights(logp, behavior, settings, None if anchor is None else anchor[a:b, step])
        add_part(parts, (b - a) / total, term(step, slice(a, b), logp, mean, std, kl, old, weights), backward)
    return replace(weighted_loss(parts, backpropagated=backward is not None), logp=recomputed)


def step_kl(
    loop: DiffusionDenoise,
    record: DiTRecord,
    step: int,
    chunk: tuple[int, int],
    mean: Tensor,
    std: Tensor,
    beta: float,
    reference: Reference,
) -> Tensor | None:
    """Flow-GRPO's per-sample KL of one (step, micro-batch) to the adapter-disabled reference; None when
    ``beta`` is 0 (the reference forward is then not paid for)."""
    if beta <= 0:
        return None
    with torch.no_grad(), reference():
        _, ref_mean, _ = loop.step_logprob(record, step, chunk)
    return flow_kl(mean, ref_mean, std)


def add_part(
    parts: list[tuple[float, LossOutput]], share: float, out: LossOutput, backward: Callable[[Tensor], None] | None
) -> None:
    """Keep one slice's loss with its share of the batch for :func:`weighted_loss`; with ``backward``, its
    gradient goes back right away, so each slice's graph is freed before the next one is built."""
    if backward is not None:
        backward(share * out.loss)
    parts.append((share, out))


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
