"""A newcomer's walk: the README's main job, then every line of its "After the main job" block, in order.

The lines are read from README.md, so the test fails when the README shows a command that does not run
as written. Each gets a few overrides appended (a few steps, one small validation batch) so the walk
takes minutes, not the hour the full commands take; the overrides only shrink the work. The main job runs
as a newcomer types it, ``python -m unirl_pl`` in a fresh folder; the lines after it run through the same
entry point (:func:`unirl_pl.cli.main`, which hands the tools on) in this process, from that folder: a
process of their own would add 6-7 s of imports each and test nothing more.
"""

from __future__ import annotations

import io
import logging
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT
from unirl_pl.cli import main

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SMALL_FIT = (
    "--trainer.max_steps=2",
    "--trainer.val_check_interval=2",
    "--trainer.num_sanity_val_steps=0",
    "--trainer.limit_val_batches=1",
    "--data.val_batch_size=4",
    "--data.val_images_per_prompt=1",
    "--data.prompts_per_step=2",
    "--model.rollout.num_steps=4",
    "--model.generator_algorithm.init_args.sde_window=[0,2]",
)
SMALL = {
    "fit": SMALL_FIT,
    "validate": ("--trainer.limit_val_batches=1", "--data.val_batch_size=4", "--data.val_images_per_prompt=1"),
    "predict": ("--trainer.limit_predict_batches=1", "--data.val_batch_size=4"),
    "export": (),
    "ablate": ("--seeds", "0", "--modes", "joint", "--extra-val"),
    "bench": ("--repeats", "1", "--warmup", "0", "--prompts-per-step", "2"),
}


def readme_commands() -> tuple[str, list[str]]:
    """The main job (the set-up line's ``python -m unirl_pl`` part) and the lines of "After the main job"."""
    text = (ROOT / "README.md").read_text()
    setup = next(line for line in text.splitlines() if line.startswith("python -m venv"))
    main_job = next(part.strip() for part in setup.split("&&") if part.strip().startswith("python -m unirl_pl"))
    after = text.split("## After the main job", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    return main_job, [line.strip() for line in after.splitlines() if line.strip()]


def _argv(command: str) -> list[str]:
    """The words after ``python -m unirl_pl``, recipes by their absolute path (the walk runs in a fresh folder, as
    a user's own directory), with the subcommand's overrides appended."""
    words = shlex.split(command)
    assert words[:3] == ["python", "-m", "unirl_pl"], command
    sub = words[3]
    words = [str(ROOT / w) if w.startswith("recipes/") else w for w in words[3:]]
    small = SMALL[sub]
    if sub == "fit" and "--ckpt_path" in words:
        small = (*small, "--trainer.max_steps=3")  # one more step than the run it resumes
    return [*words, *small]


def _run(command: str, cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    """``command`` in a process of its own, in ``cwd``."""
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    argv = [sys.executable, "-m", "unirl_pl", *_argv(command)]
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def _run_here(command: str, capfd: pytest.CaptureFixture[str]) -> subprocess.CompletedProcess:
    """``command`` through ``python -m unirl_pl``'s entry point in this process (in the current folder): its exit
    status and what it wrote to the standard streams, as :func:`_run` gives them."""
    argv = _argv(command)
    # Lightning's messages ("Restoring states from ...") go to the handler it gave its logger at import, whose
    # stream is whatever sys.stderr was then: read them from the logger, as a process's stderr would show them.
    logged = io.StringIO()
    handler = logging.StreamHandler(logged)
    lightning_log = logging.getLogger("lightning.pytorch")
    lightning_log.addHandler(handler)
    capfd.readouterr()
    try:
        main(argv)
        code = 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    finally:
        lightning_log.removeHandler(handler)
    out, err = capfd.readouterr()
    return subprocess.CompletedProcess(argv, code, out, err + logged.getvalue())


def test_the_readme_walk_runs_as_written(tmp_path, monkeypatch, capfd):
    main_job, after = readme_commands()
    assert main_job == "python -m unirl_pl fit --config recipes/joint.yaml"
    subcommands = [shlex.split(line)[3] for line in after]
    assert subcommands == ["validate", "predict", "export", "fit", "fit", "ablate", "bench"], after
    runs = tmp_path / "runs" / "joint"

    first = _run(main_job, tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    first_ckpts = sorted(p.name for p in (runs / "version_0" / "checkpoints").iterdir())
    assert "last.ckpt" in first_ckpts

    monkeypatch.chdir(tmp_path)
    done: dict[str, subprocess.CompletedProcess] = {}
    for line in after:
        proc = _run_here(line, capfd)
        assert proc.returncode == 0, f"{line}\n{proc.stderr[-3000:]}"
        done.setdefault(shlex.split(line)[3], proc)
        if "--ckpt_path last" in line and shlex.split(line)[3] == "fit":
            resumed = proc
    assert "val/shapes_geneval/strict/overall" in done["validate"].stdout
    predictions = (runs / "predict" / "predictions.jsonl").read_text().splitlines()
    assert len(predictions) == 4, "one small predict batch"
    assert (runs / "export" / "llm").is_dir() and (runs / "export" / "transformer").is_dir()
    # The second fit is its own run with its own checkpoints; the first run's are untouched.
    assert sorted(p.name for p in (runs / "version_0" / "checkpoints").iterdir()) == first_ckpts
    assert (runs / "version_1" / "checkpoints" / "last.ckpt").is_file()
    # --ckpt_path last resumed the newest run (the second), not the first.
    output = resumed.stdout + resumed.stderr
    assert "Restoring states from the checkpoint path at runs/joint/version_1/checkpoints/last.ckpt" in output
    assert (tmp_path / "runs" / "ablation" / "ablation.md").is_file()
    assert "floor" in done["bench"].stdout.lower()
