"""``ppo_epochs > 1``: several optimizer passes over one experience still count as one RL step."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import unirl_pl.algorithms.drivers as drivers
from tests.helpers import read_metrics, run_cli, series

FAST = (
    "--trainer.limit_val_batches=0",
    "--model.rollout.num_steps=4",
    "--model.generator_algorithm.init_args.sde_window=[0,2]",
)
EPOCHS = "--model.ppo_epochs=2"


@pytest.mark.slow
def test_max_steps_counts_rl_steps_not_epochs(tmp_path):
    cli = run_cli(tmp_path, "--trainer.max_steps=4", EPOCHS, *FAST)
    rows = read_metrics(cli)
    assert len(series(rows, "reward/mean")) == 4, "each RL step logs one reward row"
    assert cli.trainer.global_step == 4
    # Two optimizer steps per RL step, each a new weight version.
    assert cli.model.ledger.as_dict()["llm"] == 8 and cli.model.ledger.as_dict()["transformer"] == 8


@pytest.mark.slow
def test_ratio_leaves_one_only_from_the_second_epoch(tmp_path, monkeypatch):
    # Largest |ratio - 1| of each loss call, in call order (epoch 0, epoch 1, ...).
    seen: dict[str, list[float]] = {"llm": [], "transformer": []}

    def recording(name, fn):
        def wrapper(*args, **kwargs):
            out = fn(*args, **kwargs)
            seen[name].append(max(float(out.ratio_max) - 1, 1 - float(out.ratio_min)))
            return out

        return wrapper

    monkeypatch.setattr(drivers, "token_policy_loss", recording("llm", drivers.token_policy_loss))
    monkeypatch.setattr(drivers, "flow_grpo_loss", recording("transformer", drivers.flow_grpo_loss))
    run_cli(tmp_path, "--trainer.max_steps=2", EPOCHS, *FAST)
    # Loss calls per PPO epoch: one for the LM, one per SDE window step for the DiT (window [0, 2]).
    # LM: KV-cache decode vs teacher-forced forward differ by float32 kernel noise (up to 1.1e-5 measured).
    for name, per_epoch, tol in (("llm", 1, 1e-4), ("transformer", 2, 0.0)):
        ratios = seen[name]
        assert len(ratios) == 2 * 2 * per_epoch, (name, ratios)  # 2 RL steps x 2 epochs
        epochs = [ratios[i : i + per_epoch] for i in range(0, len(ratios), per_epoch)]
        first = [r for group in epochs[0::2] for r in group]
        second = [r for group in epochs[1::2] for r in group]
        # On-policy first pass: the DiT recompute is bitwise, the LM within kernel noise.
        assert all(r <= tol for r in first), (name, first)
        assert all(r > 1e-5 for r in second), (name, second)


def _ckpt(dirpath: Path) -> list[str]:
    return [
        "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
        f"--trainer.callbacks.dirpath={dirpath}",
        "--trainer.callbacks.every_n_train_steps=2",
        "--trainer.callbacks.save_top_k=-1",
    ]


@pytest.mark.integration
def test_resume_continues_at_the_right_prompt_batch(tmp_path):
    """4 RL steps straight == 2 + resume + 2: same prompts (same rewards) and same adapters."""
    ckpts = tmp_path / "ckpts"
    full = run_cli(tmp_path, "--trainer.max_steps=4", EPOCHS, *FAST, *_ckpt(ckpts), name="full")
    ckpt = ckpts / "epoch=0-step=2.ckpt"
    assert ckpt.is_file(), sorted(p.name for p in ckpts.iterdir())
    resumed = run_cli(tmp_path, "--trainer.max_steps=4", EPOCHS, *FAST, f"--ckpt_path={ckpt}", name="resumed")
    assert series(read_metrics(resumed), "reward/mean") == series(read_metrics(full), "reward/mean")[2:]
    a = {k: v for k, v in full.model.named_parameters() if v.requires_grad}
    b = {k: v for k, v in resumed.model.named_parameters() if v.requires_grad}
    assert max(float((a[k] - b[k]).abs().max()) for k in a) == 0.0
    assert torch.equal(torch.tensor(resumed.trainer.global_step), torch.tensor(4))
