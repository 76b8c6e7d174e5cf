"""A progress display for RL runs: RL steps out of ``max_steps``, steps per second, time left, reward."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import RichProgressBar
from lightning.pytorch.callbacks.progress.rich_progress import (
    BatchesProcessedColumn,
    CustomBarColumn,
    RichProgressBarTheme,
)
from rich.progress import ProgressColumn, Task, TextColumn
from rich.text import Text

# Metric keys and the short names the display gives them.
DISPLAY_NAMES = {"reward/mean": "reward", "val/reward_mean": "val reward"}


def _clock(seconds: float | None) -> str:
    return "-:--:--" if seconds is None else str(timedelta(seconds=int(seconds)))


class _SpeedColumn(ProgressColumn):
    """``0.42 steps/s`` on the training bar, ``it/s`` on the others."""

    def __init__(self, bar: RLProgressBar, style: Any) -> None:
        self.bar, self.style = bar, style
        super().__init__()

    def render(self, task: Task) -> Text:
        unit = "steps/s" if task.id == self.bar.train_progress_bar_id else "it/s"
        speed = "-.--" if task.speed is None else f"{task.speed:.2f}"
        return Text(f"{speed} {unit}", style=self.style)


class _TimeColumn(ProgressColumn):
    """``0:01:05 • 0:02:10 left``: time elapsed in this run, and time left at the current speed."""

    max_refresh = 0.5

    def __init__(self, style: Any) -> None:
        self.style = style
        super().__init__()

    def render(self, task: Task) -> Text:
        elapsed = task.finished_time if task.finished else task.elapsed
        return Text(f"{_clock(elapsed)} • {_clock(task.time_remaining)} left", style=self.style)


class RLProgressBar(RichProgressBar):
    """``RichProgressBar`` that counts RL steps: ``step 12/40`` (the trainer's global step out of
    ``max_steps``, so a resumed run continues where it stopped), steps per second, time elapsed and
    left, and the progress-bar metrics under short names (``reward``, ``val reward``); no ``v_num``.

    When the output is not a terminal (a log file, CI), the live bar cannot redraw, so a plain line
    is printed instead at the first and last step and about every ``max_steps / lines`` steps.

    Args:
        refresh_rate: Redraws per second (0 disables the display).
        leave: Keep the finished bar on screen.
        lines: Plain lines per run when the output is not a terminal.
        theme: Styles (``lightning.pytorch.callbacks.progress.rich_progress.RichProgressBarTheme``).
        console_kwargs: Arguments of the ``rich.console.Console``.
    """

    def __init__(
        self,
        refresh_rate: int = 10,
        leave: bool = True,
        lines: int = 20,
        theme: RichProgressBarTheme = RichProgressBarTheme(),  # noqa: B008 (a dataclass, never mutated)
        console_kwargs: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(refresh_rate=refresh_rate, leave=leave, theme=theme, console_kwargs=console_kwargs)
        if lines < 1:
            raise ValueError(f"lines must be >= 1, got {lines}")
        self.lines = lines
        self.printed: list[str] = []

    # ------------------------------------------------------------------ what is counted
    @property
    def total_train_batches(self) -> int | float:
        """RL steps of the whole run (``max_steps``) when it is set, else Lightning's batches per epoch."""
        max_steps = self.trainer.max_steps
        return max_steps if max_steps is not None and max_steps > 0 else super().total_train_batches

    def _get_train_description(self, current_epoch: int) -> str:
        return f"{'step':{len(self.validation_description)}}"

    def configure_columns(self, trainer: pl.Trainer) -> list:
        return [
            TextColumn("[progress.description]{task.description}"),
            CustomBarColumn(
                complete_style=self.theme.progress_bar,
                finished_style=self.theme.progress_bar_finished,
                pulse_style=self.theme.progress_bar_pulse,
            ),
            BatchesProcessedColumn(style=self.theme.batch_progress),
            _SpeedColumn(self, style=self.theme.processing_speed),
            _TimeColumn(style=self.theme.time),
        ]

    def get_metrics(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        items = super().get_metrics(trainer, pl_module)
        items.pop("v_num", None)
        return {DISPLAY_NAMES.get(k, k): v for k, v in items.items()}

    # ------------------------------------------------------------------ hooks
    def _init_progress(self, trainer: pl.Trainer) -> None:
        super()._init_progress(trainer)
        if self.progress is not None:
            # Speed over the last two minutes: validations and slow steps average in, one step does not swing it.
            self.progress.speed_estimate_period = 120.0
            if self._console is not None and not self._console.is_terminal:
                self.progress.live.transient = True  # plain lines instead; no final frame in a log file

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking:  # a partial check before training: not a validation reward to show
            self.reset_dataloader_idx_tracker()
            return
        super().on_validation_end(trainer, pl_module)

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_epoch_start(trainer, pl_module)
        # Start at the global step (not 0 after a resume); rich's speed ignores this first jump.
        self._update(self.train_progress_bar_id, trainer.global_step)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.is_disabled:
            return
        if self.train_progress_bar_id is None:  # a mid-epoch restart skips on_train_epoch_start
            self._initialize_train_progress_bar_id()
        self._update(self.train_progress_bar_id, trainer.global_step)
        self._update_metrics(trainer, pl_module)
        self.refresh()
        self._print_line(trainer, pl_module)

    # ------------------------------------------------------------------ plain lines
    def status_line(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> str:
        """``step 12/40 | 0.42 steps/s | 0:01:05 left | reward 0.612 | val reward 0.700``."""
        total = self.total_train_batches
        parts = [f"step {trainer.global_step}/{total if total != float('inf') else '--'}"]
        if self.progress is not None and self.train_progress_bar_id is not None:
            task = self.train_progress_bar
            parts.append(("-.--" if task.speed is None else f"{task.speed:.2f}") + " steps/s")
            parts.append(f"{_clock(task.time_remaining)} left")
        for name, value in self.get_metrics(trainer, pl_module).items():
            parts.append(
                f"{name} {value:{self.theme.metrics_format}}" if isinstance(value, float) else f"{name} {value}"
            )
        return " | ".join(parts)

    def _print_line(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._console is None or self._console.is_terminal or not trainer.is_global_zero:
            return
        total = self.total_train_batches
        every = max(1, int(total) // self.lines) if total != float("inf") else 10
        step = trainer.global_step
        if step == 1 or step % every == 0 or step == total or not self.printed:
            line = self.status_line(trainer, pl_module)
            self.printed.append(line)
            self._console.print(line, highlight=False, soft_wrap=True)
