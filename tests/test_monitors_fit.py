"""The reward-hacking monitor in short fits of the tiny recipe, each with one hack injected into the rollout
(images that darken, a checkerboard, a group collapsed to one image, a refiner appending a fixed phrase, a
reward rising while a gold reward falls): the alarm fires and its action happens. A healthy run raises none.

The hacks edit the experience after rollout (its images, refinements or rewards), from the third rollout on, so
the first two steps are the monitor's baseline."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from tests.helpers import fit_with_callbacks, read_metrics, series
from unirl_pl.callbacks import RewardHackingMonitor, RunSummary
from unirl_pl.method.experience import ExperienceSource
from unirl_pl.records import Experience
from unirl_pl.rewards import Reward, RewardTerm

pytestmark = pytest.mark.slow  # each fit builds the tiny recipe and runs a few steps (~5-10 s)
HACK_FROM = 2  # rollouts 0 and 1 are the baseline
PHRASE = " masterpiece trending on artstation"


def inject(monkeypatch, hack) -> None:
    """Apply ``hack(exp, n)`` to the ``n``-th rollout's experience."""
    original, calls = ExperienceSource.collect, []

    def collect(self, *args, **kwargs) -> Experience:
        exp = original(self, *args, **kwargs)
        hack(exp, len(calls))
        calls.append(1)
        return exp

    monkeypatch.setattr(ExperienceSource, "collect", collect)


def darken(exp: Experience, n: int) -> None:
    exp.images = exp.images / (1 + 20 * max(0, n - 1))


def checkerboard(exp: Experience, n: int) -> None:
    if n >= HACK_FROM:
        h, w = exp.images.shape[-2:]
        board = ((torch.arange(h).view(-1, 1) + torch.arange(w).view(1, -1)) % 2).to(exp.images)
        exp.images = 0.1 * exp.images + 0.9 * board


def collapse(exp: Experience, n: int) -> None:
    if n >= HACK_FROM:
        first = {}
        for i, prompt in enumerate(exp.prompts):
            first.setdefault(prompt, i)
        exp.images = exp.images[[first[p] for p in exp.prompts]].clone()


def append_phrase(exp: Experience, n: int) -> None:
    if n >= HACK_FROM:
        exp.refined = [r + PHRASE if r != p else r for p, r in zip(exp.prompts, exp.refined, strict=True)]


def rising_reward(exp: Experience, n: int) -> None:
    exp.rewards = exp.rewards + n


class FallingGold(Reward):
    """A gold reward that falls by 0.2 at each validation batch it scores."""

    name = "falling"
    calls = 0

    def __call__(self, prompts, refined_prompts, images):
        FallingGold.calls += 1
        return [1.0 - 0.2 * FallingGold.calls] * len(prompts)


class RollbackSpy(RewardHackingMonitor):
    """The monitor, keeping the trainable weights as the first rollback left them."""

    restored_weights: dict[str, torch.Tensor] | None = None

    def act(self, trainer, pl_module, raised) -> None:
        super().act(trainer, pl_module, raised)
        if self.restored_from and self.restored_weights is None:
            named = pl_module.named_parameters()
            self.restored_weights = {n: p.detach().clone() for n, p in named if p.requires_grad}


def fit(tmp_path, callbacks, *overrides: str, ckpt_path: str | None = None):
    return fit_with_callbacks(tmp_path, callbacks, "--trainer.limit_val_batches=0", *overrides, ckpt_path=ckpt_path)


def test_a_healthy_run_raises_no_alarm(tmp_path):
    monitor = RewardHackingMonitor(baseline_steps=2)
    cli = fit(tmp_path, [monitor], "--trainer.max_steps=4", "--trainer.enable_checkpointing=false")
    rows = read_metrics(cli)
    assert series(rows, "hack/alarms") == [0.0] * 4
    for key in ("dark_frac", "high_freq", "diversity", "length", "recurring_phrase"):
        assert len(series(rows, f"hack/{key}")) == 4, key
    assert monitor.alarms == [] and len(monitor.baselines) == 11


def test_darkening_images_stop_the_run_with_a_checkpoint_that_resumes(tmp_path, monkeypatch, capsys):
    inject(monkeypatch, darken)
    monitor = RewardHackingMonitor(baseline_steps=2, refinement_stats=False, action="stop")
    cli = fit(tmp_path, [monitor], "--trainer.max_steps=6", "--trainer.enable_checkpointing=false")
    assert cli.trainer.global_step == 3, "stopped after the step that alarmed"
    assert [(a.signal, a.step) for a in monitor.alarms][:1] == [("dark_frac", 2)]
    assert monitor.saved_path is not None and monitor.saved_path.is_file()
    assert "stopping: reward hacking suspected: hack/dark_frac at step 2" in capsys.readouterr().err
    assert series(read_metrics(cli), "hack/alarms")[-1] >= 1.0
    monkeypatch.undo()
    resumed = RewardHackingMonitor(baseline_steps=2, refinement_stats=False, action="stop")
    again = fit(tmp_path, [resumed], "--trainer.max_steps=4", ckpt_path=str(monitor.saved_path))
    assert again.trainer.global_step == 4
    assert resumed.alarms[:1] == monitor.alarms[:1], "the alarm is restored with the monitor's state"


def test_a_checkerboard_raises_the_high_frequency_alarm_and_warns(tmp_path, monkeypatch):
    inject(monkeypatch, checkerboard)
    monitor = RewardHackingMonitor(baseline_steps=2, refinement_stats=False)
    with pytest.warns(UserWarning, match="hack/high_freq at step 2"):
        fit(tmp_path, [monitor], "--trainer.max_steps=3", "--trainer.enable_checkpointing=false")
    assert "high_freq" in [a.signal for a in monitor.alarms]


def test_a_group_collapsed_to_one_image_raises_the_diversity_alarm(tmp_path, monkeypatch, capsys):
    inject(monkeypatch, collapse)
    monitor = RewardHackingMonitor(baseline_steps=2, refinement_stats=False)
    summary = RunSummary(curve=False)
    with pytest.warns(UserWarning, match="hack/diversity at step 2: 0 against"):
        cli = fit(tmp_path, [monitor, summary], "--trainer.max_steps=3", "--trainer.enable_checkpointing=false")
    assert [a.signal for a in monitor.alarms] == ["diversity"]
    assert series(read_metrics(cli), "hack/alarms") == [0.0, 0.0, 1.0]
    assert "hack/diversity at step 2: 0 against baseline" in capsys.readouterr().out, "the run summary lists it"


def test_a_fixed_phrase_rolls_back_to_the_last_checkpoint_and_runs_to_max_steps(tmp_path, monkeypatch, capsys):
    inject(monkeypatch, append_phrase)
    monitor = RollbackSpy(baseline_steps=2, image_stats=False, action="rollback")
    saver = ModelCheckpoint(dirpath=tmp_path / "ckpts", every_n_train_steps=1, save_top_k=-1)
    cli = fit(tmp_path, [monitor, saver], "--trainer.max_steps=4")
    assert cli.trainer.global_step == 4, "the run goes on to max_steps"
    assert ("recurring_phrase", 2) in [(a.signal, a.step) for a in monitor.alarms]
    # Restored from the checkpoint of the step before the alarm (global step 2), not the alarming one.
    assert monitor.restored_from and monitor.restored_from[0].endswith("step=2.ckpt")
    saved = torch.load(monitor.restored_from[0], map_location="cpu", weights_only=False)["state_dict"]
    assert monitor.restored_weights and all(torch.equal(w, saved[n]) for n, w in monitor.restored_weights.items())
    assert "rolled back to" in capsys.readouterr().err
    assert series(read_metrics(cli), "hack/alarms")[-1] >= 1.0


def test_a_reward_rising_while_the_gold_reward_falls_stops_the_run(tmp_path, monkeypatch):
    inject(monkeypatch, rising_reward)
    FallingGold.calls = 0
    gold = [RewardTerm(FallingGold(), 1.0)]
    monitor = RewardHackingMonitor(
        image_stats=False, refinement_stats=False, gold_rewards=gold, window=2, gold_drop=0.1, action="stop"
    )
    overrides = ["--trainer.val_check_interval=1", "--trainer.limit_val_batches=1", "--trainer.num_sanity_val_steps=0"]
    cli = fit(tmp_path, [monitor], "--trainer.max_steps=6", "--trainer.enable_checkpointing=false", *overrides)
    assert [(a.signal, a.step) for a in monitor.alarms] == [("gold/falling", 3)]
    assert cli.trainer.global_step == 3 and monitor.saved_path is not None and monitor.saved_path.is_file()
    assert series(read_metrics(cli), "hack/gold/falling")[:3] == pytest.approx([0.8, 0.6, 0.4])
