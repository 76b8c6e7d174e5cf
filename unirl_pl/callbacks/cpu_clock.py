"""A clock of the CPU time training has cost so far, logged at each validation: the x of a score-per-cost curve."""

from __future__ import annotations

import time
from typing import Any

import lightning.pytorch as pl

METRIC = "time/train_cpu_seconds"


class TrainCPUClock(pl.Callback):
    """Log ``time/train_cpu_seconds`` with every validation: this process's CPU time (user + system) since
    the fit started, without the time spent validating.

    Algorithms differ in what a step costs (Flow-GRPO-Fast trains one or two denoising steps, DiffusionNFT
    samples without a behavior log-prob), so comparing them at an equal number of steps is not comparing
    them at equal cost; ``python -m unirl_pl ablate`` adds this clock to every fit and plots held-out scores
    against it. The gates, the optimizer and checkpoint writing count as training; the sanity check and every
    validation do not. CPU time rather than wall time: runs sharing a machine (``ablate --jobs``) do not slow
    each other's clocks. The count is saved in checkpoints, so a resumed run goes on from where it stopped.
    Not in the recipes by default, so a run's ``metrics.csv`` stays free of timing values that differ
    between repeats.
    """

    def __init__(self) -> None:
        self.spent = 0.0  # CPU seconds of training before the current fit segment (restored on resume)
        self._start: float | None = None  # process CPU time when this fit segment started
        self._validating = 0.0  # CPU seconds of validation in this segment
        self._val_start: float | None = None

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start, self._validating = time.process_time(), 0.0

    def train_cpu_seconds(self, now: float | None = None) -> float:
        """Training CPU seconds up to ``now`` (``time.process_time()``), the validation running at ``now`` excluded."""
        now = time.process_time() if now is None else now
        if self._start is None:
            return self.spent
        running = now - self._val_start if self._val_start is not None else 0.0
        return self.spent + (now - self._start) - self._validating - running

    def on_validation_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._val_start = time.process_time()

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        now = time.process_time()
        if not trainer.sanity_checking and trainer.state.fn == "fit":
            pl_module.log(METRIC, self.train_cpu_seconds(now))
        if self._val_start is not None:
            self._validating += now - self._val_start
        self._val_start = None

    def state_dict(self) -> dict[str, Any]:
        return {"spent": self.train_cpu_seconds()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.spent = float(state_dict["spent"])
