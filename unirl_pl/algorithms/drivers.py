"""The loss drivers the algorithms share: they run an expert's loop to re-score its record under the current
weights (and the reference), pick the PPO ratio's denominator and importance weights, and feed the pure
formulas of :mod:`unirl_pl.losses`.

``ar_decode`` records train through :func:`refiner_loss` (the one token loss, in the algorithm's
aggregation); ``diffusion_denoise`` records through :func:`per_step_loss` (one (step, micro-batch) at a time,
Flow-GRPO's :func:`dit_loss` or an algorithm's own step term). The settings they read are an expert's
``ExpertLoss`` (:mod:`unirl_pl.method.loss_settings`), seen here only through :class:`LossSettings`, so this
package does not depend on the method layer that calls it.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from typing import Any, Protocol

import torch
from torch import Tensor

from unirl_pl.loops import ARDecode, DiffusionDenoise
from unirl_pl.losses import Aggregation, LossOutput, flow_grpo_loss, token_policy_loss
from unirl_pl.records import DiTRecord, LMRecord
from unirl_pl.rollout_correction import truncated_importance_weights
from unirl_pl.sampling import flow_kl, promptrl_kl

Reference = Callable[[], AbstractContextManager[None]]
"""A context in which the expert is its reference policy (its adapter disabled)."""


class LossSettings(Protocol):
    """What the drivers read of an expert's loss settings (``unirl_pl.method.ExpertLoss`` has them all)."""

    @property
    def clip_eps(self) -> float: ...
    @property
    def beta(self) -> float: ...
    @property
    def rollout_correction(self) -> str: ...
    @property
    def tis_cap(self) -> float: ...
    @property
    def kl_form(self) -> str: ...


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
    logp: Tensor, behavior: Tensor, settings: LossSettings, anchor: Tensor | None
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
    loop: ARDecode, record: LMRecord, settings: LossSettings, reference: Reference
) -> tuple[Tensor, Tensor | None]:
    """The record's token log-probs under the current weights (with grad) and, when ``settings.beta > 0``,
    under the reference (no grad)."""
    logp = loop.score(record)
    ref = None
    if settings.beta > 0:
        with torch.no_grad(), reference():
            ref = loop.score(record)
    return logp, ref


def refiner_loss(inputs: LossInputs, *, eps_low: float, eps_high: float, aggregation: Aggregation) -> LossOutput:
    """The refiner's PPO loss of ``inputs.record``'s tokens: :func:`~unirl_pl.losses.token_policy_loss` with
    the clip range ``[1 - eps_low, 1 + eps_high]`` and ``aggregation``, the KL weight ``settings.beta``.

    The tokens are re-scored under the current weights, the reference scored when ``settings.beta > 0`` and the
    old log-probs are the behavior ones (or the anchor under a rollout correction, with its importance
    weights); the returned ``logp`` is the detached recompute (what C2 compares). Every refiner algorithm
    (token GRPO, DAPO, GSPO) is this call with its own clip range and aggregation.
    """
    logp, ref = score_with_reference(inputs.loop, inputs.record, inputs.settings, inputs.reference)
    old, weights = anchor_and_weights(logp, inputs.record.old_logp, inputs.settings, inputs.anchor)
    out = token_policy_loss(
        logp,
        old,
        inputs.advantages,
        inputs.record.gen_mask,
        ref_logp=ref,
        eps_low=eps_low,
        eps_high=eps_high,
        beta=inputs.settings.beta,
        aggregation=aggregation,
        is_weights=weights,
    )
    return replace(out, logp=logp.detach())


def dit_loss(
    loop: DiffusionDenoise,
    record: DiTRecord,
    advantages: Tensor,
    settings: LossSettings,
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
        kl = step_kl(loop, record, step, (a, b), mean, std, settings.beta, inputs.reference, settings.kl_form)
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
    kl_form: str = "flow_grpo",
) -> Tensor | None:
    """The per-sample KL of one (step, micro-batch)'s mean to the adapter-disabled reference's, in ``kl_form``
    (``ExpertLoss.kl_form``: Flow-GRPO's :func:`~unirl_pl.sampling.flow_kl`, or PromptRL's
    :func:`~unirl_pl.sampling.promptrl_kl` on the record's own sigmas); None when ``beta`` is 0 (the reference
    forward is then not paid for)."""
    if beta <= 0:
        return None
    if kl_form not in ("flow_grpo", "promptrl"):
        raise ValueError(f"kl_form must be 'flow_grpo' or 'promptrl', got {kl_form!r}")
    if kl_form == "promptrl" and record.kind != "sde":
        # The algorithms refuse this in check_settings; a direct caller gets the same reason.
        raise ValueError(
            f"kl_form 'promptrl' divides by the Gaussian SDE step's -dt; a {record.kind!r} step's std "
            "is already its full noise scale: use kl_form 'flow_grpo'"
        )
    with torch.no_grad(), reference():
        _, ref_mean, _ = loop.step_logprob(record, step, chunk)
    if kl_form == "promptrl":
        s, s_next, _ = record.step_sigmas(step, chunk)
        return promptrl_kl(mean, ref_mean, std, s, s_next)
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
