"""Several optimizer steps per rollout in a run: each mini-batch trained once per epoch, the gates fed the whole
rollout before any update, the rollout correction anchored at the pre-update policy over every epoch."""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import lightning.pytorch as pl
import pytest
import torch

from tests.helpers import TINY, read_metrics, series
from unirl_pl.card import Card
from unirl_pl.cli import main
from unirl_pl.losses import LossOutput
from unirl_pl.method import ExpertLoss
from unirl_pl.method.policy import PolicyLosses
from unirl_pl.method.update import PolicyUpdate
from unirl_pl.records import DiTRecord, Experience, LMRecord

# ------------------------------------------------------------------------ the anchor over PPO epochs


@dataclass
class _Recorder:
    """An algorithm whose "recompute" moves with every call (the weights stepped in between) and that records
    the anchor each call received."""

    calls: int = 0
    likelihood: bool = True

    def __post_init__(self) -> None:
        self.anchors: list[torch.Tensor | None] = []
        self.rows: list[int] = []

    def check_settings(self, settings) -> None:
        pass

    def loss(self, inputs, backward=None) -> LossOutput:
        self.calls += 1
        self.anchors.append(inputs.anchor)
        self.rows.append(int(inputs.record.old_logp.shape[0]))
        logp = torch.full_like(inputs.record.old_logp, float(self.calls))
        z = torch.zeros(())
        return LossOutput(z, z, z, z, z, z, z, z, logp=logp)


class _Expert:
    adapter_disabled = staticmethod(nullcontext)


def _policy(settings: ExpertLoss) -> tuple[PolicyLosses, _Recorder, Experience]:
    algorithm = _Recorder()
    card = Card.unified(has_llm=True, has_vae=False)
    policy = PolicyLosses(
        card, {"ar_decode": None}, {"llm": _Expert()}, lambda name: settings, {"ar_decode": algorithm}
    )
    record = LMRecord(
        input_ids=torch.zeros(4, 3, dtype=torch.long),
        attention_mask=torch.ones(4, 3, dtype=torch.long),
        prompt_len=1,
        gen_mask=torch.ones(4, 2, dtype=torch.bool),
        old_logp=torch.zeros(4, 2),
        rows=torch.arange(4),
        temperature=1.0,
        top_k=None,
        version=0,
    )
    exp = Experience(
        prompts=[""] * 4,
        refined=[""] * 4,
        text_index=torch.arange(4),
        rewards=torch.zeros(4),
        text_rewards=torch.zeros(4),
        records={"ar_decode": record},
        advantages={"ar_decode": torch.zeros(4)},
        zero_std_frac=0.0,
        row_requests={"ar_decode": torch.arange(4)},
    )
    return policy, algorithm, exp


def test_the_rollout_correction_anchor_stays_at_the_first_epochs_recompute_over_three_epochs():
    policy, algorithm, exp = _policy(ExpertLoss(rollout_correction="tis"))
    for _ in range(3):
        policy.loss("llm", exp, backward=lambda t: None)
    first, second, third = algorithm.anchors
    assert first is None, "the first epoch anchors at its own recompute"
    assert torch.equal(second, torch.full((4, 2), 1.0)) and torch.equal(third, torch.full((4, 2), 1.0)), (
        "every later epoch keeps the first epoch's recompute, not the previous epoch's"
    )
    off, algorithm, exp = _policy(ExpertLoss())
    for _ in range(2):
        off.loss("llm", exp, backward=lambda t: None)
    assert algorithm.anchors == [None, None], "without the correction the anchor is the behavior log-prob"


def test_mini_batches_are_anchored_at_the_recompute_before_any_update():
    policy, algorithm, exp = _policy(ExpertLoss(rollout_correction="tis", mini_batches=2))
    before = torch.arange(8.0).reshape(4, 2)
    policy.keep_anchors(exp, {"llm": (before, exp.records["ar_decode"].old_logp, exp.records["ar_decode"].gen_mask)})
    for rows in (torch.tensor([2, 0]), torch.tensor([1, 3]), torch.tensor([3, 2])):
        policy.loss("llm", exp, backward=lambda t: None, rows={"ar_decode": rows})
        assert torch.equal(algorithm.anchors[-1], before[rows]), "each mini-batch's rows of the pre-update recompute"
    assert algorithm.rows == [2, 2, 2], "each loss call sees its mini-batch only"


# ------------------------------------------------------------------------ in a run


class _GateInput(pl.Callback):
    """Records what the gates are handed: the rows of each expert's values and the rows of its record."""

    def __init__(self) -> None:
        self.seen: list[dict[str, tuple[int, int]]] = []

    def on_policy_logprobs(self, trainer, pl_module, exp, logprobs) -> None:
        self.seen.append({n: (v[0].shape[0], v[1].shape[0]) for n, v in logprobs.items()})


@pytest.mark.slow
def test_two_mini_batches_train_each_half_once_and_the_gate_sees_the_whole_rollout(tmp_path, monkeypatch):
    calls: list[tuple[str, int, int]] = []
    loss = PolicyLosses.loss

    def recording(self, name, exp, backward, rows=None):
        whole = sum(exp.records[loop].old_logp.shape[0] for loop in self.loops_with_records(name, exp))
        part = whole if rows is None else sum(len(r) for r in rows.values())
        calls.append((name, part, whole))
        return loss(self, name, exp, backward, rows)

    monkeypatch.setattr(PolicyLosses, "loss", recording)
    takes: list[int] = []
    take = DiTRecord.take
    monkeypatch.setattr(DiTRecord, "take", lambda self, index: takes.append(len(index)) or take(self, index))
    cli = main(
        [
            "--config", TINY,
            f"--trainer.logger.init_args.save_dir={tmp_path}",
            f"--trainer.default_root_dir={tmp_path}",
            "--trainer.enable_progress_bar=false",
            "--trainer.callbacks=[unirl_pl.callbacks.LogProbIdentityCheck, unirl_pl.callbacks.WeightVersionLedger]",
            "--trainer.limit_val_batches=0",
            "--trainer.max_steps=2",
            "--model.rollout.num_steps=4",
            "--model.generator_algorithm.init_args.sde_window=[0,2]",
            "--model.llm_loss.mini_batches=2",
            "--model.transformer_loss.mini_batches=2",
        ],
        run=False,
    )  # fmt: skip
    recorder = _GateInput()
    cli.trainer.callbacks.append(recorder)
    cli.trainer.fit(cli.model, cli.datamodule)
    for name in ("llm", "transformer"):
        mine = [(part, whole) for n, part, whole in calls if n == name]
        assert len(mine) == 4, f"{name}: 2 steps x 2 mini-batches"
        for (a, whole), (b, _) in zip(mine[0::2], mine[1::2], strict=True):
            assert 0 < a < whole and a + b == whole, f"{name}: the two mini-batches split the record"
    # The gate is handed every row of the rollout, recomputed before the first update.
    assert len(recorder.seen) == 2 and all(got == want for s in recorder.seen for got, want in s.values())
    rows = read_metrics(cli)
    assert series(rows, "transformer/updates") == [2.0, 2.0] and series(rows, "llm/updates") == [2.0, 2.0]
    assert series(rows, "version/transformer") == [2.0, 4.0]
    assert series(rows, "c2/transformer_max_abs_diff") == [0.0, 0.0], "the first update is on-policy, bit for bit"
    assert max(series(rows, "llm/ratio_max")) > 1.0 + 1e-4, "the second mini-batch is stale"
    assert len(takes) == 4, "each DiT mini-batch's rows are copied once (the loss weight and the loss share them)"


@pytest.mark.slow
def test_with_the_rollout_correction_two_mini_batches_anchor_at_the_recompute_before_any_update(tmp_path, monkeypatch):
    # Without the pre-update anchor the second mini-batch anchors at its own forward (after the first update):
    # the PPO ratio is 1 and the clip idle. No gate here: the rollout correction alone must run the recompute.
    seen: list[tuple[bool, dict, dict]] = []
    report = PolicyUpdate.report_before_updates

    def checked(self, exp, opts):
        policy = self.module.policy
        before = policy.recompute(exp, list(opts))  # the log-probs before any update (no grad, weights unstepped)
        ran = report(self, exp, opts)
        anchors = {
            n: [policy.anchor(loop, exp.records[loop]) for loop in policy.loops_with_records(n, exp)] for n in opts
        }
        seen.append((ran, before, anchors))
        return ran

    monkeypatch.setattr(PolicyUpdate, "report_before_updates", checked)
    cli = main(
        [
            "--config", TINY,
            f"--trainer.logger.init_args.save_dir={tmp_path}",
            f"--trainer.default_root_dir={tmp_path}",
            "--trainer.enable_progress_bar=false",
            "--trainer.callbacks=[]",
            "--trainer.limit_val_batches=0",
            "--trainer.max_steps=2",
            "--model.rollout.num_steps=4",
            "--model.generator_algorithm.init_args.sde_window=[0,2]",
            "--model.llm_loss.mini_batches=2",
            "--model.transformer_loss.mini_batches=2",
            "--model.llm_loss.rollout_correction=tis",
            "--model.transformer_loss.rollout_correction=tis",
        ],
        run=False,
    )  # fmt: skip
    cli.trainer.fit(cli.model, cli.datamodule)
    assert len(seen) == 2, "one report before the updates of each RL step"
    for step, (ran, before, anchors) in enumerate(seen):
        assert ran, f"step {step}: the recompute before any update ran"
        assert set(anchors) == set(before) == {"llm", "transformer"}
        for name, kept in anchors.items():
            assert len(kept) == 1, name
            assert kept[0] is not None, f"step {step}: {name} has no pre-update anchor"
            assert torch.equal(kept[0], before[name][0]), f"step {step}: {name}'s anchor is the first recompute"
    rows = read_metrics(cli)
    assert series(rows, "llm/updates") == [2.0, 2.0] and series(rows, "transformer/updates") == [2.0, 2.0]
    # What the anchor changes: the second update's ratio is against the pre-update policy (skip the anchor and
    # every logged ratio is exactly 1; the DiT's moves by about 3e-5 at this learning rate, the LM's by 0.1).
    assert max(series(rows, "llm/ratio_max")) > 1.0 + 1e-4, "the second mini-batch's ratio is against the anchor"
    assert max(series(rows, "transformer/ratio_max")) > 1.0 + 1e-6, (
        "the second mini-batch's ratio is against the anchor"
    )


@pytest.mark.slow
@pytest.mark.parametrize("drop", [True, False])
def test_a_group_of_equal_rewards_carries_no_gradient_and_no_kl_with_the_zero_advantage_drop(
    tmp_path, monkeypatch, drop
):
    # Flow-GRPO's mask: a group whose rewards are all equal has advantage 0; with the drop its samples are in
    # no mini-batch (no policy gradient, no KL term), without it they enter the loss for their KL alone.
    seen: list[tuple[int, int, float]] = []  # (rows in the loss, zero-advantage rows in it, the loss's KL)
    run = PolicyUpdate.run

    def equal_group(self, exp, opts):
        adv, requests = exp.advantages["diffusion_denoise"], exp.row_requests["diffusion_denoise"]
        adv[requests == requests.min()] = 0.0  # the first prompt's group: every reward equal
        return run(self, exp, opts)

    loss = PolicyLosses.loss

    def recording(self, name, exp, backward, rows=None):
        out = loss(self, name, exp, backward, rows)
        if name == "transformer":
            adv = exp.advantages["diffusion_denoise"]
            index = torch.arange(len(adv)) if rows is None else rows["diffusion_denoise"]
            seen.append((len(index), int((adv[index] == 0).sum()), float(out.kl)))
        return out

    monkeypatch.setattr(PolicyUpdate, "run", equal_group)
    monkeypatch.setattr(PolicyLosses, "loss", recording)
    cli = main(
        [
            "--config", TINY,
            f"--trainer.logger.init_args.save_dir={tmp_path}",
            f"--trainer.default_root_dir={tmp_path}",
            "--trainer.enable_progress_bar=false",
            "--trainer.callbacks=[unirl_pl.callbacks.LogProbIdentityCheck]",
            "--trainer.limit_val_batches=0",
            "--trainer.max_steps=2",
            "--model.rollout.num_steps=4",
            "--model.generator_algorithm.init_args.sde_window=[0,2]",
            f"--model.transformer_loss.drop_zero_advantage={str(drop).lower()}",
        ],
        run=False,
    )  # fmt: skip
    cli.trainer.fit(cli.model, cli.datamodule)
    assert len(seen) == 2
    rows = read_metrics(cli)
    if drop:
        assert all(zero == 0 and n <= 12 for n, zero, _ in seen), "the equal group's 4 samples are in no loss"
        assert all(0 < f <= 0.75 for f in series(rows, "transformer/trained_frac"))
    else:
        assert all(n == 16 and zero >= 4 for n, zero, _ in seen), "every sample enters the loss"
        assert "transformer/trained_frac" not in rows[0]
    assert seen[1][2] > 0, "the second step's KL is over the rows in the loss (the policy moved off the reference)"
    assert series(rows, "c2/transformer_max_abs_diff") == [0.0, 0.0], "the gate saw the whole rollout"
