"""Several optimizer steps per rollout: the split into mini-batches, the records' rows, the metrics over the
updates, and each algorithm's clip acting on a stale mini-batch (inert on the on-policy first one)."""

from __future__ import annotations

import pytest
import torch

from unirl_pl.errors import ConfigError
from unirl_pl.losses import LossOutput, flow_grpo_loss, grpo_guard_loss, token_policy_loss
from unirl_pl.method import ExpertLoss
from unirl_pl.method.minibatch import keep_for_steps, minibatch_of, minibatch_rows
from unirl_pl.method.update import check_mini_batches
from unirl_pl.metrics import update_metrics
from unirl_pl.records import DiTRecord, FlowPointsRecord, rechunk

# ------------------------------------------------------------------------------------------ the split


def test_one_mini_batch_is_the_whole_record_and_bad_counts_are_refused():
    assert minibatch_of(torch.tensor([5, 5, 9]), 1, seed=0, epoch=0).tolist() == [0, 0, 0]
    with pytest.raises(ValueError, match="mini_batches"):
        minibatch_of(torch.tensor([1]), 0, seed=0, epoch=0)
    with pytest.raises(ValueError, match="mini_batches"):
        ExpertLoss(mini_batches=0)


def test_groups_stay_whole_and_every_block_gives_one_group_to_each_mini_batch():
    groups = torch.arange(16, 32)  # one step's request ids (16 groups)
    rows = groups.repeat_interleave(3)  # 3 samples per group
    assigned = minibatch_of(rows, 4, seed=5, epoch=0)
    for g in groups.tolist():
        assert assigned[rows == g].unique().numel() == 1, "a group's rows share a mini-batch"
    per_group = assigned.reshape(16, 3)[:, 0]
    for block in per_group.reshape(4, 4):  # ids 16-19, 20-23, ...: each block is a permutation of 0..3
        assert sorted(block.tolist()) == [0, 1, 2, 3]
    parts = minibatch_rows(rows, 4, seed=5, epoch=0)
    assert torch.equal(torch.cat(parts).sort().values, torch.arange(len(rows)))
    assert [len(p) for p in parts] == [12] * 4


def test_the_split_is_the_same_on_any_number_of_ranks():
    ids = torch.arange(40, 48)  # step 5 of 8 prompts per step
    single = minibatch_of(ids, 2, seed=3, epoch=1)
    # Two ranks hold contiguous halves of the step (data._PromptStream); each splits its own share.
    halves = torch.cat([minibatch_of(ids[:4], 2, seed=3, epoch=1), minibatch_of(ids[4:], 2, seed=3, epoch=1)])
    assert torch.equal(single, halves)
    for half in (ids[:4], ids[4:]):  # and each rank holds as many groups in each mini-batch
        assert torch.bincount(minibatch_of(half, 2, seed=3, epoch=1), minlength=2).tolist() == [2, 2]


def test_the_split_is_seeded_and_changes_with_the_epoch_and_the_seed():
    ids = torch.arange(64)
    a = minibatch_of(ids, 2, seed=0, epoch=0)
    assert torch.equal(a, minibatch_of(ids, 2, seed=0, epoch=0)), "reproducible (resume replays it)"
    assert not torch.equal(a, minibatch_of(ids, 2, seed=0, epoch=1)), "another PPO epoch meets other groups"
    assert not torch.equal(a, minibatch_of(ids, 2, seed=1, epoch=0))
    assert not torch.equal(a, ids % 2), "shuffled, not dealt in order"


def test_the_sample_split_spreads_a_group_over_the_updates_in_parts_of_equal_size():
    rows = torch.arange(16, 24).repeat_interleave(4)  # 8 groups of 4 samples (the main recipe's step 2)
    assigned = minibatch_of(rows, 4, seed=5, epoch=0, split="sample")
    spread = [assigned[rows == g].unique().numel() for g in range(16, 24)]
    assert max(spread) > 1, "a group's samples go to several updates (Flow-GRPO's permutation)"
    assert torch.bincount(assigned, minlength=4).tolist() == [8] * 4
    parts = minibatch_rows(rows, 4, seed=5, epoch=0, split="sample")
    assert torch.equal(torch.cat(parts).sort().values, torch.arange(len(rows)))
    assert not torch.equal(assigned, minibatch_of(rows, 4, seed=5, epoch=1, split="sample")), "reshuffled per epoch"
    assert not torch.equal(assigned, minibatch_of(rows, 4, seed=6, epoch=0, split="sample"))
    assert not torch.equal(assigned, minibatch_of(rows, 4, seed=5, epoch=0)), "not the group split"
    uneven = minibatch_of(torch.arange(3).repeat_interleave(3), 4, seed=0, epoch=0, split="sample")
    assert sorted(torch.bincount(uneven, minlength=4).tolist()) == [2, 2, 2, 3], "parts differ by one row at most"
    with pytest.raises(ValueError, match="mini_batch_split"):
        minibatch_of(rows, 2, seed=0, epoch=0, split="token")


def test_the_sample_split_is_the_same_on_any_number_of_ranks():
    ids = torch.arange(40, 48).repeat_interleave(3)  # 8 prompts of 3 samples; 2 ranks hold 4 prompts each
    single = minibatch_of(ids, 2, seed=3, epoch=1, split="sample")
    halves = torch.cat(
        [
            minibatch_of(ids[:12], 2, seed=3, epoch=1, split="sample"),
            minibatch_of(ids[12:], 2, seed=3, epoch=1, split="sample"),
        ]
    )
    assert torch.equal(single, halves)


def test_zero_advantage_rows_are_dropped_and_readmitted_to_a_multiple_of_the_mini_batches():
    keep = torch.tensor([True] * 5 + [False] * 11)
    kept = keep_for_steps(keep, 2, seed=0)
    assert int(kept.sum()) == 6 and bool(kept[:5].all()), "every non-zero row stays; one zero row comes back"
    assert int(keep_for_steps(keep, 1, seed=0).sum()) == 5, "one update: nothing comes back"
    assert int(keep_for_steps(torch.zeros(16, dtype=torch.bool), 4, seed=0).sum()) == 4, "no signal: m rows step"
    assert int(keep_for_steps(torch.zeros(3, dtype=torch.bool), 4, seed=0).sum()) == 3
    parts = minibatch_rows(torch.arange(4).repeat_interleave(4), 2, seed=0, epoch=0, split="sample", keep=keep)
    assert sum(len(p) for p in parts) == 6 and [len(p) for p in parts] == [3, 3]
    assert set(range(5)) <= set(torch.cat(parts).tolist())


def test_drop_with_a_group_split_and_too_many_mini_batches_are_refused():
    with pytest.raises(ValueError, match="mini_batch_split: sample"):
        ExpertLoss(mini_batches=2, drop_zero_advantage=True)
    ExpertLoss(mini_batches=1, drop_zero_advantage=True)  # one update: the split does not matter
    with pytest.raises(ValueError, match="mini_batch_split"):
        ExpertLoss(mini_batch_split="token")
    check_mini_batches("llm", ExpertLoss(mini_batches=8), groups=8, samples=24)
    with pytest.raises(ConfigError, match=r"model.llm_loss.mini_batches=9 is more than the 8 prompt groups"):
        check_mini_batches("llm", ExpertLoss(mini_batches=9), groups=8, samples=24)
    settings = ExpertLoss(mini_batches=33, mini_batch_split="sample")
    with pytest.raises(ConfigError, match=r"transformer_loss.mini_batches=33 is more than the 32 samples"):
        check_mini_batches("transformer", settings, groups=8, samples=32)
    check_mini_batches("transformer", ExpertLoss(mini_batches=16, mini_batch_split="sample"), groups=8, samples=32)


# ------------------------------------------------------------------------------------------ the records


def _dit_record(per_sample: bool) -> DiTRecord:
    gen = torch.Generator().manual_seed(0)
    n, s = 6, 2
    sig = torch.rand(n, s, generator=gen, dtype=torch.float64) if per_sample else torch.tensor([0.9, 0.6]).double()
    return DiTRecord(
        prev=torch.randn(n, s, 3, 4, 4, generator=gen),
        sample=torch.randn(n, s, 3, 4, 4, generator=gen),
        sigma=sig,
        sigma_next=sig * 0.5,
        old_logp=torch.randn(n, s, generator=gen),
        cond={"hidden": torch.randn(n, 5, 8, generator=gen)},
        sigma_max=torch.rand(n, generator=gen) if per_sample else 0.95,
        noise_level=0.7,
        chunks=[(0, 4), (4, 6)],
        version=3,
        starts=torch.arange(n) if per_sample else None,
    )


@pytest.mark.parametrize("per_sample", [False, True])
def test_dit_record_take_selects_every_per_sample_tensor_and_rechunks(per_sample):
    record = _dit_record(per_sample)
    index = torch.tensor([5, 1, 2])
    part = record.take(index)
    for key in ("prev", "sample", "old_logp"):
        assert torch.equal(getattr(part, key), getattr(record, key)[index]), key
    assert torch.equal(part.cond["hidden"], record.cond["hidden"][index])
    if per_sample:
        assert torch.equal(part.sigma, record.sigma[index]) and torch.equal(part.sigma_max, record.sigma_max[index])
        assert torch.equal(part.starts, record.starts[index])
    else:
        assert torch.equal(part.sigma, record.sigma) and part.sigma_max == record.sigma_max
    assert part.chunks == [(0, 3)] and part.version == 3
    assert rechunk([(0, 4), (4, 6)], 9) == [(0, 4), (4, 8), (8, 9)], "the rollout's micro-batch size"


def test_flow_points_record_take_selects_every_per_sample_tensor():
    gen = torch.Generator().manual_seed(1)
    record = FlowPointsRecord(
        x0=torch.randn(4, 3, 2, 2, generator=gen),
        xt=torch.randn(4, 2, 3, 2, 2, generator=gen),
        t=torch.rand(4, 2, generator=gen),
        old_v=torch.randn(4, 2, 3, 2, 2, generator=gen),
        cond={"hidden": torch.randn(4, 5, generator=gen)},
        chunks=[(0, 2), (2, 4)],
        version=1,
    )
    index = torch.tensor([3, 0])
    part = record.take(index)
    for key in ("x0", "xt", "t", "old_v"):
        assert torch.equal(getattr(part, key), getattr(record, key)[index]), key
    assert torch.equal(part.cond["hidden"], record.cond["hidden"][index]) and part.chunks == [(0, 2)]


# ------------------------------------------------------------------------------------------ the metrics


def _out(ratio_min: float, ratio_max: float, clip: float, loss: float) -> LossOutput:
    t = torch.tensor
    return LossOutput(t(loss), t(loss), t(0.0), t(1.0), t(ratio_min), t(ratio_max), t(clip), t(0.0))


def test_update_metrics_average_the_updates_and_span_the_ratio():
    one = update_metrics("transformer", [(_out(1.0, 1.0, 0.0, 0.5), torch.tensor(2.0))])
    assert "transformer/updates" not in one and float(one["transformer/loss"]) == 0.5, "one update: as before"
    both = update_metrics(
        "transformer", [(_out(1.0, 1.0, 0.0, 0.5), torch.tensor(2.0)), (_out(0.9, 1.3, 0.5, 1.5), torch.tensor(4.0))]
    )
    assert float(both["transformer/updates"]) == 2 and float(both["transformer/loss"]) == 1.0
    assert float(both["transformer/clip_frac"]) == 0.25 and float(both["transformer/grad_norm"]) == 3.0
    assert float(both["transformer/ratio_min"]) == pytest.approx(0.9)
    assert float(both["transformer/ratio_max"]) == pytest.approx(1.3)


# ------------------------------------------------------------------------------------------ the clips

STALE = 0.3  # log-ratio spread of a stale mini-batch: the policy moved since the rollout


def _grad(loss_fn, logp: torch.Tensor) -> torch.Tensor:
    x = logp.clone().requires_grad_(True)
    loss_fn(x).loss.backward()
    return x.grad


def _flow(clip: float):
    return lambda lp, old, adv: flow_grpo_loss(lp, old, adv, clip_eps=clip)


def _guard(clip: float):
    def fn(lp, old, adv):
        n = lp.shape[0]
        mean = torch.zeros(n, 3) + lp[:, None] * 0  # the step means (the ratio's drift term uses them)
        return grpo_guard_loss(
            lp, old, adv, mean, torch.zeros(n, 3), torch.full((n,), 0.3), torch.full((n,), -0.1), clip_eps=clip
        )

    return fn


def _dapo(clip_high: float):
    def fn(lp, old, adv):
        mask = torch.ones(lp.shape[0], 1, dtype=torch.bool)
        return token_policy_loss(lp[:, None], old[:, None], adv, mask, eps_low=0.2, eps_high=clip_high)

    return fn


def _gspo(clip: tuple[float, float]):
    def fn(lp, old, adv):
        mask = torch.ones(lp.shape[0], 1, dtype=torch.bool)
        return token_policy_loss(
            lp[:, None], old[:, None], adv, mask, eps_low=clip[0], eps_high=clip[1], aggregation="sequence_ratio"
        )

    return fn


# (name, the loss with the published clip, the loss with an inert clip). CPS trains with Flow-GRPO's loss on
# its own log-prob, so its clip is Flow-GRPO's; Guard's acts on its normalized ratio.
CLIPS = [
    ("flow_grpo", _flow(1e-4), _flow(1e9)),
    ("cps", _flow(1e-5), _flow(1e9)),
    ("grpo_guard", _guard(1e-4), _guard(1e9)),
    ("dapo", _dapo(0.28), _dapo(1e9)),
    ("gspo", _gspo((3e-4, 4e-4)), _gspo((1e9, 1e9))),
]


@pytest.mark.parametrize("name, clipped, inert", CLIPS, ids=[c[0] for c in CLIPS])
def test_each_algorithms_clip_changes_a_stale_gradient_and_not_an_on_policy_one(name, clipped, inert):
    gen = torch.Generator().manual_seed(0)
    old = torch.randn(8, generator=gen)
    adv = torch.randn(8, generator=gen)
    # On-policy (the first update: recompute == behavior): the clip changes nothing.
    assert torch.allclose(_grad(lambda x: clipped(x, old, adv), old), _grad(lambda x: inert(x, old, adv), old))
    # Stale (a later mini-batch): the clip drops the terms that moved too far in their advantage's direction.
    stale = old + STALE * torch.randn(8, generator=gen)
    g_clip, g_free = _grad(lambda x: clipped(x, old, adv), stale), _grad(lambda x: inert(x, old, adv), stale)
    assert not torch.allclose(g_clip, g_free), f"{name}: the clip is inert on a stale mini-batch"
    assert float(clipped(stale, old, adv).clip_frac) > 0
