"""Settings refused in one line on the command line, before training, where a traceback used to come first.

Issue 41 (item 6, a reliability run) found clear messages printed after a 40-59 line traceback: checks that ran
inside Lightning's fit (``configure_model``, a callback hook, ``on_load_checkpoint``) raised a plain
``ValueError``, which the command line only turns into its one-line refusal while it parses and builds the
recipe. The algorithms' rollout checks and the EMA's components are now checked when the module is built from
the recipe, and a resume that changes the run (the EMA included) raises the project's ``InputError``. Each case
runs the main recipe's command line through ``unirl_pl.cli.main`` in this process (what ``python -m unirl_pl``
calls) with the process's stderr captured at the file descriptor, so a traceback printed by any handler or
logger is seen, and an exception that escapes the command line fails the test.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import JOINT, ROOT
from unirl_pl.cli import main

pytestmark = pytest.mark.slow  # each builds the main recipe (a few seconds); the fixture fits one step

EMA_OVERLAY = str(ROOT / "recipes" / "overlays" / "two_updates_ema.yaml")
ALGORITHMS = ROOT / "recipes" / "algorithms"
# Cheap runs: no validation, two prompts per step.
CHEAP = (
    "--trainer.num_sanity_val_steps=0",
    "--trainer.limit_val_batches=0",
    "--data.init_args.prompts_per_step=2",
)


def _fit(save_dir: Path, *args: str, max_steps: int = 1) -> int:
    """``python -m unirl_pl fit --config recipes/joint.yaml ARGS`` (cheap) in this process; its exit status."""
    argv = ["fit", "--config", JOINT, *args, f"--trainer.max_steps={max_steps}"]
    argv += [f"--trainer.logger.init_args.save_dir={save_dir}", f"--trainer.default_root_dir={save_dir}", *CHEAP]
    try:
        main(argv)
    except SystemExit as stop:
        return stop.code if isinstance(stop.code, int) else 1
    return 0


def _refused(status: int, capfd: pytest.CaptureFixture[str], *named: str) -> str:
    """The one ``error:`` line of a refused run, checked to name every string of ``named``, with no traceback."""
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert status == 2 and "Traceback" not in err, err[-3000:]
    assert len(lines) == 1 and all(n in lines[0] for n in named), err[-3000:]
    return lines[0]


@pytest.mark.parametrize(
    ("args", "setting"),
    [
        (
            ("--config", EMA_OVERLAY, "--model.init_args.ema.init_args.components=[vae]"),
            "model.ema.init_args.components",
        ),
        (
            (
                "--config",
                EMA_OVERLAY,
                "--model.init_args.ema.init_args.components=[llm]",
                "--model.init_args.mode=generator_only",
            ),
            "model.ema.init_args.components",
        ),
        (
            ("--config", str(ALGORITHMS / "dapo_published.yaml"), "--model.init_args.rollout.max_new_tokens=2"),
            "model.rollout.max_new_tokens",
        ),
        (
            ("--config", str(ALGORITHMS / "flow_grpo_fast_published.yaml"), "--model.init_args.rollout.num_steps=4"),
            "model.rollout.num_steps",
        ),
    ],
    ids=["ema_vae", "ema_llm_generator_only", "dapo_max_new_tokens", "flow_grpo_fast_num_steps"],
)
def test_a_setting_the_run_cannot_use_is_refused_in_one_line_before_training(tmp_path, capfd, args, setting):
    _refused(_fit(tmp_path, *args), capfd, setting)
    assert not list(tmp_path.rglob("*.ckpt")), "refused before the first step"


@pytest.fixture(scope="module")
def ema_checkpoint(tmp_path_factory) -> tuple[Path, Path]:
    """(the run folder, its last.ckpt) of one step of the main recipe with an EMA of both experts."""
    root = tmp_path_factory.mktemp("ema_resume")
    assert _fit(root, "--model.init_args.ema=unirl_pl.callbacks.EMA") == 0
    (ckpt,) = root.rglob("last.ckpt")
    return root, ckpt


@pytest.mark.parametrize(
    ("args", "changed"),
    [
        ((), "ema: checkpoint='on' now='off'"),
        (
            (
                "--model.init_args.ema=unirl_pl.callbacks.EMA",
                "--model.init_args.ema.init_args.components=[transformer]",
            ),
            "ema.components: checkpoint=['llm', 'transformer'] now=['transformer']",
        ),
        (("--model.init_args.ema=unirl_pl.callbacks.EMA", "--model.init_args.ema.init_args.decay=0.5"), "ema.decay"),
    ],
    ids=["ema_dropped", "ema_components_changed", "ema_decay_changed"],
)
def test_a_resume_that_drops_or_changes_the_ema_is_refused_in_one_line(ema_checkpoint, capfd, args, changed):
    """Dropping the EMA used to resume silently without it; changing its components ended in a traceback."""
    root, ckpt = ema_checkpoint
    line = _refused(_fit(root, *args, f"--ckpt_path={ckpt}", max_steps=2), capfd, changed, "model.ema", str(ckpt))
    assert "differently configured run" in line


def test_source_image_rows_are_refused_in_one_line(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """A bad source image stops the command line before anything is built; a good editing file given to the main
    recipe's text-to-image generator stops it before the first rollout. Both in one line."""
    from PIL import Image

    Image.new("RGB", (8, 8), (0, 0, 255)).save(tmp_path / "blue.png")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "make it red", "image": "blue.png"}\n{"prompt": "x", "image": "gone.png"}\n')
    line = _refused(_fit(tmp_path / "a", f"--data.init_args.prompts={bad}"), capfd, f"{bad}:2", "gone.png")
    assert "does not exist" in line
    good = tmp_path / "good.jsonl"
    good.write_text('{"prompt": "make it red", "image": "blue.png"}\n')
    status = _fit(tmp_path / "b", f"--data.init_args.prompts={good}")
    _refused(status, capfd, "model.generator", "generates from text alone")
    assert not list((tmp_path / "b").rglob("*.ckpt")), "nothing trained"
