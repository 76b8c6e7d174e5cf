"""Exact resume (2N steps == N + resume + N) and atomic checkpoint writes."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from tests.helpers import TINY, read_metrics, run_cli
from unirl_pl.checkpoint import TRIMMED_KEY, AtomicCheckpointIO

N = 2
FAST = (
    "--trainer.limit_val_batches=0",
    "--model.rollout.num_steps=4",
    "--model.generator_algorithm.init_args.sde_window=[0,2]",
)


def _ckpt_callback(dirpath: Path) -> str:
    return (
        "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint"
        f" --trainer.callbacks.dirpath={dirpath} --trainer.callbacks.every_n_train_steps={N}"
        " --trainer.callbacks.save_top_k=-1"
    )


def _trainable(cli) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in cli.model.named_parameters() if v.requires_grad}


def _train_rows(cli) -> list[dict[str, float]]:
    return [r for r in read_metrics(cli) if "reward/mean" in r]


OVERLAYS = Path(__file__).resolve().parents[1] / "recipes" / "algorithms"
# Algorithms whose rollout depends on the step or the rewards: MixGRPO-Flash's window moves every step (and
# runs DPM-Solver++ after it) while DAPO drops zero-spread groups; Fast places each sample's window by its
# seed while GSPO's ratio is per sequence.
ALGORITHMS = {
    "default": (),
    "mix_grpo_flash+dapo": (
        f"--config={OVERLAYS / 'mix_grpo_flash.yaml'}",
        f"--config={OVERLAYS / 'dapo.yaml'}",
        # A one-step window moves every step (max start 4 - 2 - 1 = 1): the position must resume too.
        "--model.generator_algorithm.init_args.steps_per_window=1",
        "--model.generator_algorithm.init_args.window_size=1",
    ),
    # Two optimizer steps per rollout for each expert: the seeded split must replay after a resume.
    "flow_grpo_fast+gspo+mini_batches": (
        f"--config={OVERLAYS / 'flow_grpo_fast.yaml'}",
        f"--config={OVERLAYS / 'gspo.yaml'}",
        "--model.llm_loss.mini_batches=2",
        "--model.transformer_loss.mini_batches=2",
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("algorithms", list(ALGORITHMS.values()), ids=list(ALGORITHMS))
def test_resume_is_bit_exact(tmp_path, algorithms):
    ckpts = tmp_path / "ckpts"
    run = (f"--trainer.max_steps={2 * N}", *FAST, *algorithms)
    full = run_cli(tmp_path, *run, *_ckpt_callback(ckpts).split(), name="full")
    ckpt = ckpts / f"epoch=0-step={N}.ckpt"
    assert ckpt.is_file(), sorted(p.name for p in ckpts.iterdir())

    saved = torch.load(ckpt, weights_only=True)
    updates = 2 if "--model.llm_loss.mini_batches=2" in algorithms else 1
    assert saved["unirl_versions"]["llm"] == N * updates and saved["unirl_versions"]["text_encoder"] == 0
    assert saved[TRIMMED_KEY], "frozen base weights are trimmed from the checkpoint"
    assert all("lora_" in k for k in saved["state_dict"]), "only adapter tensors are kept"
    assert len(saved["optimizer_states"]) == 2 and "unirl_rng" in saved

    resumed = run_cli(tmp_path, *run, f"--ckpt_path={ckpt}", name="resumed")
    a, b = _trainable(full), _trainable(resumed)
    assert a.keys() == b.keys() and a
    diffs = {k: (a[k] - b[k]).abs().max().item() for k in a}
    assert max(diffs.values()) == 0.0, f"resume changed the adapters: {max(diffs.items(), key=lambda kv: kv[1])}"
    assert resumed.model.ledger.as_dict() == full.model.ledger.as_dict()

    full_rows, resumed_rows = _train_rows(full)[N:], _train_rows(resumed)
    assert len(resumed_rows) == N
    for want, got in zip(full_rows, resumed_rows, strict=True):
        # The only legitimate difference: the text-encoder cache is derived data, cold after a resume.
        want.pop("cache/text_encoder_hit_rate", None)
        got.pop("cache/text_encoder_hit_rate", None)
        assert want == got


@pytest.mark.slow
def test_resume_from_different_step_diverges(tmp_path):
    """The exactness test above can fail: resuming from the wrong position changes the adapters."""
    ckpts = tmp_path / "ckpts"
    full = run_cli(tmp_path, f"--trainer.max_steps={N + 1}", *FAST, *_ckpt_callback(ckpts).split(), name="full")
    ckpt = ckpts / f"epoch=0-step={N}.ckpt"
    state = torch.load(ckpt, weights_only=True)
    state["optimizer_states"][0]["state"] = {}  # lose the LM's Adam moments
    broken = tmp_path / "broken.ckpt"
    torch.save(state, broken)
    resumed = run_cli(tmp_path, f"--trainer.max_steps={N + 1}", *FAST, f"--ckpt_path={broken}", name="resumed")
    a, b = _trainable(full), _trainable(resumed)
    assert max((a[k] - b[k]).abs().max().item() for k in a) > 0


def test_crash_mid_write_keeps_previous_checkpoint(tmp_path, monkeypatch):
    io = AtomicCheckpointIO()
    target = tmp_path / "last.ckpt"
    io.save_checkpoint({"step": 1, "w": torch.ones(3)}, target)

    def half_write_then_die(obj, f, *args, **kwargs):
        f.write(b"PK\x03\x04 truncated")
        raise OSError("disk died mid-write")

    monkeypatch.setattr(torch, "save", half_write_then_die)
    with pytest.raises(OSError, match="mid-write"):
        io.save_checkpoint({"step": 2, "w": torch.zeros(3)}, target)
    monkeypatch.undo()
    assert io.load_checkpoint(target, weights_only=True)["step"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"], "no temp file left behind"


@pytest.mark.slow
def test_cli_uses_atomic_io(tmp_path):
    cli = run_cli(tmp_path, "--trainer.max_steps=1", *FAST)
    assert isinstance(cli.trainer.strategy.checkpoint_io, AtomicCheckpointIO)


@pytest.fixture(scope="module")
def first_run(tmp_path_factory) -> Path:
    """The checkpoint every changed-identity resume starts from (one run shared by the cases)."""
    root = tmp_path_factory.mktemp("identity")
    ckpts = root / "ckpts"
    run_cli(root, f"--trainer.max_steps={N}", *FAST, *_ckpt_callback(ckpts).split(), name="first")
    return ckpts / f"epoch=0-step={N}.ckpt"


@pytest.mark.slow
@pytest.mark.parametrize(
    "change, key",
    [
        ("--model.mode=generator_only", "mode"),
        ("--model.generator.init_args.transformer.init_args.lora_alpha=8", "lora_alpha"),
        ("--model.llm_optimizer.init_args.lr=0.005", "lr"),
        ("--model.transformer_optimizer=torch.optim.SGD", "optimizer"),
        ("--data.seed=1", "seed"),
    ],
    ids=["mode", "lora_alpha", "lr", "optimizer_class", "seed"],
)
def test_resume_with_a_changed_run_identity_is_refused(first_run, tmp_path, capsys, change, key):
    ckpt = first_run
    with pytest.raises(SystemExit) as stop:
        run_cli(tmp_path, f"--trainer.max_steps={2 * N}", *FAST, change, f"--ckpt_path={ckpt}", name="second")
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert stop.value.code == 2 and "Traceback" not in err and len(lines) == 1, err[-2000:]
    said = rf"the checkpoint {re.escape(str(ckpt))} .*Changed settings:.*{key}[^;]*: checkpoint=.* now="
    assert re.search(said, lines[0]), lines[0]


@pytest.mark.slow
def test_the_shipped_recipe_checkpoints_last_and_resumes_from_it(tmp_path):
    """`--ckpt_path last` continues the latest run from the recipe's fixed checkpoint folder."""
    from unirl_pl.cli import main

    common = [
        f"--trainer.logger.init_args.save_dir={tmp_path}",
        f"--trainer.callbacks.dirpath={tmp_path / 'ckpt'}",
        *FAST,
    ]
    main(["fit", "--config", TINY, "--trainer.max_steps=2", *common])
    assert (tmp_path / "ckpt" / "last.ckpt").is_file()
    resumed = main(["fit", "--config", TINY, "--trainer.max_steps=3", *common, "--ckpt_path=last"])
    assert resumed.trainer.global_step == 3
    assert resumed.model.ledger["transformer"] == 3, "versions continue from the checkpoint"
