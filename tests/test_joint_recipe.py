"""The main job, ``python -m unirl_pl fit --config recipes/joint.yaml``, exactly as a newcomer runs it."""

import csv
import glob
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import JOINT, ROOT

pytestmark = pytest.mark.slow

REQUIRED = ["reward/mean", "llm/pg_loss", "llm/kl", "transformer/pg_loss", "transformer/kl",
            "transformer/ratio_mean", "transformer/grad_norm"]  # fmt: skip


def _column(rows: list[dict[str, str]], key: str) -> list[float]:
    return [float(r[key]) for r in rows if r.get(key, "") != ""]


def test_default_recipe_runs_offline_and_its_reward_rises(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "unirl_pl", "fit", "--config", JOINT,
           f"--trainer.logger.init_args.save_dir={tmp_path}", f"--trainer.default_root_dir={tmp_path}",
           f"--trainer.callbacks.dirpath={tmp_path / 'checkpoints'}"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (path,) = glob.glob(str(tmp_path / "joint" / "version_*" / "metrics.csv"))
    rows = list(csv.DictReader(Path(path).open()))
    for key in REQUIRED:
        assert _column(rows, key), f"metrics.csv has no {key}"
    reward = _column(rows, "reward/mean")
    assert len(reward) == 40
    first, last = sum(reward[:10]) / 10, sum(reward[-10:]) / 10
    print(f"reward/mean first 10: {first:.3f}  last 10: {last:.3f}")
    assert last > first + 0.05, reward
    assert max(_column(rows, "c2/llm_max_abs_diff")) <= 1e-5
    assert max(_column(rows, "c2/transformer_max_abs_diff")) == 0.0
    assert all(abs(r - 1) <= 1e-5 for r in _column(rows, "transformer/ratio_mean"))
    assert max(_column(rows, "parity/max_abs_diff")) <= 1e-4
    assert _column(rows, "val/shapes_geneval/strict/overall"), "validation reports the verifier per category"
