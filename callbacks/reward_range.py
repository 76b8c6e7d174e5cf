"""Example plugin check: every reward must be finite and inside the range the recipe declares.

A user's reward that returns NaN or a value on the wrong scale corrupts every advantage of its
group; this check stops the run at the first such batch. Load it from a recipe:

    trainer:
      callbacks:
        - class_path: callbacks.reward_range.RewardRangeCheck
          init_args: {low: 0.0, high: 1.0}
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch


class RewardRangeCheck(pl.Callback):
    """Raise if any reward of a training batch is non-finite or outside ``[low, high]``.

    Args:
        low: Smallest valid reward.
        high: Largest valid reward.
    """

    def __init__(self, low: float = 0.0, high: float = 1.0) -> None:
        if low > high:
            raise ValueError(f"low ({low}) must be <= high ({high})")
        self.low, self.high = low, high
        self.checked = 0

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        rewards = getattr(batch, "rewards", None)
        if rewards is None:
            return
        bad = ~torch.isfinite(rewards) | (rewards < self.low) | (rewards > self.high)
        if bool(bad.any()):
            i = int(bad.nonzero()[0])
            raise ValueError(
                f"reward {float(rewards[i])} of sample {i} (prompt {batch.prompts[i]!r}) "
                f"is outside [{self.low}, {self.high}]"
            )
        self.checked += 1
