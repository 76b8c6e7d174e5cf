"""What a user sees: progress, the end-of-run summary, output folders, paths, errors and help."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from PIL import Image

from tests.helpers import JOINT, ROOT, TINY, read_metrics, run_cli, series, subprocess_env
from unirl_pl.callbacks import RLProgressBar, RunSummary, ValidationImages
from unirl_pl.cli import config_error_message, main
from unirl_pl.module import UniRLModule
from unirl_pl.paths import resolve, search_roots
from unirl_pl.threads import set_threads

FAST = ("--model.rollout.num_steps=4", "--model.generator_algorithm.init_args.sde_window=[0,2]")


def _env() -> dict[str, str]:
    return subprocess_env()


def _own_lines(text: str) -> list[str]:
    """Stderr lines without the libraries' import-time notices."""
    notices = ("[transformers]", "Seed set to")
    return [line for line in text.splitlines() if line.strip() and not line.startswith(notices)]


# ---------------------------------------------------------------- progress
@pytest.mark.slow
def test_progress_counts_global_steps_after_resume(tmp_path, capsys):
    ckpts = tmp_path / "ckpts"
    run_cli(
        tmp_path,
        "--trainer.max_steps=2",
        "--trainer.limit_val_batches=0",
        *FAST,
        "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
        f"--trainer.callbacks.dirpath={ckpts}",
        "--trainer.callbacks.every_n_train_steps=2",
        name="first",
    )
    capsys.readouterr()
    resumed = run_cli(
        tmp_path,
        "--trainer.max_steps=3",
        "--trainer.limit_val_batches=0",
        *FAST,
        f"--ckpt_path={ckpts / 'epoch=0-step=2.ckpt'}",
        "--trainer.enable_progress_bar=true",
        "--trainer.callbacks+=unirl_pl.callbacks.RLProgressBar",
        name="resumed",
    )
    bar = resumed.trainer.progress_bar_callback
    assert isinstance(bar, RLProgressBar)
    out = capsys.readouterr().out
    # Not a terminal under pytest: plain lines, the first one at the resumed run's first step.
    assert bar.printed and bar.printed[0].startswith("step 3/3 | "), bar.printed
    assert "reward " in bar.printed[0] and "v_num" not in out and "Epoch" not in out
    assert "step 3/3" in out
    task = bar.train_progress_bar
    assert (task.completed, task.total) == (3, 3)


# ---------------------------------------------------------------- summary and images
def _returns_first_batch(monkeypatch):
    """validation_step returns what ValidationImages reads (kept if the module already returns it)."""
    original = UniRLModule.validation_step

    def validation_step(self, batch, batch_idx):
        out = original(self, batch, batch_idx)
        if out is None and batch_idx == 0:
            refined, images, _ = self.serve(batch)
            total, _ = self.reward_fn(batch.prompts, refined, images)
            out = {"prompts": batch.prompts, "refined": refined, "images": images, "rewards": total.tolist()}
        return out

    monkeypatch.setattr(UniRLModule, "validation_step", validation_step)


@pytest.mark.slow
def test_run_summary_curve_and_validation_images(tmp_path, monkeypatch, capsys):
    _returns_first_batch(monkeypatch)
    cli = run_cli(
        tmp_path,
        "--trainer.max_steps=4",
        "--trainer.val_check_interval=2",
        *FAST,
        "--trainer.callbacks+=unirl_pl.callbacks.RunSummary",
        "--trainer.callbacks+=unirl_pl.callbacks.ValidationImages",
    )
    out = capsys.readouterr().out
    log_dir = Path(cli.trainer.log_dir)
    summary = next(c for c in cli.trainer.callbacks if isinstance(c, RunSummary))
    assert "Run summary" in out and "reward/mean" in out and "c2/llm_max_abs_diff" in out
    assert "metrics.csv" in out and "checkpoint" in out
    rows = read_metrics(cli)
    rewards = series(rows, "reward/mean")
    assert f"{sum(rewards) / len(rewards):.3f} (first 4 steps)" in out
    worst = max(series(rows, "c2/llm_max_abs_diff"))
    assert f"{worst:.3g} worst" in out
    assert summary.curve_path == log_dir / "reward_curve.png"
    assert Image.open(summary.curve_path).size == (640, 400)
    grids = sorted(p.name for p in (log_dir / "images").glob("*.png"))
    assert grids == ["val_step2.png", "val_step4.png"], grids
    assert Image.open(log_dir / "images" / "val_step4.png").size[1] == 128 + 48


def test_validation_images_tolerate_no_outputs(tmp_path):
    trainer = SimpleNamespace(sanity_checking=False, state=SimpleNamespace(fn="fit"), global_step=1, loggers=[])
    trainer.log_dir, trainer.default_root_dir = str(tmp_path), str(tmp_path)
    writer = ValidationImages()
    writer.setup(trainer, None, "fit")
    writer.on_validation_batch_end(trainer, None, None, None, 0)
    writer.on_validation_batch_end(trainer, None, {"loss": torch.zeros(())}, None, 0)
    assert writer.written == [] and not (tmp_path / "images").exists()


# ---------------------------------------------------------------- predict
def _predict(prompts: str, out: Path) -> None:
    main(
        [
            "predict",
            "--config",
            TINY,
            "--trainer.enable_progress_bar=false",
            f"--trainer.callbacks=[{{class_path: unirl_pl.callbacks.ImageWriter, init_args: {{output_dir: {out}}}}}]",
            f"--data.predict_prompts={prompts}",
        ]
    )


@pytest.mark.slow
def test_predict_twice_lists_exactly_its_files(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "pred"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    _predict("[a red circle, two blue squares, a green triangle]", out)
    _predict("[a red circle, two blue squares]", out)
    rows = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    images = sorted(p.name for p in out.glob("*.png") if not p.name.startswith("grid_"))
    assert sorted(r["file"] for r in rows) == images == ["0_0000_00.png", "0_0000_01.png"]
    assert [r["prompt"] for r in rows] == ["a red circle", "two blue squares"]
    assert sorted(p.name for p in out.glob("grid_*.png")) == ["grid_0_0000.png"]
    assert (out / "notes.txt").read_text() == "mine", "files the writer did not write are left alone"
    # Only fit makes a run: no logger version folder, no config.yaml in the current directory.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pred"]


# ---------------------------------------------------------------- paths
def test_relative_inputs_resolve_from_the_recipe_or_the_package(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    roots = search_roots([JOINT])
    assert roots[0] == ROOT / "recipes" and ROOT in roots
    asset = "unirl_pl/assets/shapes/prompts_train.jsonl"
    assert resolve(asset, roots) == str(ROOT / asset)
    assert resolve(asset, search_roots([])) == str(ROOT / asset), "the package's parent is always searched"
    (tmp_path / "unirl_pl").mkdir()
    (tmp_path / asset).parent.mkdir(parents=True)
    (tmp_path / asset).write_text("")
    assert resolve(asset, roots) == asset, "a path that exists from the current directory wins"
    assert resolve("Qwen/Qwen2.5-0.5B", roots) == "Qwen/Qwen2.5-0.5B", "a hub id is not a path"
    with pytest.raises(FileNotFoundError, match="model.llm.pretrained_path: '/nope/refiner' does not exist"):
        resolve("/nope/refiner", roots, "model.llm.pretrained_path")
    with pytest.raises(FileNotFoundError, match="unirl_pl/assets/shapes/refinr"):
        resolve("unirl_pl/assets/shapes/refinr", roots)


@pytest.mark.integration
def test_fit_runs_from_another_directory(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "unirl_pl",
            "fit",
            "--config",
            JOINT,
            "--trainer.max_steps=1",
            "--trainer.num_sanity_val_steps=0",
            "--trainer.callbacks=[unirl_pl.callbacks.LogProbIdentityCheck, unirl_pl.callbacks.RunSummary]",
            "--data.prompts_per_step=2",
            "--data.samples_per_prompt=2",
            "--model.rollout.num_steps=4",
            "--model.generator_algorithm.init_args.sde_window=[0,2]",
        ],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "runs" / "joint" / "version_0" / "metrics.csv").is_file(), "outputs stay relative to cwd"
    assert "Run summary" in proc.stdout


# ---------------------------------------------------------------- errors and help
@pytest.mark.integration
def test_config_error_is_one_short_message_and_exit_2(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "unirl_pl", "fit", "--config", TINY, "--data.samples_per_prompt=1"],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = _own_lines(proc.stderr)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert lines[0] == "error: samples_per_prompt must be >= 2 (a group of one has no relative advantage), got 1"
    assert len(lines) == 2 and lines[1] == "The options: python -m unirl_pl fit --help", lines
    assert "Traceback" not in proc.stderr and "Union" not in proc.stderr


@pytest.mark.parametrize(
    ("option", "hint"),
    [
        (
            "--model.generator.init_args.lora_rank=4",
            "'lora_rank' is accepted at: --model.llm.init_args.lora_rank, "
            "--model.generator.init_args.transformer.init_args.lora_rank",
        ),
        (
            "--model.num_steps=3",
            "'num_steps' is accepted at: --model.rollout.num_steps, --model.eval_sampler.num_steps",
        ),
        ("--data.prompts_per_stepp=3", "did you mean: --data.prompts_per_step"),
        # A prefix of a real option: argparse's abbreviations would have taken it for --trainer.max_steps.
        ("--trainer.max_step=3", "did you mean: --trainer.max_steps, --trainer.max_time"),
    ],
    ids=["nested-too-shallow", "dataclass-field", "misspelled", "abbreviated"],
)
def test_a_misplaced_option_is_told_where_it_lives(capsys, option, hint):
    with pytest.raises(SystemExit) as stop:
        main(["fit", "--config", JOINT, option])
    lines = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2
    assert lines[1] == hint, lines
    assert lines[2] == "The options: python -m unirl_pl fit --help"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model.mode=bogus"], "error: model.mode: Expected a typing.Literal"),
        (["--data.qqq=3"], "error: data: Option 'qqq' is not accepted"),
        (
            ["--model.llm=unirl_pl.experts.CausalLMExpert", "--model.llm.init_args.pretrained_path=/nope"],
            "error: model.llm.pretrained_path: '/nope' does not exist",
        ),
        (["--data.prompts=/nope.jsonl"], "error: data.prompts: '/nope.jsonl' does not exist"),
    ],
    ids=["bad-literal", "unknown-key", "missing-expert", "missing-prompts"],
)
def test_config_errors_name_the_key(capsys, args, message):
    with pytest.raises(SystemExit) as stop:
        main(["fit", "--config", TINY, *args])
    err = capsys.readouterr().err
    assert stop.value.code == 2
    assert _own_lines(err)[0].startswith(message), err
    assert "Traceback" not in err and "Union" not in err and len(_own_lines(err)) == 2


def test_run_false_raises_as_is():
    with pytest.raises(ValueError, match="Union"):
        main(["--config", TINY, "--data.samples_per_prompt=1", "--data.num_skip_refinement=0"], run=False)


def test_config_error_message_keeps_the_innermost_cause():
    inner = ValueError("prompt file 'x.jsonl' does not exist")
    outer = ValueError("Does not validate against any of the Union subtypes\nErrors:\n  - ...")
    outer.__cause__ = inner
    assert config_error_message(outer) == "prompt file 'x.jsonl' does not exist"


def test_help_names_the_command_and_test_is_gone(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--help"])
    assert stop.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m unirl_pl ") and "{fit,validate,predict," in out
    with pytest.raises(SystemExit) as stop:
        main(["test", "--config", TINY])
    assert stop.value.code == 2
    assert "invalid choice: 'test'" in capsys.readouterr().err


def test_threads_default_to_one_unless_set(monkeypatch):
    calls = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    # A CPU run, on any machine (tests/test_threads.py has the GPU side).
    monkeypatch.setattr("unirl_pl.threads.gpu_visible", lambda env=None: False)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    set_threads()
    assert calls == [] and os.environ["OMP_NUM_THREADS"] == "3"
    monkeypatch.delenv("OMP_NUM_THREADS")
    set_threads()
    assert calls == [1] and os.environ["OMP_NUM_THREADS"] == "1"
    child: dict[str, str] = {}
    set_threads(env=child)  # a subprocess's environment: this process is left alone
    assert child == {"OMP_NUM_THREADS": "1"} and calls == [1]
    set_threads(4)  # a recipe's own count
    assert calls == [1, 4]


def test_class_help_is_named_as_the_user_runs_it(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["fit", "--model.help", "unirl_pl.module.UniRLModule"])
    assert stop.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m unirl_pl "), out[:200]
    assert "__main__" not in out and "--model.rollout" in out


@pytest.mark.slow
def test_no_progress_bar_drops_the_recipes_bar_instead_of_a_traceback():
    from lightning.pytorch.callbacks import ProgressBar

    from unirl_pl.callbacks import RLProgressBar

    with_bar = main(["--config", TINY, "--trainer.logger=false"], run=False).trainer.callbacks
    assert any(isinstance(c, RLProgressBar) for c in with_bar), "the recipe has a bar to drop"
    cli = main(["--config", TINY, "--trainer.logger=false", "--trainer.enable_progress_bar=false"], run=False)
    assert not any(isinstance(c, ProgressBar) for c in cli.trainer.callbacks)
    assert any(type(c).__name__ == "RunSummary" for c in cli.trainer.callbacks), "only the bar goes"
