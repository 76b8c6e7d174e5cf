"""Parity across strategies: one RL step on 2 ranks (DDP, FSDP2) == one step in 1 process, same P prompts
(two SGD updates per rollout: two mini-batches); a 2-rank validation logs one process's ``val/`` values.

SGD (not Adam) and no gradient clipping, because Adam's first step is ``lr * sign(g)`` and clipping
rescales: either would hide a rank-summed instead of rank-averaged gradient (pytorch issue 162338).
Multi-process runs launch the CLI as a subprocess because Lightning re-executes the command per rank; the
one-process references run in this process (one torch thread, as a CLI subprocess here has), which spares each
of them a new interpreter's imports.
"""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch

from tests.helpers import ROOT, TINY, run_cli_subprocess
from unirl_pl.cli import main

pytestmark = pytest.mark.integration

STEP = [
    "--trainer.max_steps=1",
    "--trainer.limit_val_batches=0",
    "--trainer.enable_progress_bar=false",
    "--trainer.enable_model_summary=false",
    "--trainer.logger=false",
    "--model.rollout.num_steps=4",
    "--model.generator_algorithm.init_args.sde_window=[0,2]",
    "--model.llm_optimizer=torch.optim.SGD",
    "--model.llm_optimizer.init_args.lr=0.1",
    "--model.transformer_optimizer=torch.optim.SGD",
    "--model.transformer_optimizer.init_args.lr=0.1",
    # Two optimizer steps per rollout: the second one's gradient is taken at weights the first moved, so the
    # ranks must split the rollout into the same global mini-batches as one process.
    '--model.llm_loss={"clip_eps": 0.2, "beta": 0.01, "grad_clip": null, "mini_batches": 2}',
    '--model.transformer_loss={"clip_eps": 1.0e-4, "beta": 0.004, "grad_clip": null, "mini_batches": 2}',
    "--data.init_args.prompts_per_step=4",
    # Each rank divides by the global batch's reward std, not its own half's: a rank that used its local
    # std would break the parity below (the per-group mean and std never span ranks).
    "--model.advantage.global_std=true",
]


OVERLAYS = (str(ROOT / "recipes" / "ddp.yaml"), str(ROOT / "recipes" / "fsdp.yaml"))


def _cli(*args: str) -> None:
    """``python -m unirl_pl <args>``: on 2 ranks (a strategy overlay given) in a subprocess, else in this process."""
    if any(arg in OVERLAYS for arg in args):
        run_cli_subprocess(*args, timeout=600)
    else:
        main(list(args))


def _fit(tmp_path: Path, name: str, *extra: str, full: bool = False) -> dict[str, torch.Tensor]:
    """One RL step's trained tensors from the checkpoint: the adapters, or (``full``) every saved weight."""
    ckpts = tmp_path / name
    _cli(
        "fit",
        "--config",
        TINY,
        *extra,
        *STEP,
        f"--trainer.default_root_dir={ckpts}",
        "--trainer.callbacks=[unirl_pl.callbacks.LogProbIdentityCheck, unirl_pl.callbacks.WeightVersionLedger]",
        "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
        f"--trainer.callbacks.dirpath={ckpts}",
        "--trainer.callbacks.every_n_train_steps=1",
    )
    (ckpt,) = ckpts.glob("*.ckpt")
    state = torch.load(ckpt, weights_only=True)
    assert state["unirl_versions"]["llm"] == 2 and state["unirl_versions"]["transformer"] == 2, "2 mini-batches"
    return {k: v.float() for k, v in state["state_dict"].items() if full or "lora_" in k}


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> dict[str, torch.Tensor]:
    return _fit(tmp_path_factory.mktemp("single"), "single")


def _initial() -> dict[str, torch.Tensor]:
    cli = main(["--config", TINY, "--trainer.logger=false"], run=False)
    cli.model.configure_model()
    return {k: v.detach().float() for k, v in cli.model.state_dict().items() if "lora_" in k}


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_single_step_moves_the_adapters(single):
    # A 2x gradient scale error must be far above the 1e-6 tolerance for the parity tests to mean anything.
    assert _max_diff(single, _initial()) > 1e-4


@pytest.mark.parametrize(
    "name, overlay, extra",
    [
        ("ddp", "ddp.yaml", []),
        ("fsdp2", "fsdp.yaml", []),
        ("fsdp2-keep-gathered", "fsdp.yaml", ["--model.init_args.reshard_after_forward=false"]),
    ],
)
def test_two_ranks_match_one_process(tmp_path, single, name, overlay, extra):
    multi = _fit(tmp_path, name, "--config", str(ROOT / "recipes" / overlay), *extra)
    diff = _max_diff(single, multi)
    print(f"{name} parity max abs diff: {diff:.3e}")
    assert diff <= 1e-6, f"{name}: 2-rank update differs from 1-process update by {diff:.3e}"


FULL = [
    "--model.llm.init_args.finetune=full",
    "--model.generator.init_args.transformer.init_args.finetune=full",
]


def test_full_fine_tune_on_two_fsdp2_ranks_matches_one_process(tmp_path):
    """Both experts fully fine-tuned: the policy and its frozen reference copy sharded on 2 ranks give the
    update of one process (the KL reference forward runs on the sharded copy)."""
    single = _fit(tmp_path, "full-single", *FULL, full=True)
    multi = _fit(tmp_path, "full-fsdp2", "--config", str(ROOT / "recipes" / "fsdp.yaml"), *FULL, full=True)
    assert any(k.endswith("q_proj.weight") for k in single), "the checkpoint holds the full weights"
    diff = _max_diff(single, multi)
    print(f"full fine-tune fsdp2 parity max abs diff: {diff:.3e}")
    assert diff <= 1e-6, f"full fine-tune: 2-rank update differs from 1-process update by {diff:.3e}"


# Adam, not STEP's plain SGD: Lightning's FSDP2 full-checkpoint loader crashes on an empty optimizer state.
ADAM = [
    "--model.llm_optimizer=torch.optim.AdamW",
    "--model.llm_optimizer.init_args.lr=0.01",
    "--model.transformer_optimizer=torch.optim.AdamW",
    "--model.transformer_optimizer.init_args.lr=0.01",
]


def _run_fsdp2(tmp_path: Path, name: str, *extra: str) -> Path:
    out = tmp_path / name
    run_cli_subprocess(
        "fit", "--config", TINY, "--config", str(ROOT / "recipes" / "fsdp.yaml"),
        *STEP, "--trainer.max_steps=2", *ADAM, *extra,
        f"--trainer.default_root_dir={out}",
        "--trainer.callbacks=[unirl_pl.callbacks.LogProbIdentityCheck, unirl_pl.callbacks.WeightVersionLedger]",
        "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
        f"--trainer.callbacks.dirpath={out}",
        "--trainer.callbacks.every_n_train_steps=1",
        "--trainer.callbacks.save_top_k=-1",
        timeout=600,
    )  # fmt: skip
    return out


def test_fsdp2_resume_is_bit_exact(tmp_path):
    """2 FSDP2 steps in one run == 1 step, resume from the checkpoint, 1 more step."""
    full = _run_fsdp2(tmp_path, "full")
    resumed = _run_fsdp2(tmp_path, "resumed", f"--ckpt_path={full / 'epoch=0-step=1.ckpt'}")
    a = torch.load(full / "epoch=0-step=2.ckpt", weights_only=True)
    b = torch.load(resumed / "epoch=0-step=2.ckpt", weights_only=True)
    assert a["unirl_versions"] == b["unirl_versions"] and a["unirl_versions"]["llm"] == 4, "2 steps x 2 mini-batches"
    lora = [k for k in a["state_dict"] if "lora_" in k]
    assert lora and all(torch.equal(a["state_dict"][k], b["state_dict"][k]) for k in lora)


# Validation: the tiny experts scored by the ShapesWorld verifier on 7 held-out prompts, 2 per batch. On 2 ranks
# the strided shards are prompts 0, 2, 4, 6 and 1, 3, 5 plus a padded row, so each rank holds categories the other
# lacks (the composition split cycles the six categories) and one batch is part padding.
VALIDATE = [
    "--trainer.limit_val_batches=1.0",
    "--trainer.enable_progress_bar=false",
    "--trainer.enable_model_summary=false",
    "--trainer.logger=lightning.pytorch.loggers.CSVLogger",
    "--model.rewards={shapes_geneval: 1.0, brightness: 0.5}",
    "--model.reward_args={}",
    "--data.init_args.val_batch_size=2",
]


def _validate(tmp_path: Path, name: str, *extra: str) -> dict[str, float]:
    """The ``val/`` values a ``validate`` of :data:`VALIDATE` logs (rank 0's metrics.csv)."""
    prompts = tmp_path / "val.jsonl"
    rows = (ROOT / "unirl_pl" / "assets" / "shapes" / "prompts_composition.jsonl").read_text().splitlines()
    prompts.write_text("\n".join(rows[:7]) + "\n")
    out = tmp_path / name
    _cli(
        "validate", "--config", TINY, *extra, *VALIDATE,
        f"--data.init_args.val_prompts={prompts}",
        f"--trainer.logger.init_args.save_dir={out}",
        f"--trainer.default_root_dir={out}",
    )  # fmt: skip
    (path,) = out.glob("**/metrics.csv")
    (row,) = csv.DictReader(path.open())
    return {key: float(value) for key, value in row.items() if key.startswith("val/") and value != ""}


@pytest.fixture(scope="module")
def single_validation(tmp_path_factory) -> dict[str, float]:
    return _validate(tmp_path_factory.mktemp("single_val"), "single")


@pytest.mark.parametrize("name, overlay", [("ddp", "ddp.yaml"), ("fsdp2", "fsdp.yaml")])
def test_two_rank_validation_matches_one_process(tmp_path, single_validation, name, overlay):
    """Every ``val/`` value of a 2-rank validation, the per-category breakdown included, is one process's:
    each score's sum and count are summed over ranks, and the padded row counts nowhere."""
    categories = {key.rsplit("/", 1)[1] for key in single_validation if key.startswith("val/shapes_geneval/")}
    assert categories == {"overall", "single_object", "two_object", "counting", "colors", "position", "color_attr"}
    multi = _validate(tmp_path, name, "--config", str(ROOT / "recipes" / overlay))
    assert multi.keys() == single_validation.keys(), f"{name}: keys differ"
    diffs = {key: abs(multi[key] - single_validation[key]) for key in multi}
    print(f"{name} validation max abs diff: {max(diffs.values()):.3e}")
    assert all(diff <= 1e-6 for diff in diffs.values()), f"{name}: 2-rank validation differs: {diffs}"
