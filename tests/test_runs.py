"""Each run keeps to its own folder; ``--ckpt_path last`` resumes the newest; the summary shows before -> after."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from PIL import Image

from tests.helpers import TINY, read_metrics
from unirl_pl.callbacks import RunCheckpoint, RunSummary
from unirl_pl.callbacks.run_checkpoint import newest_last_checkpoints
from unirl_pl.callbacks.summary import checkpoint_rows, reward_curve, validation_text
from unirl_pl.cli import main

FAST = (
    "--model.rollout.num_steps=4",
    "--model.generator_algorithm.init_args.sde_window=[0,2]",
    "--trainer.enable_model_summary=false",
)


def _touch(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"")
    return path


# ---------------------------------------------------------------- which run `last` means
def test_newest_last_checkpoint_is_the_highest_version_that_has_one(tmp_path):
    _touch(tmp_path / "version_2" / "checkpoints" / "last.ckpt")
    want = _touch(tmp_path / "version_10" / "checkpoints" / "last.ckpt")  # 10 > 2: numbers, not text
    also = _touch(tmp_path / "version_10" / "checkpoints" / "last-v1.ckpt")
    _touch(tmp_path / "version_10" / "checkpoints" / "epoch=0-step=10.ckpt")
    _touch(tmp_path / "version_11" / "checkpoints" / "epoch=0-step=10.ckpt")  # a run with no last.ckpt
    (tmp_path / "version_12").mkdir()  # the run being started
    _touch(tmp_path / "other" / "checkpoints" / "last.ckpt")
    assert newest_last_checkpoints(tmp_path) == {str(want), str(also)}
    assert newest_last_checkpoints(tmp_path / "missing") == set()


def test_validate_last_without_a_logger_is_refused():
    trainer = SimpleNamespace(loggers=[], state=SimpleNamespace(fn="validate"))
    with pytest.raises(ValueError, match="no logger: give the file"):
        RunCheckpoint()._find_last_checkpoints(trainer)


@pytest.mark.slow
def test_two_runs_keep_their_checkpoints_and_last_resumes_the_second(tmp_path):
    """Two runs of the shipped tiny recipe: two version folders with their own checkpoints; then
    ``--ckpt_path last`` resumes the second (step 2, not the first's step 1) into a third folder."""
    base = ["fit", "--config", TINY, f"--trainer.logger.init_args.save_dir={tmp_path}", *FAST]
    base += ["--trainer.limit_val_batches=0"]
    first = main([*base, "--trainer.max_steps=1"])
    second = main([*base, "--trainer.max_steps=2"])
    root = tmp_path / "tiny"
    assert [Path(c.trainer.log_dir) for c in (first, second)] == [root / "version_0", root / "version_1"]
    for version, step in ((0, 1), (1, 2)):
        files = sorted(p.name for p in (root / f"version_{version}" / "checkpoints").iterdir())
        assert files == ["last.ckpt"], files
        saved = torch.load(root / f"version_{version}" / "checkpoints" / "last.ckpt", weights_only=True)
        assert saved["global_step"] == step
    rows = _summary_rows(second)
    assert rows["checkpoint (last)"] == str(root / "version_1" / "checkpoints" / "last.ckpt")
    assert not any("best" in what for what in rows), "nothing is monitored: no checkpoint is a best"

    resumed = main([*base, "--trainer.max_steps=3", "--ckpt_path=last"])
    assert resumed.trainer.ckpt_path == str(root / "version_1" / "checkpoints" / "last.ckpt")
    assert Path(resumed.trainer.log_dir) == root / "version_2"
    steps = [int(r["step"]) for r in read_metrics(resumed) if "reward/mean" in r]
    assert steps == [2], "one step, after the second run's two (the first made one)"
    assert (root / "version_2" / "checkpoints" / "last.ckpt").is_file()


def _summary_rows(cli) -> dict[str, str]:
    table = next(c for c in cli.trainer.callbacks if isinstance(c, RunSummary)).table
    what, value = (list(column.cells) for column in table.columns)
    return dict(zip(what, value, strict=True))


# ---------------------------------------------------------------- before RL -> after
@pytest.mark.slow
def test_summary_and_curve_show_validation_before_rl(tmp_path):
    cli = main(
        [
            "fit",
            "--config",
            TINY,
            f"--trainer.logger.init_args.save_dir={tmp_path}",
            "--trainer.max_steps=2",
            "--trainer.val_check_interval=2",
            "--trainer.enable_checkpointing=false",
            "--trainer.callbacks=[unirl_pl.callbacks.RunSummary]",
            *FAST,
        ]
    )
    summary = next(c for c in cli.trainer.callbacks if isinstance(c, RunSummary))
    step, before, scored, full = summary._before
    assert (step, scored, full) == (0, 1, 1)
    after = summary._seen["val/reward_mean"]
    assert [s for s, _ in after] == [2]
    assert _summary_rows(cli)["val/reward_mean"] == f"{before:.3f} (before RL) -> {after[0][1]:.3f} (after step 2)"
    curve = Image.open(summary.curve_path).convert("RGB").tobytes()
    assert curve == reward_curve(_train(cli), after, before=(0, before)).tobytes(), "the curve starts before RL"
    assert curve != reward_curve(_train(cli), after).tobytes()


def _train(cli) -> list[tuple[int, float]]:
    return [(int(r["step"]), r["reward/mean"]) for r in read_metrics(cli) if "reward/mean" in r]


def test_curve_draws_the_before_point():
    train, val = [(0, 0.2), (1, 0.3), (2, 0.4)], [(2, 0.5)]
    without, with_before = reward_curve(train, val), reward_curve(train, val, before=(0, 0.1))
    assert without.tobytes() != with_before.tobytes()
    assert reward_curve([], [], before=(0, 0.1)).getbbox() is not None


@pytest.mark.parametrize(
    "before, val, want",
    [
        ((0, 0.3, 1, 1), [(20, 0.5), (40, 0.6)], "0.300 (before RL) -> 0.500 (after step 20) -> 0.600 (after step 40)"),
        ((0, 0.3, 1, 15), [(20, 0.5)], "0.300 (before RL, sanity check of 1 of 15 batches) -> 0.500 (after step 20)"),
        ((20, 0.5, 2, 2), [(40, 0.6)], "0.500 (at step 20, before this run's updates) -> 0.600 (after step 40)"),
        (None, [(10, 0.1), (20, 0.2), (30, 0.3)], "0.100 (after step 10) -> 0.300 (after step 30)"),
        (None, [], None),
    ],
)
def test_validation_text(before, val, want):
    assert validation_text(before, val) == want


def _checkpoint(**kw):
    fields = {"last_model_path": "", "best_model_path": "", "monitor": None, "best_model_score": None, "dirpath": "d"}
    return SimpleNamespace(**{**fields, **kw})


@pytest.mark.parametrize(
    "kw, want",
    [
        ({}, [("checkpoints", "none saved (folder d)")]),
        (
            {"last_model_path": "d/last.ckpt", "best_model_path": "d/step=10.ckpt"},
            [("checkpoints", "d"), ("checkpoint (newest)", "d/step=10.ckpt"), ("checkpoint (last)", "d/last.ckpt")],
        ),
        (
            {"best_model_path": "d/last.ckpt", "last_model_path": "d/last.ckpt"},
            [("checkpoints", "d"), ("checkpoint (last)", "d/last.ckpt")],
        ),
        (
            {"best_model_path": "d/b.ckpt", "monitor": "val/reward_mean", "best_model_score": torch.tensor(0.5)},
            [("checkpoints", "d"), ("checkpoint (best val/reward_mean = 0.5)", "d/b.ckpt")],
        ),
    ],
    ids=["none", "unmonitored", "only-last", "monitored"],
)
def test_checkpoint_rows_name_files_for_what_they_are(kw, want):
    assert checkpoint_rows(_checkpoint(**kw)) == want


def test_recipe_run_root_is_the_first_loggers_folder():
    from unirl_pl.cli import recipe_run_root

    csv = {"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": "runs", "name": "joint"}}
    assert recipe_run_root(csv) == Path("runs") / "joint"
    tb = {"class_path": "TensorBoardLogger", "init_args": {"save_dir": "tb", "name": "x"}}
    assert recipe_run_root([csv, tb]) == Path("runs") / "joint", "the first logger's, as fit writes its checkpoints"
    assert recipe_run_root({"class_path": "CSVLogger", "init_args": {"save_dir": "runs"}}) is None
    assert recipe_run_root(False) is None and recipe_run_root([]) is None and recipe_run_root(None) is None
