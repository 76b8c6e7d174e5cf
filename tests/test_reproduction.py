"""The shipped ShapesWorld experts reproduce bit for bit from their pretraining recipes.

Each recipe is run exactly as documented (its first comment line), exporting to a temporary folder,
and every tensor of the export must equal the shipped file's. Slow: the refiner takes ~20 s, the
DiT and text encoder ~4 minutes on one core.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.helpers import ROOT, run_cli_subprocess

pytestmark = pytest.mark.slow
SHIPPED = ROOT / "unirl_pl" / "assets" / "shapes"


def _pretrain(recipe: str, out: Path) -> None:
    run_cli_subprocess(
        "fit", "--config", str(ROOT / "recipes" / "shapes" / recipe),
        f"--model.init_args.export_dir={out}", f"--trainer.default_root_dir={out / 'logs'}",
        "--trainer.logger=false", "--trainer.enable_checkpointing=false", "--trainer.enable_progress_bar=false",
        timeout=1200,
    )  # fmt: skip


def _assert_same(exported: Path, shipped: Path) -> None:
    got, want = load_file(exported), load_file(shipped)
    assert got.keys() == want.keys()
    diff = {k: float((got[k].float() - want[k].float()).abs().max()) for k in want if got[k].numel()}
    assert max(diff.values()) == 0.0, max(diff.items(), key=lambda kv: kv[1])


def test_refiner_pretraining_reproduces_the_shipped_weights(tmp_path):
    _pretrain("pretrain_refiner.yaml", tmp_path)
    _assert_same(tmp_path / "refiner" / "model.safetensors", SHIPPED / "refiner" / "model.safetensors")


def test_dit_pretraining_reproduces_the_shipped_weights(tmp_path):
    _pretrain("pretrain_dit.yaml", tmp_path)
    name = "diffusion_pytorch_model.safetensors"
    _assert_same(tmp_path / "transformer" / name, SHIPPED / "transformer" / name)
    _assert_same(tmp_path / "text_encoder" / "model.safetensors", SHIPPED / "text_encoder" / "model.safetensors")
