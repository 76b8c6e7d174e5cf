"""What a run did, at its end: a table of rewards, gate worsts, speed and output paths, and a reward curve."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import RichProgressBar
from lightning.pytorch.loggers import CSVLogger
from PIL import Image, ImageDraw, ImageFont

from unirl_pl.callbacks.hacking import RewardHackingMonitor
from unirl_pl.callbacks.writer import LINE_H, ValidationImages, log_image

TRAIN_KEY, VAL_KEY = "reward/mean", "val/reward_mean"
GATE_PREFIXES = ("c2/", "parity/")
Series = dict[str, list[tuple[int, float]]]


def metrics_csv(trainer: pl.Trainer) -> Path | None:
    """The ``metrics.csv`` of the trainer's ``CSVLogger`` (None without one)."""
    for logger in trainer.loggers:
        if isinstance(logger, CSVLogger):
            return Path(logger.log_dir) / "metrics.csv"
    return None


def is_gate_key(key: str) -> bool:
    """Whether the summary shows ``key``'s worst value: a gate's ``c2/*max_abs_diff`` or ``parity/*max_abs_diff``."""
    return key.startswith(GATE_PREFIXES) and key.endswith("max_abs_diff")


def log_gate_metrics(trainer: pl.Trainer, metrics: dict[str, float], step: int) -> None:
    """A gate's metrics straight to every logger, and its ``*max_abs_diff`` values to the ``RunSummary``.

    Straight, not ``self.log``: ``self.log`` is refused in ``on_fit_start`` (where the parity gate first
    runs), and within an epoch Lightning re-emits a step metric on every later step, which would show
    checks that never ran. So the values never reach ``trainer.callback_metrics``, and the summary, which
    must not depend on which logger is attached, is handed them here.
    """
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=step)
    for callback in trainer.callbacks:
        if isinstance(callback, RunSummary):
            callback.record_gates(metrics, step)


def reward_curve(
    train: list[tuple[int, float]],
    val: list[tuple[int, float]],
    size: tuple[int, int] = (640, 400),
    before: tuple[int, float] | None = None,
) -> Image.Image:
    """A line chart against the step: the training reward (light blue, its running mean dark blue) and the
    validation reward (orange dots), starting from the validation before RL (``before``, an orange ring)."""
    width, height = size
    left, right, top, bottom = 56, 16, 28, 40
    img = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(img)
    font = ImageFont.load_default()
    points = train + val + ([before] if before is not None else [])
    if not points:
        draw.text((left, height // 2), "no reward logged", fill="black", font=font)
        return img
    x0, x1 = min(s for s, _ in points), max(s for s, _ in points)
    y0, y1 = min(v for _, v in points), max(v for _, v in points)
    if x1 == x0:
        x0, x1 = x0 - 1, x1 + 1
    pad = (y1 - y0) * 0.08 or 0.05
    y0, y1 = y0 - pad, y1 + pad

    def xy(step: float, value: float) -> tuple[float, float]:
        x = left + (step - x0) / (x1 - x0) * (width - left - right)
        y = top + (y1 - value) / (y1 - y0) * (height - top - bottom)
        return x, y

    # Grid, tick labels (5 ticks each way), then the frame over the grid.
    for i in range(5):
        value = y0 + (y1 - y0) * i / 4
        _, y = xy(x0, value)
        draw.line([left, y, width - right, y], fill=(225, 225, 225))
        draw.text((4, y - LINE_H // 2), f"{value:.3f}", fill="black", font=font)
        step = x0 + (x1 - x0) * i / 4
        x, _ = xy(step, y0)
        draw.text((x - 8, height - bottom + 4), f"{step:.0f}", fill="black", font=font)
    draw.text(((width - right + left) // 2 - 12, height - LINE_H - 4), "step", fill="black", font=font)
    draw.rectangle([left, top, width - right, height - bottom], outline="black")

    blue, light, orange = (31, 119, 180), (174, 199, 232), (255, 127, 14)
    if len(train) > 1:
        # The raw per-step reward (light) and its running mean over `smooth` steps (dark).
        draw.line([xy(s, v) for s, v in train], fill=light, width=1)
        smooth = max(1, min(5, len(train) // 4))
        values = [v for _, v in train]
        means = [_mean(values[max(0, i - smooth + 1) : i + 1]) for i in range(len(values))]
        draw.line([xy(s, m) for (s, _), m in zip(train, means, strict=True)], fill=blue, width=2)
    for s, v in train if len(train) == 1 else []:
        x, y = xy(s, v)
        draw.ellipse([x - 3, y - 3, x + 3, y + 3], fill=blue)
    line = ([before] if before is not None else []) + val
    if len(line) > 1:
        draw.line([xy(s, v) for s, v in line], fill=orange, width=2)
    for s, v in val:
        x, y = xy(s, v)
        draw.ellipse([x - 4, y - 4, x + 4, y + 4], fill=orange)
    if before is not None:
        x, y = xy(*before)
        draw.ellipse([x - 5, y - 5, x + 5, y + 5], fill="white", outline=orange, width=2)
    # Legend.
    draw.line([left + 8, 12, left + 28, 12], fill=blue, width=2)
    draw.text((left + 32, 6), f"train {TRAIN_KEY}", fill="black", font=font)
    draw.ellipse([left + 180, 8, left + 188, 16], fill=orange)
    label = f"validation {VAL_KEY}" + (" (ring: before RL)" if before is not None else "")
    draw.text((left + 194, 6), label, fill="black", font=font)
    return img


def validation_text(before: tuple[int, float, int, int] | None, val: list[tuple[int, float]]) -> str | None:
    """The summary's validation reward: before RL (the sanity check), then after the first and last validation.

    ``before`` is (step, value, batches scored, batches of a full validation); a sanity check that scored
    fewer batches than a full validation says so, since its number is then not on the same prompts. A
    resumed run's sanity check scores the resumed weights, so it says the step instead of "before RL".
    """
    parts = []
    if before is not None:
        step, value, scored, full = before
        when = "before RL" if step == 0 else f"at step {step}, before this run's updates"
        partial = f", sanity check of {scored} of {full} batches" if scored < full else ""
        parts.append(f"{value:.3f} ({when}{partial})")
    shown = val[:1] + val[-1:] if len(val) > 1 else val
    parts += [f"{value:.3f} (after step {step})" for step, value in shown]
    return " -> ".join(parts) or None


def checkpoint_rows(callback: Any) -> list[tuple[str, str]]:
    """The summary's rows for one ``ModelCheckpoint``: each file named for what it is.

    ``last`` is ``last.ckpt``; without a monitored metric Lightning still fills ``best_model_path``
    with the newest periodic file, which is the "newest", not a best; ``best`` only when ``monitor`` is set.
    """
    last, kept = callback.last_model_path, callback.best_model_path
    if not (last or kept):
        return [("checkpoints", f"none saved (folder {callback.dirpath})")]
    rows = [("checkpoints", f"{callback.dirpath}")]
    if callback.monitor and kept:
        score = callback.best_model_score
        value = f" = {float(score):.4g}" if score is not None else ""
        rows.append((f"checkpoint (best {callback.monitor}{value})", kept))
    elif kept and kept != last:
        rows.append(("checkpoint (newest)", kept))
    if last:
        rows.append(("checkpoint (last)", last))
    return rows


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan


class RunSummary(pl.Callback):
    """At the end of ``fit`` (rank 0): print a table of what the run did and write ``reward_curve.png``.

    The table: steps and time per step; ``reward/mean`` over the first and last ``window`` steps; the
    validation reward before RL (the sanity check's, when it ran; it says how many batches it scored
    when that is fewer than a full validation) and after the first and last validations; the worst
    (largest) ``c2/*_max_abs_diff`` and ``parity/*_max_abs_diff`` the gates logged; with a
    :class:`~unirl_pl.callbacks.RewardHackingMonitor`, its alarm count and every alarm with its step; the paths of
    ``metrics.csv`` (with a ``CSVLogger``), the checkpoints (named for what they are: ``last``, ``newest``,
    and ``best`` only when a metric is monitored), the validation image grids and the reward curve. The
    values are collected during the run (the rewards from ``trainer.callback_metrics``, the gates' from
    :func:`log_gate_metrics`), so the table is the same under any logger or none. ``reward_curve.png``
    (training and validation reward against the step, from the validation before RL) goes into the
    logger's version folder, and to TensorBoard, W&B or MLflow when such a logger is attached.

    Args:
        window: Steps averaged at the start and at the end of the run.
        curve: Write ``reward_curve.png``.
    """

    def __init__(self, window: int = 10, curve: bool = True) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.window, self.curve = window, curve
        self.table: Any = None
        self.curve_path: Path | None = None
        self.log_dir = Path(".")  # the logger's version folder, set in setup()
        self._seen: Series = {}
        self._gates: Series = {}  # the gates' *max_abs_diff values by key, as log_gate_metrics hands them over
        # The sanity check's validation reward: (step, value, batches scored, batches of a full validation).
        self._before: tuple[int, float, int, int] | None = None
        self._start: tuple[float, int] | None = None
        self._end: tuple[float, int] | None = None

    # ------------------------------------------------------------------ collecting
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # Here, on every rank: trainer.log_dir is a collective (a broadcast), never to be read on rank 0 alone.
        self.log_dir = Path(trainer.log_dir or trainer.default_root_dir)
        if stage == "fit":
            # Here, not in on_fit_start: a gate may report in its own on_fit_start, which can run before ours.
            self._gates = {}

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._before = None  # the sanity check runs after this hook and before on_train_start

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start, self._seen = (time.perf_counter(), trainer.global_step), {}

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._end = (time.perf_counter(), trainer.global_step)

    def _remember(self, trainer: pl.Trainer, key: str, step: int) -> None:
        value = trainer.callback_metrics.get(key)
        if value is not None:
            self._seen.setdefault(key, []).append((step, float(value)))

    def record_gates(self, metrics: dict[str, float], step: int) -> None:
        """Keep the gate values among ``metrics`` (logged at ``step``) for the table."""
        for key, value in metrics.items():
            if is_gate_key(key):
                self._gates.setdefault(key, []).append((step, float(value)))

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        # As metrics.csv steps it: the reward of the rollout made after `step` updates.
        self._remember(trainer, TRAIN_KEY, trainer.global_step - 1)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.state.fn != "fit":
            return
        if trainer.sanity_checking:
            # The weights before this run's first update: the "before RL" of the validation reward.
            value = trainer.callback_metrics.get(VAL_KEY)
            if value is not None:
                scored, full = sum(trainer.num_sanity_val_batches), sum(trainer.num_val_batches)
                self._before = (trainer.global_step, float(value), int(scored), int(full))
            return
        # The weights after `global_step` updates (metrics.csv files it one step earlier).
        self._remember(trainer, VAL_KEY, trainer.global_step)

    # ------------------------------------------------------------------ reporting
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        for logger in trainer.loggers:
            logger.save()  # the CSV logger buffers rows: the metrics.csv the table names is complete from here
        path = metrics_csv(trainer)
        # Validation by the step whose weights it scored (the x of images/val_step<N>.png).
        series = {**self._seen, **self._gates, VAL_KEY: self._seen.get(VAL_KEY, [])}
        train, val = series.get(TRAIN_KEY, []), series[VAL_KEY]
        log_dir = self.log_dir
        before = self._before[:2] if self._before is not None else None
        if self.curve and (train or val or before):
            image = reward_curve(train, val, before=before)
            log_dir.mkdir(parents=True, exist_ok=True)
            self.curve_path = log_dir / "reward_curve.png"
            image.save(self.curve_path)
            log_image(trainer, "reward_curve", image, trainer.global_step)
        self.table = self._table(trainer, series, path)
        bar = trainer.progress_bar_callback
        if isinstance(bar, RichProgressBar):
            bar.teardown(trainer, pl_module, "fit")  # stop the live bar first: the table goes below it
        from rich import get_console
        from rich.console import Console

        console = get_console()
        if not console.is_terminal:  # a log file is 80 columns to rich; paths read better unbroken there
            console = Console(file=console.file, width=max(console.width, 132), no_color=True)
        console.print(self.table)

    def _table(self, trainer: pl.Trainer, series: Series, path: Path | None) -> Any:
        from rich.table import Table

        table = Table(title="Run summary", show_header=False, title_justify="left")
        table.add_column("what", style="bold")
        table.add_column("value", overflow="fold")
        if self._start is not None and self._end is not None:
            seconds, steps = self._end[0] - self._start[0], self._end[1] - self._start[1]
            per_step = f", {seconds / steps:.2f} s per step (validation included)" if steps else ""
            table.add_row("steps", f"{self._start[1]} -> {self._end[1]} in {seconds:.0f} s{per_step}")
        train = [v for _, v in series.get(TRAIN_KEY, [])]
        if train:
            n = min(self.window, len(train))
            table.add_row(
                TRAIN_KEY, f"{_mean(train[:n]):.3f} (first {n} steps) -> {_mean(train[-n:]):.3f} (last {n} steps)"
            )
        val_text = validation_text(self._before, series.get(VAL_KEY, []))
        if val_text:
            table.add_row(VAL_KEY, val_text)
        gates = sorted(k for k in series if is_gate_key(k))
        for key in gates:
            worst = max(series[key], key=lambda sv: sv[1])
            checks = len(series[key])
            table.add_row(key, f"{worst[1]:.3g} worst (step {worst[0]}, {checks} check{'s' * (checks != 1)})")
        for monitor in (cb for cb in trainer.callbacks if isinstance(cb, RewardHackingMonitor)):
            table.add_row("hack/alarms", str(len(monitor.alarms)) if monitor.alarms else "0 (no alarm)")
            for alarm in monitor.alarms:
                table.add_row("hack alarm", alarm.describe())
        if path is not None:
            table.add_row("metrics.csv", str(path))
        for cb in trainer.checkpoint_callbacks:
            for what, value in checkpoint_rows(cb):
                table.add_row(what, value)
        images = [cb for cb in trainer.callbacks if isinstance(cb, ValidationImages) and cb.written]
        if images:
            table.add_row("validation images", str(images[0].written[-1].parent))
        if self.curve_path is not None:
            table.add_row("reward curve", str(self.curve_path))
        return table
