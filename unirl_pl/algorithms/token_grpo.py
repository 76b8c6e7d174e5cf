"""Token-level GRPO of the prompt refiner, with DAPO's clip-higher and the choice of aggregation.

The default (``TokenGRPO()``) is the project's refiner loss: per generated token the clipped ratio
``exp(logp - old)`` on ``[1 - eps, 1 + eps]`` (``eps = model.llm_loss.clip_eps``), averaged over every real
token of the batch, plus the k3 KL to the adapter-disabled reference (:func:`drivers.refiner_loss` in
:func:`~unirl_pl.losses.token_policy_loss`'s ``token_mean``). DAPO (Yu et al., 2025) raises the upper clip
(``clip_eps_high`` 0.28 with 0.2 below) so that unlikely tokens with a positive advantage can grow, and
aggregates over tokens (``token_mean``) rather than per sequence first.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import Tensor

from unirl_pl.algorithms.base import LossInputs, RefinerAlgorithm
from unirl_pl.algorithms.drivers import refiner_loss
from unirl_pl.group_stats import informative_groups
from unirl_pl.loops.config import RolloutConfig
from unirl_pl.losses import LossOutput, aggregation_units
from unirl_pl.records import LMRecord

Aggregation = Literal["token_mean", "sequence_mean"]


def overlong_penalty(lengths: Tensor, max_len: int, buffer: int, factor: float = 1.0) -> Tensor:
    """DAPO's soft overlong punishment (Yu et al., 2025, eq. 13) of responses of ``lengths`` tokens.

    With ``L_max = max_len`` and ``L_cache = buffer``: 0 up to ``L_max - L_cache`` tokens, then
    ``(L_max - L_cache - |y|) / L_cache * factor`` (linear from 0 to ``-factor`` over the buffer), and
    ``-factor`` beyond ``L_max``. verl's ``DAPORewardManager`` (``overlong_buffer.len``, ``penalty_factor``):
    ``min(-(|y| - (L_max - L_cache)) / L_cache * factor, 0)``, the same up to ``L_max`` (a response is never
    longer). Float64, shaped as ``lengths``.
    """
    expected = max_len - buffer
    penalty = (expected - lengths.double()) / buffer * factor
    return penalty.clamp(min=-factor, max=0.0)


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

    def chunk_loss(self, inputs: LossInputs) -> LossOutput:
        eps = inputs.settings.clip_eps
        high = eps if self.clip_eps_high is None else self.clip_eps_high
        return refiner_loss(inputs, eps_low=eps, eps_high=high, aggregation=self.aggregation)

    def units(self, record: LMRecord) -> Tensor:
        return aggregation_units(record.gen_mask, self.aggregation)


class DAPO(TokenGRPO):
    """DAPO's refiner loss: clip-higher (``[1 - clip_eps, 1 + clip_eps_high]``, 0.2 / 0.28), token-mean
    aggregation and dynamic sampling.

    Dynamic sampling drops every group whose rewards are all equal (zero spread: every advantage is 0, so it
    adds nothing but tokens to the mean's denominator) and trains on up to ``train_groups`` of the others.
    DAPO keeps sampling until the batch is full; here the pool is the step's own rollout: with
    ``data.prompts_per_step`` above ``train_groups`` the extra groups refill the places of the dropped ones
    (``--data.prompts_per_step=12 --model.llm_algorithm.init_args.train_groups=8`` rolls out 12 groups and
    trains the refiner on 8 informative ones). A step with no informative group trains on all of them (every
    advantage 0: only the KL term moves the adapter). The generator, when it trains, sees the whole rollout.
    ``llm/train_groups`` logs how many informative groups the refiner trained on (0 when none was).

    Overlong reward shaping (``overlong_buffer``, off by default): a refinement of ``|y|`` generated tokens
    (through its eos) gets :func:`overlong_penalty` with ``L_max = model.rollout.max_new_tokens`` and ``L_cache
    = overlong_buffer`` added to its reward for the refiner's advantage only (the generator's advantage, the
    logged reward and dynamic sampling's spread keep the reward, as verl's ``filter_groups.metric=acc``).
    ``llm/overlong_penalty`` logs its mean over the step's refinements.

    Args:
        clip_eps_high: Upper clip range (DAPO: 0.28).
        dynamic_sampling: Drop zero-spread groups from the refiner's loss.
        train_groups: The most informative groups trained on per step and process (None: all of them).
        overlong_buffer: DAPO's ``L_cache`` in tokens, at most ``rollout.max_new_tokens`` (None: no shaping;
            verl's DAPO recipe: 4096 of 20480).
        overlong_penalty_factor: The penalty at ``L_max`` (verl: ``overlong_buffer.penalty_factor`` 1.0).
    """

    def __init__(
        self,
        clip_eps_high: float = 0.28,
        dynamic_sampling: bool = True,
        train_groups: int | None = None,
        overlong_buffer: int | None = None,
        overlong_penalty_factor: float = 1.0,
    ) -> None:
        super().__init__(clip_eps_high=clip_eps_high, aggregation="token_mean")
        if train_groups is not None and train_groups < 1:
            raise ValueError(f"train_groups must be >= 1 or null, got {train_groups}")
        if train_groups is not None and not dynamic_sampling:
            raise ValueError("train_groups needs dynamic_sampling: true (it counts the informative groups kept)")
        if overlong_buffer is not None and overlong_buffer < 1:
            raise ValueError(f"overlong_buffer must be >= 1 token or null, got {overlong_buffer}")
        if overlong_penalty_factor < 0:
            raise ValueError(f"overlong_penalty_factor must be >= 0, got {overlong_penalty_factor}")
        self.dynamic_sampling, self.max_groups = dynamic_sampling, train_groups
        self.overlong_buffer, self.overlong_penalty_factor = overlong_buffer, float(overlong_penalty_factor)
        self.max_new_tokens: int | None = None
        self._trained_groups: int | None = None
        self._overlong: float | None = None

    def bind(self, expert: Any, loop: Any, trained: bool) -> None:
        super().bind(expert, loop, trained)
        self.max_new_tokens = int(loop.config.max_new_tokens)

    def check_rollout(self, config: RolloutConfig, trained: bool) -> None:
        if self.overlong_buffer is not None and self.overlong_buffer > config.max_new_tokens:
            raise ValueError(
                f"DAPO: overlong_buffer={self.overlong_buffer} exceeds model.rollout.max_new_tokens="
                f"{config.max_new_tokens} (L_cache <= L_max); lower it"
            )

    def shape_rewards(self, text_rewards: Tensor, record: LMRecord) -> Tensor | None:
        if self.overlong_buffer is None:
            return None
        if self.max_new_tokens is None:
            raise RuntimeError("DAPO's overlong shaping reads max_new_tokens at bind(): bind the algorithm first")
        lengths = record.gen_mask.sum(1).cpu()
        penalty = overlong_penalty(lengths, self.max_new_tokens, self.overlong_buffer, self.overlong_penalty_factor)
        self._overlong = float(penalty.mean()) if len(penalty) else 0.0
        rows = record.rows.to(text_rewards.device)
        return text_rewards.index_add(0, rows, penalty.to(text_rewards.device, text_rewards.dtype))

    def train_groups(self, text_rewards: Tensor, groups: Tensor) -> Tensor | None:
        if not self.dynamic_sampling:
            return None
        keep = informative_groups(text_rewards, groups)
        if self.max_groups is not None:
            keep &= keep.cumsum(0) <= self.max_groups  # the first train_groups informative ones
        # The informative groups trained on: 0 when there is none, although the step then trains on all of them
        # (advantages 0, only the KL moves), never on an empty record; logging the fallback's count would hide it.
        self._trained_groups = int(keep.sum())
        return keep if keep.any() else torch.ones_like(keep)

    def metrics(self, name: str, record: LMRecord) -> dict[str, Tensor | float]:
        metrics = super().metrics(name, record)
        if self._trained_groups is not None:
            metrics[f"{name}/train_groups"] = float(self._trained_groups)
        if self._overlong is not None:
            metrics[f"{name}/overlong_penalty"] = self._overlong
        return metrics
