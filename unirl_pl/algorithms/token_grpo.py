"""Token-level GRPO of the prompt refiner, with DAPO's clip-higher and the choice of aggregation.

The default (``TokenGRPO()``) is the project's refiner loss: per generated token the clipped ratio
``exp(logp - old)`` on ``[1 - eps, 1 + eps]`` (``eps = model.llm_loss.clip_eps``), averaged over every real
token of the batch, plus the k3 KL to the adapter-disabled reference (:func:`grpo.lm_loss`). DAPO (Yu et al.,
2025) raises the upper clip (``clip_eps_high`` 0.28 with 0.2 below) so that unlikely tokens with a positive
advantage can grow, and aggregates over tokens (``token_mean``) rather than per sequence first.
"""

from __future__ import annotations

from typing import Literal

from torch import Tensor

from unirl_pl.algorithms.base import LossInputs, RefinerAlgorithm
from unirl_pl.losses import LossOutput, refiner_token_loss
from unirl_pl.method import grpo
from unirl_pl.records import LMRecord

Aggregation = Literal["token_mean", "sequence_mean"]


class TokenGRPO(RefinerAlgorithm):
    """Token-level GRPO of the refiner: the default refiner algorithm.

    Args:
        clip_eps_high: Upper clip range ``1 + clip_eps_high`` (DAPO's clip-higher; None: symmetric, the
            expert's ``clip_eps``, which stays the lower range).
        aggregation: ``token_mean``: mean over every real token of the batch (a refinement weighs by its
            length; DAPO); ``sequence_mean``: each refinement's token mean, then the mean over refinements
            (the original GRPO).
    """

    def __init__(self, clip_eps_high: float | None = None, aggregation: Aggregation = "token_mean") -> None:
        if clip_eps_high is not None and clip_eps_high <= 0:
            raise ValueError(f"clip_eps_high must be > 0 or null, got {clip_eps_high}")
        if aggregation not in ("token_mean", "sequence_mean"):
            raise ValueError(f"aggregation must be 'token_mean' or 'sequence_mean', got {aggregation!r}")
        self.clip_eps_high, self.aggregation = clip_eps_high, aggregation

    @property
    def plain(self) -> bool:
        """Whether this is the project's original loss (symmetric clip, token mean)."""
        return self.clip_eps_high is None and self.aggregation == "token_mean"

    def chunk_loss(self, inputs: LossInputs) -> LossOutput:
        if self.plain:
            i = inputs
            return grpo.lm_loss(i.loop, i.record, i.advantages, i.settings, i.reference, anchor=i.anchor)
        advantages, record, settings = inputs.advantages, inputs.record, inputs.settings

        def term(logp: Tensor, old: Tensor, ref: Tensor | None, weights: Tensor | None) -> LossOutput:
            return refiner_token_loss(
                logp,
                old,
                advantages,
                record.gen_mask,
                ref_logp=ref,
                eps_low=settings.clip_eps,
                eps_high=settings.clip_eps if self.clip_eps_high is None else self.clip_eps_high,
                beta=settings.beta,
                aggregation=self.aggregation,
                is_weights=weights,
            )

        return grpo.token_loss(inputs, term)

    def units(self, record: LMRecord) -> Tensor:
        return record.gen_mask if self.aggregation == "token_mean" else record.gen_mask.any(1)


class DAPO(TokenGRPO):
    """DAPO's refiner loss: clip-higher (``[1 - clip_eps, 1 + clip_eps_high]``, 0.2 / 0.28) and token-mean
    aggregation. (Dynamic sampling, which drops zero-spread groups and refills the batch, is not implemented:
    a zero-spread group already has advantage 0 and adds only to the token count.)

    Args:
        clip_eps_high: Upper clip range (DAPO: 0.28).
    """

    def __init__(self, clip_eps_high: float = 0.28) -> None:
        super().__init__(clip_eps_high=clip_eps_high, aggregation="token_mean")
