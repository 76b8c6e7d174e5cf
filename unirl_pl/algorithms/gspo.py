"""GSPO (Zheng et al., 2025): the refiner's PPO ratio per sequence instead of per token.

Each refinement's importance ratio is the geometric mean of its token ratios, ``exp(mean_t(logp - old))``,
clipped on a narrow asymmetric range (GSPO's ``3e-4`` below and ``4e-4`` above) and multiplied by the
refinement's advantage; refinements average with equal weight. The reward is a sequence-level quantity, so
its ratio is too: a single outlier token no longer decides the clip of its sequence.
"""

from __future__ import annotations

from torch import Tensor

from unirl_pl.algorithms.base import LossInputs, RefinerAlgorithm
from unirl_pl.algorithms.drivers import refiner_loss
from unirl_pl.losses import LossOutput, aggregation_units
from unirl_pl.records import LMRecord


class GSPO(RefinerAlgorithm):
    """Sequence-level clipped ratio of the refiner (the KL to the reference stays token-level k3).

    Args:
        clip_eps_low: Lower clip range ``1 - clip_eps_low`` of the sequence ratio (GSPO: 3e-4); it replaces
            ``model.llm_loss.clip_eps``, whose 0.2 is a token-ratio range.
        clip_eps_high: Upper clip range ``1 + clip_eps_high`` (GSPO: 4e-4).
    """

    def __init__(self, clip_eps_low: float = 3e-4, clip_eps_high: float = 4e-4) -> None:
        if clip_eps_low <= 0 or clip_eps_high <= 0:
            raise ValueError(f"clip ranges must be > 0, got {clip_eps_low} and {clip_eps_high}")
        self.clip_eps_low, self.clip_eps_high = clip_eps_low, clip_eps_high

    def chunk_loss(self, inputs: LossInputs) -> LossOutput:
        # The refiner's one token loss in its per-sequence-ratio mode, on GSPO's own clip range.
        return refiner_loss(
            inputs, eps_low=self.clip_eps_low, eps_high=self.clip_eps_high, aggregation="sequence_ratio"
        )

    def units(self, record: LMRecord) -> Tensor:
        # The policy term averages refinements (those with a real token).
        return aggregation_units(record.gen_mask, "sequence_ratio")
