"""Validation's scores as torchmetrics metrics: the keys a reward declares, pooled means, their sync over ranks."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from unirl_pl.evaluation import PooledMean, ValidationMetrics, validation_keys, validation_scores
from unirl_pl.rewards import WeightedSum
from unirl_pl.rewards.shapes import BREAKDOWN_KEYS, ShapesGenEval
from unirl_pl.shapes.scenes import CATEGORIES


def test_keys_are_the_means_and_every_declared_category():
    keys = validation_keys(WeightedSum({"shapes_geneval": 1.0, "brightness": 0.5}))
    assert keys[:3] == ["reward_mean", "reward_shapes_geneval", "reward_brightness"]
    assert keys[3:] == [f"shapes_geneval/{key}" for key in BREAKDOWN_KEYS]
    assert {key.split("/")[1] for key in BREAKDOWN_KEYS} == {*CATEGORIES, "overall"}


class _Undeclared:
    """A reward with a breakdown whose keys nobody can know before it runs."""

    def __call__(self, prompts: list[str], refined: list[str], images: torch.Tensor) -> list[float]:
        return [0.0] * len(prompts)

    def breakdown(self, prompts: list[str], images: torch.Tensor) -> dict[str, tuple[float, int]]:
        return {"strict/overall": (0.0, len(prompts))}


def test_a_breakdown_without_declared_keys_is_refused():
    reward = WeightedSum({"brightness": 1.0})
    reward.terms["mine"] = _Undeclared()
    with pytest.raises(ValueError, match="'mine' has a breakdown\\(\\) but no breakdown_keys"):
        validation_keys(reward)


def test_scores_of_a_batch_are_its_means_and_breakdown():
    reward = WeightedSum({"shapes_geneval": 1.0})
    prompts = ["a red circle", "two blue squares", "a green triangle"]
    images = torch.rand(3, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    scores, total = validation_scores(reward, prompts, prompts, images)
    assert set(scores) <= set(validation_keys(reward))
    assert scores["reward_mean"][1] == 3 and torch.equal(scores["reward_mean"][0], total.nanmean())
    breakdown = ShapesGenEval().breakdown(prompts, images)
    assert {key: scores[f"shapes_geneval/{key}"] for key in breakdown} == breakdown
    scores, total = validation_scores(reward, [], [], images[:0])  # a batch that is all shard padding
    assert scores == {} and total.numel() == 0


def test_pooled_mean_is_lightnings_weighted_mean_bit_for_bit():
    """One process logs what ``self.log(key, mean, batch_size=count)`` logged: float32 ``sum(mean * count)``
    over the int64 sum of counts."""
    # A Python float (a breakdown's) is rounded to float32 first; a count of 0 adds nothing, not even a NaN.
    batches = [(torch.tensor(0.3), 3), (0.1 / 3, 7), (torch.tensor(float("nan")), 0), (2 / 3, 1)]
    metric = PooledMean()
    value, count = torch.tensor(0.0), torch.tensor(0)
    for mean, n in batches:
        metric.update(mean, n)
        if n:
            value, count = value + torch.as_tensor(mean, dtype=torch.float32) * n, count + n
    assert torch.equal(metric.compute(), value / count)


def test_metrics_pool_over_batches_leave_unseen_keys_out_and_reset():
    metrics = ValidationMetrics(["reward_mean", "t/strict/a", "t/strict/b"])
    metrics.update({"reward_mean": (torch.tensor(1.0), 2), "t/strict/a": (0.5, 2)})
    metrics.update({"reward_mean": (torch.tensor(0.0), 1), "t/strict/a": (1.0, 1)})
    computed = {key: metric.compute() for key, metric in metrics.items()}
    assert computed["reward_mean"].item() == pytest.approx(2 / 3)
    assert computed["t/strict/a"].item() == pytest.approx(2 / 3)
    assert computed["t/strict/b"] is None, "a key no sample had is not logged"
    with pytest.raises(ValueError, match="did not declare: \\['t/soft/a'\\]"):
        metrics.update({"t/soft/a": (1.0, 1)})
    for _, metric in metrics.items():
        metric.reset()
    with pytest.warns(UserWarning, match="called before the ``update`` method"):
        assert all(metric.compute() is None for _, metric in metrics.items())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        metrics = ValidationMetrics(["reward_mean", "t/strict/a", "t/strict/b", "t/strict/c"])
        # Uneven shards: rank 0 saw 3 samples of a, rank 1 one of b and an all-padding batch; c nobody saw.
        if rank == 0:
            metrics.update({"reward_mean": (torch.tensor(0.5), 3), "t/strict/a": (1 / 3, 3)})
        else:
            metrics.update({"reward_mean": (torch.tensor(1.0), 1), "t/strict/b": (1.0, 1)})
            metrics.update({})
        first = {key: metric.compute() for key, metric in metrics.items()}
        # Read again on one rank only, as a rank-zero callback reads callback_metrics: no collective may run.
        again = {key: metric.compute() for key, metric in metrics.items()} if rank == 0 else first
        dist.barrier()
        torch.save({"first": first, "again": again}, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.integration
def test_two_ranks_pool_every_key_as_one_process(tmp_path):
    mp.spawn(_rank, args=(_free_port(), str(tmp_path)), nprocs=2)
    for rank in (0, 1):
        result = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        for values in (result["first"], result["again"]):
            assert values["reward_mean"].item() == pytest.approx((0.5 * 3 + 1.0) / 4)
            assert values["t/strict/a"].item() == pytest.approx(1 / 3)
            assert values["t/strict/b"].item() == 1.0
            assert values["t/strict/c"] is None


@pytest.mark.parametrize("loader", ["val_dataloader", "predict_dataloader"])
def test_lightning_leaves_each_ranks_evaluation_shard_whole(monkeypatch, loader):
    """The data module shards held-out prompts by rank itself; Lightning adds its own distributed sampler to a
    loader unless the loader's sampler is one, which would split each rank's shard again (half its batches)."""
    from types import SimpleNamespace

    from lightning.pytorch.trainer.connectors.data_connector import _DataConnector
    from torch.utils.data import DistributedSampler

    from unirl_pl.data import PromptDataModule

    prompts = [f"a red circle number {i}" for i in range(7)]
    dm = PromptDataModule(val_prompts=prompts, predict_prompts=prompts, val_batch_size=2)
    monkeypatch.setattr(PromptDataModule, "_world", lambda self: (1, 2))  # rank 1 of 2: prompts 1, 3, 5 + padding
    data = getattr(dm, loader)()
    connector = SimpleNamespace(use_distributed_sampler=True, is_distributed=True)
    trainer = SimpleNamespace(_accelerator_connector=connector)
    assert not _DataConnector._requires_distributed_sampler(SimpleNamespace(trainer=trainer), data)
    assert isinstance(data.sampler, DistributedSampler)
    batches = list(data)
    assert [p for b in batches for p in b.prompts[: b.real]] == [prompts[1], prompts[3], prompts[5]]
    assert [len(b.prompts) for b in batches] == [2, 2], "both batches, the second padded"
