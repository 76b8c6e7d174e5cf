"""Non-finite rewards and losses: a bad step is skipped with weights and optimizer state untouched, a bad
sample can be dropped from its group, and the default stops the run naming the reward."""

from __future__ import annotations

import importlib
import math

import lightning.pytorch as pl
import pytest
import torch

from tests.helpers import read_metrics, run_cli, series
from unirl_pl.method.advantages import fill_dropped

FAST = (
    "--trainer.limit_val_batches=0",
    "--model.rollout.num_steps=4",
    "--model.generator_algorithm.init_args.sde_window=[0,2]",
)
# The tiny recipe's step: 4 prompts x 4 samples.
BAD: dict[str, object] = {"call": 2, "value": float("nan"), "rows": [3]}
_CALLS = {"n": 0}


def poisoned(prompts: list[str], refined_prompts: list[str], images: torch.Tensor) -> list[float]:
    """Brightness, except on call ``BAD["call"]`` (1-based) where ``BAD["rows"]`` get ``BAD["value"]``."""
    _CALLS["n"] += 1
    values = images.float().mean(dim=(1, 2, 3)).tolist()
    if _CALLS["n"] == BAD["call"]:
        for row in BAD["rows"] if BAD["rows"] != "all" else range(len(values)):
            values[row] = BAD["value"]
    return values


class Snapshots(pl.Callback):
    """Trainable weights and the optimizers' step counts after every training step."""

    taken: list[tuple[dict[str, torch.Tensor], list[int]]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        weights = {k: v.detach().clone() for k, v in pl_module.named_parameters() if v.requires_grad}
        steps = [int(s["step"]) for opt in trainer.optimizers for s in opt.state.values() if "step" in s]
        Snapshots.taken.append((weights, steps))


def _shared():
    """This file as the CLI imports it (``tests.test_nonfinite``): pytest may have imported it under another
    name, and the reward's counter and the snapshots must be the ones the run uses."""
    return importlib.import_module("tests.test_nonfinite")


def _run(tmp_path, policy: str, steps: int = 4, **bad):
    shared = _shared()
    shared.BAD.update({"call": 2, "value": float("nan"), "rows": [3]} | bad)
    shared._CALLS["n"] = 0
    shared.Snapshots.taken = []
    return run_cli(
        tmp_path,
        f"--trainer.max_steps={steps}",
        *FAST,
        "--model.rewards={tests.test_nonfinite.poisoned: 1.0}",
        "--model.reward_args=null",
        f"--model.nonfinite_rewards={policy}",
        "--trainer.callbacks+=tests.test_nonfinite.Snapshots",
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "bad", [{"rows": [3]}, {"rows": "all"}, {"value": float("inf")}], ids=["one-nan", "all-nan", "inf"]
)
def test_skip_leaves_weights_and_optimizer_state_untouched(tmp_path, bad):
    cli = _run(tmp_path, "skip", **bad)
    taken = _shared().Snapshots.taken
    (w1, s1), (w2, s2) = taken[0], taken[1]
    assert all(torch.equal(w1[k], w2[k]) for k in w1), "the skipped step changed a weight"
    assert s1 == s2, "the skipped step advanced an optimizer's state"
    final, _ = taken[-1]
    assert all(bool(torch.isfinite(v).all()) for v in final.values())
    assert any(not torch.equal(final[k], w2[k]) for k in final), "training went on after the skip"
    rows = read_metrics(cli)
    assert series(rows, "train/skipped_steps") == [0.0, 1.0, 1.0, 1.0]
    assert cli.trainer.global_step == 4, "a skipped step still counts as an RL step"
    assert cli.model.ledger["transformer"] == 3 and cli.model.ledger["llm"] == 3


@pytest.mark.slow
def test_drop_removes_the_sample_and_trains_on(tmp_path):
    cli = _run(tmp_path, "drop", steps=3)
    rows = read_metrics(cli)
    assert series(rows, "reward/dropped") == [0.0, 1.0, 0.0]
    assert series(rows, "train/skipped_steps") == [0.0, 0.0, 0.0]
    assert all(math.isfinite(r) for r in series(rows, "reward/mean"))
    (w1, _), (w2, _) = _shared().Snapshots.taken[0], _shared().Snapshots.taken[1]
    assert any(not torch.equal(w1[k], w2[k]) for k in w1), "the step with a dropped sample still trains"


@pytest.mark.slow
def test_the_default_stops_the_run_naming_the_reward(tmp_path):
    with pytest.raises(ValueError, match=r"tests\.test_nonfinite\.poisoned"):
        _run(tmp_path, "error")


@pytest.mark.slow
def test_consecutive_skips_stop_the_run(tmp_path, monkeypatch):
    def always_bad(prompts, refined_prompts, images):
        return [float("nan")] * len(prompts)

    monkeypatch.setattr(_shared(), "poisoned", always_bad)
    with pytest.raises(RuntimeError, match="4 consecutive steps had a non-finite loss"):
        run_cli(tmp_path, "--trainer.max_steps=6", *FAST, "--model.rewards={tests.test_nonfinite.poisoned: 1.0}",
                "--model.reward_args=null", "--model.nonfinite_rewards=skip")  # fmt: skip


def test_fill_dropped_puts_a_bad_sample_at_its_group_mean():
    rewards = torch.tensor([1.0, float("nan"), 3.0, float("inf"), float("nan"), 5.0])
    filled, dropped = fill_dropped(rewards, torch.tensor([0, 0, 0, 1, 1, 1]))
    assert filled.tolist() == [1.0, 2.0, 3.0, 5.0, 5.0, 5.0]
    assert dropped.tolist() == [False, True, False, True, True, False]
    everything = fill_dropped(torch.full((3,), float("nan")), torch.zeros(3, dtype=torch.long))[0]
    assert everything.tolist() == [0.0, 0.0, 0.0]


@pytest.mark.slow
def test_a_checkpoint_is_never_written_with_non_finite_weights(tmp_path):
    cli = run_cli(tmp_path, "--trainer.max_steps=1", *FAST)
    param = next(p for p in cli.model.parameters() if p.requires_grad)
    with torch.no_grad():
        param[0].fill_(float("nan"))
    with pytest.raises(RuntimeError, match="not finite"):
        cli.model.on_save_checkpoint({"state_dict": cli.model.state_dict()})
