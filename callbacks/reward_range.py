"""Example plugin check: every reward of a training batch must lie inside the range the recipe declares.

A reward on the wrong scale (a score in [0, 100] where the recipe expects [0, 1], a sign flipped) does not
crash anything: it silently reshapes every advantage of its group. This check stops the run at the first
batch where it happens, before the update uses it. It is also the template for your own checks: copy this
file within ``callbacks/`` and change the hook and the test (``callbacks/README.md``).

Load it from a recipe (``python -m unirl_pl`` puts the current directory on the import path, so run from
the folder that holds ``callbacks/``)::

    trainer:
      callbacks:
        - class_path: callbacks.reward_range.RewardRangeCheck
          init_args: {low: 0.0, high: 1.0}

or add it to a recipe's callbacks on the command line::

    python -m unirl_pl fit --config recipes/tiny.yaml \\
        --trainer.callbacks+=callbacks.reward_range.RewardRangeCheck \\
        --trainer.callbacks.low=0.0 --trainer.callbacks.high=1.0
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch


class RewardRangeCheck(pl.Callback):
    """Raise ``ValueError`` if a training batch holds a reward outside ``[low, high]``.

    The hook is ``on_train_batch_start``: Lightning calls it after the module's ``on_after_batch_transfer``
    has run the rollout, so ``batch`` is the step's :class:`~unirl_pl.records.Experience` and
    ``batch.rewards`` (N,) the weighted reward total of each image sample, ``batch.prompts`` their prompts.
    A batch without ``rewards`` (another module's) is let through.

    Non-finite totals are left to ``model.nonfinite_rewards``, which sees them first: ``error`` has already
    stopped the run naming the reward, while ``drop`` and ``skip`` leave a sample out on purpose and set its
    total to NaN here; this check does not overrule that choice.

    Args:
        low: Smallest valid reward.
        high: Largest valid reward.

    Attributes:
        checked: Training batches checked so far (the tests read it).
    """

    def __init__(self, low: float = 0.0, high: float = 1.0) -> None:
        # Refused here, when the CLI builds the callback: a bad range is a configuration error (one line, exit 2).
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
        values = rewards.detach().float().cpu()
        finite = torch.isfinite(values)
        bad = finite & ((values < self.low) | (values > self.high))
        if bool(bad.any()):
            i = int(bad.nonzero()[0])
            raise ValueError(
                f"reward {float(values[i])} of sample {i} (prompt {batch.prompts[i]!r}) "
                f"is outside [{self.low}, {self.high}]"
            )
        self.checked += 1
