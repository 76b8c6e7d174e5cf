"""Images reach every logger that shows them; the run summary needs no CSVLogger; the reward curve is drawn right.

Fast: fake trainers (``SimpleNamespace``) and ``MagicMock(spec=...)`` loggers, so neither tensorboard,
wandb nor mlflow has to be installed (``isinstance`` holds for a spec'd mock).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest.mock import MagicMock

import numpy as np
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger, MLFlowLogger, TensorBoardLogger, WandbLogger
from PIL import Image, ImageDraw

from unirl_pl.callbacks import InterleaveParityCheck, LogProbIdentityCheck, RunSummary, ValidationImages
from unirl_pl.callbacks.parity import ParityReport
from unirl_pl.callbacks.summary import log_gate_metrics, reward_curve
from unirl_pl.callbacks.writer import log_image

BLUE, ORANGE = (31, 119, 180), (255, 127, 14)  # the curve's running-mean and validation colours


def _mlflow() -> MagicMock:
    logger = MagicMock(spec=MLFlowLogger)
    logger.run_id = "run-1"
    return logger


# ---------------------------------------------------------------- log_image: one image, every logger
def test_log_image_reaches_tensorboard_wandb_and_mlflow_and_skips_csv():
    tb, wandb, mlflow, csv = (
        MagicMock(spec=TensorBoardLogger),
        MagicMock(spec=WandbLogger),
        _mlflow(),
        MagicMock(spec=CSVLogger),
    )
    image = Image.new("RGBA", (4, 3), (10, 20, 30, 255))  # RGBA: every logger must get RGB
    log_image(SimpleNamespace(loggers=[csv, tb, wandb, mlflow]), "val/images", image, 7)

    tb.experiment.add_image.assert_called_once()
    (tag, pixels, step), kwargs = tb.experiment.add_image.call_args
    assert (tag, step, kwargs) == ("val/images", 7, {"dataformats": "HWC"})
    assert pixels.shape == (3, 4, 3) and pixels.dtype == np.uint8 and (pixels == (10, 20, 30)).all()

    wandb.log_image.assert_called_once()
    kwargs = wandb.log_image.call_args.kwargs
    assert (kwargs["key"], kwargs["step"], len(kwargs["images"])) == ("val/images", 7, 1)
    assert kwargs["images"][0].mode == "RGB" and kwargs["images"][0].tobytes() == image.convert("RGB").tobytes()

    mlflow.experiment.log_image.assert_called_once()
    (run_id, sent), kwargs = mlflow.experiment.log_image.call_args
    assert run_id == "run-1" and sent.mode == "RGB" and sent.size == (4, 3)
    assert kwargs == {"artifact_file": "val/images_step7.png"}
    assert csv.method_calls == [], "a CSVLogger cannot show an image: it is left alone"


def test_mlflow_images_of_different_steps_do_not_overwrite_each_other():
    mlflow = _mlflow()
    trainer = SimpleNamespace(loggers=[mlflow])
    for step in (10, 20):
        log_image(trainer, "reward_curve", Image.new("RGB", (2, 2)), step)
    names = [c.kwargs["artifact_file"] for c in mlflow.experiment.log_image.call_args_list]
    assert names == ["reward_curve_step10.png", "reward_curve_step20.png"]


def test_validation_grid_goes_to_the_image_loggers(tmp_path):
    wandb = MagicMock(spec=WandbLogger)
    trainer = SimpleNamespace(sanity_checking=False, state=SimpleNamespace(fn="fit"), global_step=4, loggers=[wandb])
    trainer.log_dir, trainer.default_root_dir = str(tmp_path), str(tmp_path)
    writer = ValidationImages(tile=16)
    writer.setup(trainer, None, "fit")
    outputs = {"prompts": ["a", "b"], "refined": ["a!", "b!"], "images": torch.rand(2, 3, 8, 8), "rewards": [0.1, 0.2]}
    writer.on_validation_batch_end(trainer, None, outputs, None, 0)
    assert writer.written == [tmp_path / "images" / "val_step4.png"]
    kwargs = wandb.log_image.call_args.kwargs
    assert (kwargs["key"], kwargs["step"]) == ("val/images", 4)
    assert kwargs["images"][0].tobytes() == Image.open(writer.written[0]).convert("RGB").tobytes()


# ---------------------------------------------------------------- RunSummary under any logger
def _fit_trainer(tmp_path: Path, loggers: list[Any]) -> SimpleNamespace:
    """What RunSummary reads of a trainer during fit (no progress bar, no checkpoints)."""
    trainer = SimpleNamespace(
        loggers=loggers,
        callbacks=[],
        callback_metrics={},
        global_step=0,
        is_global_zero=True,
        sanity_checking=False,
        state=SimpleNamespace(fn="fit"),
        progress_bar_callback=None,
        checkpoint_callbacks=[],
        log_dir=str(tmp_path),
        default_root_dir=str(tmp_path),
    )
    return trainer


def _rows(summary: RunSummary) -> dict[str, str]:
    what, value = (list(column.cells) for column in summary.table.columns)
    return dict(zip(what, value, strict=True))


def _run_with_gates(tmp_path: Path, loggers: list[Any]) -> tuple[RunSummary, SimpleNamespace]:
    """Three rewarded steps and gate reports through the real gates, as a fit would run them."""
    summary = RunSummary(window=2)
    trainer = _fit_trainer(tmp_path, loggers)
    trainer.callbacks = [summary]
    summary.setup(trainer, None, "fit")
    summary.on_fit_start(trainer, None)

    parity = InterleaveParityCheck()
    parity.check = lambda pl_module, step=0, source=None: ParityReport(diffs={"llm": 3e-6, "transformer": 1e-7})
    parity.on_fit_start(trainer, None)  # before on_train_start, like Lightning's order

    c2 = LogProbIdentityCheck()
    c2.enforce = lambda *args: None
    summary.on_train_start(trainer, None)
    for step, (reward, diff) in enumerate([(0.1, 2e-6), (0.2, 5e-6), (0.6, 1e-6)]):
        trainer.global_step = step
        c2.measure = lambda *args, diff=diff: {"llm": ({"max_abs_diff": diff, "mean_abs_diff": 1.0}, (0, 0))}
        c2.on_policy_logprobs(trainer, None, None, {})
        trainer.global_step = step + 1
        trainer.callback_metrics = {"reward/mean": torch.tensor(reward)}
        summary.on_train_batch_end(trainer, None)
    summary.on_train_end(trainer, None)
    summary.on_fit_end(trainer, None)
    return summary, trainer


@pytest.mark.parametrize("logger", ["none", "wandb", "tensorboard"])
def test_summary_shows_the_worst_gate_values_without_a_csv_logger(tmp_path, logger, capsys):
    loggers = {"none": [], "wandb": [MagicMock(spec=WandbLogger)], "tensorboard": [MagicMock(spec=TensorBoardLogger)]}
    summary, _ = _run_with_gates(tmp_path, loggers[logger])
    rows = _rows(summary)
    assert rows["c2/llm_max_abs_diff"] == "5e-06 worst (step 1, 3 checks)"
    assert rows["parity/llm_max_abs_diff"] == "3e-06 worst (step 0, 1 check)"
    assert rows["parity/max_abs_diff"] == "3e-06 worst (step 0, 1 check)"
    assert "c2/llm_mean_abs_diff" not in rows, "only the max_abs_diff values are gate rows"
    assert rows["reward/mean"] == "0.150 (first 2 steps) -> 0.400 (last 2 steps)"
    assert not any("metrics" in what for what in rows), "no CSVLogger: no metrics.csv row, nothing missing"
    assert "5e-06 worst" in capsys.readouterr().out


def test_summary_keeps_the_metrics_csv_row_and_gates_still_reach_the_loggers(tmp_path):
    csv, wandb = CSVLogger(tmp_path / "csv"), MagicMock(spec=WandbLogger)
    summary, trainer = _run_with_gates(tmp_path, [csv, wandb])
    rows = _rows(summary)
    path = Path(csv.log_dir) / "metrics.csv"
    assert rows["metrics.csv"] == str(path) and path.is_file()
    assert rows["c2/llm_max_abs_diff"] == "5e-06 worst (step 1, 3 checks)"
    assert "parity/llm_max_abs_diff" in path.read_text().splitlines()[0], "the gates still log to metrics.csv"
    steps = [c.kwargs["step"] for c in wandb.log_metrics.call_args_list]
    assert steps == [0, 0, 1, 2], "parity once at fit start, C2 at each step"
    reward_curves = [c.kwargs for c in wandb.log_image.call_args_list if c.kwargs["key"] == "reward_curve"]
    assert [c["step"] for c in reward_curves] == [trainer.global_step], "the reward curve goes to W&B too"


def test_a_new_fit_forgets_the_last_fits_gate_values(tmp_path):
    summary = RunSummary()
    trainer = _fit_trainer(tmp_path, [])
    trainer.callbacks = [summary]
    summary.setup(trainer, None, "fit")
    log_gate_metrics(trainer, {"c2/llm_max_abs_diff": 1.0, "rollout_corr/llm_kl": 2.0}, 3)
    assert summary._gates == {"c2/llm_max_abs_diff": [(3, 1.0)]}
    summary.setup(trainer, None, "fit")
    assert summary._gates == {}


# ---------------------------------------------------------------- the reward curve
def _pixels(image: Image.Image, colour: tuple[int, int, int]) -> tuple[np.ndarray, np.ndarray]:
    """x and y of the pixels of ``colour`` below the legend (which sits in the top 20 rows)."""
    ys, xs = np.nonzero((np.asarray(image.convert("RGB")) == colour).all(axis=-1))
    keep = ys > 20
    return xs[keep], ys[keep]


def _ends(xs: np.ndarray, ys: np.ndarray) -> tuple[float, float]:
    """The mean y of the leftmost and of the rightmost column."""
    return float(ys[xs == xs.min()].mean()), float(ys[xs == xs.max()].mean())


def test_a_rising_reward_ends_higher_on_the_image_than_it_starts():
    rising = [(s, 0.1 * s) for s in range(10)]
    xs, ys = _pixels(reward_curve(rising, []), BLUE)
    first, last = _ends(xs, ys)
    assert last < first - 100, "image y grows downwards: a rising reward ends near the top"
    assert xs.max() - xs.min() > 0.75 * 640, "the steps span the plot's width"
    first, last = _ends(*_pixels(reward_curve([(s, -v) for s, v in rising], []), BLUE))
    assert last > first + 100, "and a falling one near the bottom"


def test_validation_is_drawn_in_its_own_colour_at_its_steps():
    train = [(s, 0.5) for s in range(10)]
    assert _pixels(reward_curve(train, []), ORANGE)[0].size == 0, "no validation, no orange in the plot"
    image = reward_curve(train, [(3, 0.2), (9, 0.9)])
    oxs, oys = _pixels(image, ORANGE)
    first, last = _ends(oxs, oys)
    assert last < first, "the higher validation reward is higher on the image"
    bxs, _ = _pixels(image, BLUE)
    at_step_3 = bxs.min() + 3 / 9 * (bxs.max() - bxs.min())
    assert abs(oxs.min() + 4 - at_step_3) <= 3, "the step-3 dot (radius 4) sits at step 3 of the training line"
    assert abs(oxs.max() - 4 - bxs.max()) <= 3, "the step-9 dot sits at the training line's last step"
    between = (at_step_3 + bxs.max()) / 2
    assert (abs(oxs - between) <= 1).any(), "an orange line joins the validation dots"


def test_curve_labels_its_axes(monkeypatch):
    texts: list[tuple[tuple[float, float], str]] = []
    draw_text = ImageDraw.ImageDraw.text

    def spy(self: ImageDraw.ImageDraw, xy: tuple[float, float], text: str, *args: Any, **kwargs: Any) -> None:
        texts.append((tuple(xy), text))
        draw_text(self, xy, text, *args, **kwargs)

    monkeypatch.setattr(ImageDraw.ImageDraw, "text", spy)
    image = reward_curve([(0, 0.0), (4, 0.5), (8, 1.0)], [(8, 0.75)])
    at = {text: xy for xy, text in texts}
    # Five value ticks over the rewards padded by 8% of their range (-0.08 .. 1.08), the largest on top.
    values = ["-0.080", "0.210", "0.500", "0.790", "1.080"]
    assert [at[v][1] for v in values] == sorted((at[v][1] for v in values), reverse=True), texts
    steps = ["0", "2", "4", "6", "8"]
    assert [at[s][0] for s in steps] == sorted(at[s][0] for s in steps), texts
    xs, _ = _pixels(image, BLUE)
    assert max(at[v][0] for v in values) < xs.min(), "value ticks left of the plot"
    assert min(at[s][1] for s in steps) > max(at[v][1] for v in values), "step ticks below it"
    assert at["step"][1] > at["0"][1], "the x axis is named under its ticks"
    assert any("reward/mean" in t for _, t in texts) and any("val/reward_mean" in t for _, t in texts), "legend"
