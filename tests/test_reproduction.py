"""The shipped ShapesWorld experts reproduce bit for bit from their pretraining recipes.

The refiner recipe is run exactly as documented (its first comment line), exporting to a temporary
folder, and every tensor of the export must equal the shipped file's (~20 s). The DiT recipe takes
~20 minutes, longer than the whole suite may, so its test runs the recipe's first 100 steps (the
warmup, whose learning rates do not depend on ``trainer.max_steps``) and checks the SHA-256 of the
trained weights after step 100 against the one the shipped run recorded in ``fingerprints.json``.
The full DiT run reproduces the shipped weights bit for bit by hand (docs/shapesworld.md). The ShapesWorld-Edit
experts' recipes record fingerprints inside their warmups too (the refiner every 50 steps, the DiT every 20), and
their tests run the first 50 and 20 steps.

Bit-identical training needs the same CPU kernels: torch picks its vectorized kernels by what the CPU offers
(``torch.backends.cpu.get_cpu_capability()``), and float sums in another order give other bits. The shipped
files came from a machine whose capability was not recorded; on AVX2 the same recipes give other weights,
whose fingerprints were measured and are kept below. On a CPU with neither, the test names its capability
and what it got, so the new fingerprints can be added.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import ROOT, run_cli_subprocess
from unirl_pl.pretrain.flow import weights_sha256

pytestmark = pytest.mark.slow
SHIPPED = ROOT / "unirl_pl" / "assets" / "shapes"
# The ShapesWorld-Edit experts were trained on an AVX512 CPU (2026-12-06, torch 2.13.0+cpu): their shipped
# fingerprints are that capability's.
SHIPPED_EDIT = ROOT / "unirl_pl" / "assets" / "shapes_edit"
CAPABILITY = torch.backends.cpu.get_cpu_capability()
# What the recipes produce where the kernels differ from the shipping machine's (measured on torch 2.13.0).
OTHER_KERNELS = {
    "AVX2": {
        "refiner": "4e5a19113d47fabe22643ed61074757338b126d654c532250be29a0977adc4d6",
        "dit_after_step_100": "72853480558a6edf91614f4550713455c8df182e0d015904ec79dcc0c799a0a3",
    },
    # Recorded 2026-12-06 on torch 2.13.0+cpu with the landed main (24f4adf) and with this tree: the same hashes.
    "AVX512": {
        "refiner": "851e2d3ee11825acfea6f72f68335c0c263bf20f15b6abbe3146ac6a531d036b",
        "dit_after_step_100": "e36e026795c524159ed92588f2d851b6565d6e97cda2b8d4593c272ea8cdaec1",
    },
}


def _pretrain(recipe: str, out: Path, *extra: str) -> None:
    run_cli_subprocess(
        "fit", "--config", str(ROOT / "recipes" / "shapes" / recipe),
        f"--model.init_args.export_dir={out}", f"--trainer.default_root_dir={out / 'logs'}",
        "--trainer.logger=false", "--trainer.enable_checkpointing=false", "--trainer.enable_progress_bar=false",
        *extra,
        timeout=1200,
    )  # fmt: skip


def _tensors_sha256(path: Path) -> str:
    tensors = load_file(path)
    return weights_sha256([tensors[k] for k in sorted(tensors)])


def _assert_expected(got: str, shipped: str, what: str) -> None:
    other = OTHER_KERNELS.get(CAPABILITY, {}).get(what)
    expected = {shipped} | ({other} if other else set())
    assert got in expected, (
        f"{what}: SHA-256 {got} on a {CAPABILITY} CPU is neither the shipped run's nor one recorded for "
        f"these kernels ({sorted(OTHER_KERNELS)}); if the code did not change, record it in OTHER_KERNELS"
    )


def test_refiner_pretraining_reproduces_the_shipped_weights(tmp_path):
    _pretrain("pretrain_refiner.yaml", tmp_path)
    got = _tensors_sha256(tmp_path / "refiner" / "model.safetensors")
    _assert_expected(got, _tensors_sha256(SHIPPED / "refiner" / "model.safetensors"), "refiner")


def test_dit_pretraining_retraces_the_shipped_run_through_its_warmup(tmp_path):
    shipped = json.loads((SHIPPED / "fingerprints.json").read_text())["trained_weights_sha256_after_step"]
    _pretrain("pretrain_dit.yaml", tmp_path, "--trainer.max_steps=100")
    ours = json.loads((tmp_path / "fingerprints.json").read_text())["trained_weights_sha256_after_step"]
    _assert_expected(ours["100"], shipped["100"], "dit_after_step_100")
    assert len(shipped) >= 10, "the shipped run recorded its whole trajectory"


def _fingerprints(path: Path) -> dict[str, str]:
    return json.loads(path.read_text())["trained_weights_sha256_after_step"]


def test_edit_refiner_pretraining_retraces_the_shipped_run_through_its_warmup(tmp_path):
    # 50 steps: the recipe's warmup, whose learning rates do not depend on trainer.max_steps.
    shipped = _fingerprints(SHIPPED_EDIT / "refiner" / "fingerprints.json")
    _pretrain("pretrain_edit_refiner.yaml", tmp_path, "--trainer.max_steps=50", "--trainer.limit_val_batches=0")
    ours = _fingerprints(tmp_path / "refiner" / "fingerprints.json")
    _assert_expected(ours["50"], shipped["50"], "edit_refiner_after_step_50")
    assert len(shipped) == 12, "the shipped run recorded every 50th of its 600 steps"


def test_edit_dit_pretraining_retraces_the_shipped_run_from_the_scene_dit(tmp_path):
    # 20 of the warmup's 100 steps, warm-started from the shipped scene DiT and text encoder as the recipe is.
    shipped = _fingerprints(SHIPPED_EDIT / "fingerprints.json")
    _pretrain("pretrain_edit_dit.yaml", tmp_path, "--trainer.max_steps=20", "--trainer.limit_val_batches=0")
    ours = _fingerprints(tmp_path / "fingerprints.json")
    _assert_expected(ours["20"], shipped["20"], "edit_dit_after_step_20")
    assert len(shipped) == 100, "the shipped run recorded every 20th of its 2000 steps"


def test_a_different_run_is_not_accepted():
    """The check itself: a hash that is neither the shipped one nor this CPU's recorded one fails."""
    with pytest.raises(AssertionError, match="neither the shipped"):
        _assert_expected("0" * 64, "1" * 64, "refiner")
