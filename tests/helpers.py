"""Shared test helpers: run the CLI in-process on the default recipe and read its metrics."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

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
