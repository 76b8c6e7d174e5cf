"""The training rewards' logged statistics (``reward/*``) pooled over ranks as one process over all samples."""

from __future__ import annotations

import math
import os
import socket
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from unirl_pl.metrics import RewardStatistics, log_step, pool_moments, reward_moments
from unirl_pl.records import Experience

NAN = math.nan


def _experience(rewards: list[float], parts: dict[str, list[float]], unscored: bool = True) -> Experience:
    n = len(rewards)
    return Experience(
        prompts=["p"] * n,
        refined=["p"] * n,
        text_index=torch.arange(n),
        rewards=torch.tensor(rewards),
        text_rewards=torch.tensor(rewards),
        records={},
        advantages={},
        zero_std_frac=0.0,
        reward_parts={name: torch.tensor(values) for name, values in parts.items()},
        count_unscored=unscored,
    )


def _moments(values: torch.Tensor) -> tuple[float, float, float]:
    finite = values[values.isfinite()].double()
    if not len(finite):
        return (0, NAN, NAN)
    return (len(finite), float(finite.mean()), float(finite.std(unbiased=False)))


def test_pooled_moments_are_the_statistics_of_every_rank_s_samples():
    g = torch.Generator().manual_seed(0)
    shards = [torch.randn(5, generator=g) * 3 + 1, torch.randn(2, generator=g) - 4, torch.tensor([]), torch.randn(9)]
    moments = torch.tensor([[_moments(s)] for s in shards], dtype=torch.float64)  # (ranks, 1 key, 3)
    pooled = pool_moments(moments)
    everything = torch.cat(shards).double()
    assert pooled[0, 0].item() == pytest.approx(float(everything.mean()), abs=1e-12)
    assert pooled[0, 1].item() == pytest.approx(float(everything.std(unbiased=False)), abs=1e-12)
    # The mean of the ranks' stds (what averaging the logged row gave) is another number.
    rank_std_mean = float(torch.tensor([m[0][2] for m in moments.tolist() if m[0][0] > 0]).mean())
    assert abs(rank_std_mean - pooled[0, 1].item()) > 0.5


def test_one_rank_is_returned_bit_for_bit_and_a_statistic_nobody_saw_is_nan():
    rows = torch.tensor([[[3, 0.1 + 0.2, 0.7], [0, NAN, NAN]]], dtype=torch.float64)
    torch.testing.assert_close(pool_moments(rows), rows[0, :, 1:], rtol=0, atol=0, equal_nan=True)
    two = torch.cat([rows, rows])
    pooled = pool_moments(two)
    assert pooled[0].tolist() == pytest.approx([0.3, 0.7]) and math.isnan(pooled[1, 0]) and math.isnan(pooled[1, 1])


def test_reward_moments_keep_the_numbers_one_process_has_always_logged():
    exp = _experience([1.0, NAN, 3.0, 4.0], {"a": [1.0, NAN, 3.0, 4.0], "b": [0.5, 0.5, NAN, NAN]})
    rows = reward_moments(exp)
    finite = exp.rewards[exp.rewards.isfinite()]
    assert rows["reward/mean", "reward/std"] == (3, float(finite.mean()), float(finite.std(unbiased=False)))
    assert rows["reward/b", "reward/b_std"] == (2, 0.5, 0.0)
    assert rows["reward/b_unscored", None] == (4, 0.5, 0.0)
    assert ("reward/a_unscored", None) not in reward_moments(_experience([1.0], {"a": [1.0]}, unscored=False))
    metric = RewardStatistics()
    metric.update(exp)
    values = metric.compute()
    assert list(values) == [
        "reward/mean",
        "reward/std",
        "reward/a",
        "reward/a_std",
        "reward/a_unscored",
        "reward/b",
        "reward/b_std",
        "reward/b_unscored",
    ]
    assert values["reward/std"] == float(finite.std(unbiased=False)), "float32 std, as logged before"


def test_log_step_averages_the_row_but_keeps_pooled_keys():
    logged: list[dict[str, float]] = []
    other_rank = torch.tensor([10.0, 30.0])
    trainer = SimpleNamespace(
        world_size=2,
        strategy=SimpleNamespace(reduce=lambda v, reduce_op: (v + other_rank) / 2),
        loggers=[SimpleNamespace(log_metrics=lambda row, step: logged.append(row))],
    )
    log_step(trainer, {"llm/loss": 2.0, "reward/std": 4.0}, 0, torch.device("cpu"), pooled={"reward/std"})
    assert logged == [{"llm/loss": 6.0, "reward/std": 4.0}]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SHARDS = {
    0: ([1.0, 2.0, NAN, 8.0], {"t": [1.0, 2.0, NAN, 8.0]}),
    1: ([NAN, NAN], {"t": [NAN, NAN]}),  # a rank whose samples were all dropped
}


def _rank(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        metric = RewardStatistics()
        metric.update(_experience(*SHARDS[rank]))
        torch.save(metric.compute(), Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.integration
def test_two_ranks_log_the_statistics_of_one_process_over_both_shards(tmp_path):
    mp.spawn(_rank, args=(_free_port(), str(tmp_path)), nprocs=2)
    whole = _experience(SHARDS[0][0] + SHARDS[1][0], {"t": SHARDS[0][1]["t"] + SHARDS[1][1]["t"]})
    one = RewardStatistics()
    one.update(whole)
    expected = one.compute()
    for rank in (0, 1):
        got = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        assert got.keys() == expected.keys()
        for key, value in expected.items():
            assert got[key] == pytest.approx(value, abs=1e-6), key
    assert expected["reward/t_unscored"] == pytest.approx(3 / 6)
