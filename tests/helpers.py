"""Shared test helpers: run the CLI in-process on the default recipe and read its metrics."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from unirl_pl.algorithms import DAPO, GSPO, TokenGRPO
from unirl_pl.cli import main

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "recipes" / "tiny.yaml")
JOINT = str(ROOT / "recipes" / "joint.yaml")
# The refiner algorithms by aggregation: token mean, mean over refinements, clip-higher, sequence ratio (GSPO's
# clip widened so a chunk's ratios are not all clipped).
REFINER_ALGORITHMS = {
    "token_grpo": TokenGRPO(),
    "sequence_mean": TokenGRPO(aggregation="sequence_mean"),
    "dapo": DAPO(),
    "gspo": GSPO(clip_eps_low=0.05, clip_eps_high=0.05),
}


def run_cli(tmp_path: Path, *overrides: str, subcommand: str = "fit", config: str = TINY, name: str = "run"):
    """Run ``python -m unirl_pl <subcommand> --config <config> ...`` in this process; return the CLI object.

    The tiny recipe is the default: the trainer's own tests need speed, not a pretrained task.
    """
    args = [
        subcommand,
        "--config",
        config,
        f"--trainer.logger.init_args.save_dir={tmp_path}",
        f"--trainer.logger.init_args.name={name}",
        f"--trainer.default_root_dir={tmp_path}",
        "--trainer.enable_progress_bar=false",
        "--trainer.callbacks=[unirl_pl.callbacks.LogProbIdentityCheck, unirl_pl.callbacks.WeightVersionLedger]",
        "--trainer.enable_model_summary=false",
        *overrides,
    ]
    return main(args)


def read_metrics(cli) -> list[dict[str, float]]:
    """The rows of the run's ``metrics.csv`` with empty cells dropped and values as floats."""
    path = Path(cli.trainer.logger.log_dir) / "metrics.csv"
    rows = []
    with path.open() as f:
        for row in csv.DictReader(f):
            rows.append({k: float(v) for k, v in row.items() if v != ""})
    return rows


def series(rows: list[dict[str, float]], key: str) -> list[float]:
    return [r[key] for r in rows if key in r]


def subprocess_env() -> dict[str, str]:
    """The environment of a CLI subprocess: offline, one thread, this checkout importable."""
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return env


def run_cli_subprocess(*args: str, cwd: Path = ROOT, timeout: int = 900) -> subprocess.CompletedProcess:
    """``python -m unirl_pl <args>`` in a fresh process (Lightning re-executes it per rank); asserts exit 0."""
    cmd = [sys.executable, "-m", "unirl_pl", *args]
    proc = subprocess.run(cmd, cwd=cwd, env=subprocess_env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def built_generator(folder: Path, family: type, tokens: int, size: dict[str, int], **overrides: object) -> Any:
    """A family generator loaded from a tiny pipeline ``folder`` (float32, LoRA r 4 / alpha 8, ``tokens`` text
    tokens, ``size``), checked to be of class ``family``, and built; ``overrides`` replace any of those."""
    from unirl_pl.generators import load_generator

    kwargs = {"dtype": "float32", "lora_rank": 4, "lora_alpha": 8.0, "max_sequence_length": tokens, **size}
    generator = load_generator(folder, **{**kwargs, **overrides})
    assert isinstance(generator, family), type(generator)
    generator.build()
    return generator


def fit_with_callbacks(tmp_path: Path, callbacks: list[Any], *overrides: str, ckpt_path: str | None = None):
    """Fit the tiny recipe in this process with ``callbacks`` first in the trainer's line (no others, no progress
    bar or model summary, logs under ``tmp_path``), resuming from ``ckpt_path`` when given; the CLI object."""
    cli = main(
        [
            "--config",
            TINY,
            "--trainer.callbacks=[]",
            "--trainer.enable_progress_bar=false",
            "--trainer.enable_model_summary=false",
            f"--trainer.logger.init_args.save_dir={tmp_path}",
            f"--trainer.default_root_dir={tmp_path}",
            *overrides,
        ],
        run=False,
    )
    cli.trainer.callbacks[:0] = callbacks
    cli.trainer.fit(cli.model, datamodule=cli.datamodule, ckpt_path=ckpt_path)
    return cli
