"""The edit main job, ``python -m unirl_pl fit --config recipes/edit.yaml``, end to end on a short budget: the
shipped edit experts load, each row's source reaches the DiT and the reward, validation reports the
ShapesWorld-Edit verifier per kind, and both experts' gates hold. That it learns is shown by the full command
(README, docs/shapesworld.md) and its 5-seed ablation (docs/data/edit/)."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT
from unirl_pl.shapes import EDIT_KINDS

pytestmark = pytest.mark.integration


def test_the_edit_recipe_trains_both_experts_and_scores_held_out_edits_per_kind(tmp_path: Path) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "unirl_pl", "fit", "--config", str(ROOT / "recipes" / "edit.yaml"),
           f"--trainer.logger.init_args.save_dir={tmp_path}", f"--trainer.default_root_dir={tmp_path}",
           f"--trainer.callbacks.dirpath={tmp_path / 'checkpoints'}", "--trainer.max_steps=2",
           "--trainer.val_check_interval=2", "--data.val_batch_size=10", "--trainer.limit_val_batches=1",
           "--data.prompts_per_step=2", "--data.samples_per_prompt=2"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (metrics,) = (tmp_path / "edit").glob("version_*/metrics.csv")
    rows = list(csv.DictReader(metrics.open()))

    def column(key: str) -> list[float]:
        return [float(r[key]) for r in rows if r.get(key, "") != ""]

    assert len(column("reward/mean")) == 2
    for key in ("llm/pg_loss", "transformer/pg_loss", "reward/shapes_edit"):
        assert column(key), f"metrics.csv has no {key}"
    for kind in (*EDIT_KINDS, "overall"):
        assert len(column(f"val/shapes_edit/strict/{kind}")) == 1, kind  # one validation, after step 2
    assert 0.0 <= column("val/shapes_edit/soft/overall")[0] <= 1.0
    assert max(column("c2/llm_max_abs_diff")) <= 1e-5
    assert max(column("c2/transformer_max_abs_diff")) == 0.0
