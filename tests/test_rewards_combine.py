"""Combining reward terms: per-term group normalization before weighting and per-term raw statistics, both
against values computed by hand; and scoring remote terms while the rest of the batch decodes."""

from __future__ import annotations

import itertools
import math
import threading

import pytest
import torch

from tests.helpers import read_metrics, run_cli, series
from unirl_pl.rewards import HTTPReward, WeightedSum
from unirl_pl.rewards.builtin import group_normalize, term_stats, unique_prompt_groups
from unirl_pl.rewards.overlap import decode_while_scoring, remote_terms
from unirl_pl.rewards.vlm_judge import VLMJudge

HERE = "tests.test_rewards_combine"
PROMPTS = ["p", "p", "p", "q", "q"]
IMAGES = torch.zeros(5, 3, 4, 4)


def term_a(prompts, refined, images) -> list[float]:
    return [1.0, 2.0, 3.0, 10.0, 10.0]


def term_b(prompts, refined, images) -> list[float]:
    return [0.0, 0.0, 6.0, 1.0, 3.0]


def term_nan(prompts, refined, images) -> list[float]:
    return [1.0, math.nan, 3.0, 5.0, 7.0]


def never(prompts, refined, images) -> list[float]:
    raise AssertionError("a pending term must not be scored again")


def test_group_normalize_by_hand():
    values = torch.tensor([1.0, 2.0, 3.0, 10.0, 10.0])
    out = group_normalize(values, torch.tensor([0, 0, 0, 1, 1]), eps=1e-4)
    std = float(values.std(unbiased=False))  # the batch's population std scales every group
    expected = [-1 / (std + 1e-4), 0.0, 1 / (std + 1e-4), 0.0, 0.0]
    assert out.tolist() == pytest.approx(expected, abs=1e-6)
    # A given scale (the term's std over every rank) replaces the local one.
    assert group_normalize(values, torch.tensor([0, 0, 0, 1, 1]), scale=2.0, eps=0.0).tolist() == [-0.5, 0, 0.5, 0, 0]
    # Groups need not be contiguous, and a NaN is left out of the statistics: finite 1, 5, 3 have std sqrt(8/3).
    out = group_normalize(torch.tensor([1.0, 5.0, math.nan, 3.0]), torch.tensor([7, 2, 7, 7]), eps=0.0)
    s = math.sqrt(8 / 3)
    assert out[0].item() == pytest.approx(-1 / s) and out[3].item() == pytest.approx(1 / s)
    assert out[1].item() == 0.0 and math.isnan(out[2].item())


def test_a_nearly_solved_group_does_not_turn_its_one_miss_into_the_clip():
    """23 samples at 1.0 and one at 0.95 next to a group with a spread: the group's own std (0.01) would make
    the miss -4.9; the batch's keeps it a small negative."""
    values = torch.cat([torch.ones(24), torch.linspace(0, 1, 24)])
    values[5] = 0.95
    out = group_normalize(values, torch.arange(48) // 24)
    assert -0.5 < out[5].item() < 0 and out[:24].abs().max().item() < 0.5


def test_weighted_sum_normalizes_each_term_in_its_group_before_weighting():
    fn = WeightedSum({f"{HERE}.term_a": 2.0, f"{HERE}.term_b": 0.5}, normalize="group")
    total, parts = fn(PROMPTS, PROMPTS, IMAGES)
    a, b = torch.tensor(term_a(0, 0, 0)), torch.tensor(term_b(0, 0, 0))
    assert total.tolist() == pytest.approx((2 * a + 0.5 * b).tolist()), "the returned total stays raw"
    groups = torch.tensor([0, 0, 0, 1, 1])
    by_hand = []
    for i in range(5):
        g = groups == groups[i]
        za = (a[i] - a[g].mean()) / (a.std(unbiased=False) + 1e-4)
        zb = (b[i] - b[g].mean()) / (b.std(unbiased=False) + 1e-4)
        by_hand.append(float(2 * za + 0.5 * zb))
    assert parts.combined.tolist() == pytest.approx(by_hand, abs=1e-5)
    # Explicit groups (the trainer passes the prompt index) give the same as grouping by prompt text.
    _, explicit = fn(PROMPTS, PROMPTS, IMAGES, groups=torch.tensor([4, 4, 4, 9, 9]))
    assert torch.equal(explicit.combined, parts.combined)
    # Under several ranks the trainer passes the all-rank std: it is each term's scale.
    _, ranked = fn(PROMPTS, PROMPTS, IMAGES, batch_std=lambda v: torch.tensor(2.0))
    by_rank = [
        float(
            2 * (a[i] - a[groups == groups[i]].mean()) / 2.0001 + 0.5 * (b[i] - b[groups == groups[i]].mean()) / 2.0001
        )
        for i in range(5)
    ]
    assert ranked.combined.tolist() == pytest.approx(by_rank, abs=1e-5)
    plain = WeightedSum({f"{HERE}.term_a": 2.0, f"{HERE}.term_b": 0.5})
    total_plain, parts_plain = plain(PROMPTS, PROMPTS, IMAGES)
    assert torch.equal(parts_plain.combined, total_plain), "without normalization advantages see the raw sum"
    with pytest.raises(ValueError, match="normalization must be 'none' or 'group'"):
        WeightedSum({"brightness": 1.0}, normalize="batch")


def test_normalized_combination_keeps_a_dropped_sample_nan_and_out_of_the_group_stats():
    fn = WeightedSum({f"{HERE}.term_nan": 1.0}, nonfinite="drop", normalize="group")
    total, parts = fn(PROMPTS, PROMPTS, IMAGES)
    assert math.isnan(total[1]) and math.isnan(parts.combined[1])
    # Group p keeps 1 and 3 (mean 2), group q 5 and 7 (mean 6): deviations -1, +1, -1, +1 over the kept
    # values' std, sqrt(5) (1, 3, 5, 7).
    s = math.sqrt(5)
    assert parts.combined[[0, 2, 3, 4]].tolist() == pytest.approx([-1 / s, 1 / s, -1 / s, 1 / s], abs=1e-3)


def test_term_stats_are_raw_mean_and_std_over_finite_values():
    stats = term_stats({"a": torch.tensor([1.0, 2.0, 3.0, 10.0]), "n": torch.tensor([1.0, math.nan, 3.0])})
    assert stats["a"] == pytest.approx(4.0) and stats["a_std"] == pytest.approx(math.sqrt(12.5))
    assert stats["n"] == pytest.approx(2.0) and stats["n_std"] == pytest.approx(1.0)
    assert set(stats) == {"a", "a_std", "n", "n_std"}


def test_unique_prompt_groups():
    order, ids = unique_prompt_groups(["b", "a", "b"])
    assert order == ["b", "a"] and ids.tolist() == [0, 1, 0]


def test_pending_terms_are_taken_instead_of_scored():
    fn = WeightedSum({f"{HERE}.never": 3.0, f"{HERE}.term_a": 1.0})
    total, parts = fn(PROMPTS, PROMPTS, IMAGES, pending={f"{HERE}.never": lambda: torch.ones(5)})
    assert total.tolist() == pytest.approx([4.0, 5.0, 6.0, 13.0, 13.0])
    with pytest.raises(ValueError, match="returned 2 values for 5 samples"):
        fn(PROMPTS, PROMPTS, IMAGES, pending={f"{HERE}.never": lambda: torch.ones(2)})


# ------------------------------------------------------------------ overlap with decode
def test_remote_terms_and_their_decode_micro_batch():
    terms = {
        "http": HTTPReward("http://127.0.0.1:1/", batch_size=6),
        "judge": VLMJudge(url="http://127.0.0.1:1/v1", model="m", max_concurrency=4),
        "pairwise": VLMJudge(url="http://127.0.0.1:1/v1", model="m", template="pairwise"),
        "off": HTTPReward("http://127.0.0.1:1/", overlap=False),
        "local": term_a,
    }
    assert remote_terms(terms) == (["http", "judge"], 4)
    assert remote_terms({"local": term_a}) == ([], None)


def test_a_chunks_request_is_in_flight_while_the_next_chunk_decodes():
    decoded, second_decode_started = [], threading.Event()
    overlapped, calls = [], itertools.count()

    def decode(latents: torch.Tensor) -> torch.Tensor:
        decoded.append(latents.shape[0])
        if len(decoded) == 2:
            second_decode_started.set()
        return latents * 2

    def score(prompts, refined, images) -> torch.Tensor:
        # Only the first chunk's request asks (the counter is atomic; a later request may start while the
        # first still waits): is the second chunk decoding meanwhile?
        if next(calls) == 0:
            overlapped.append(second_decode_started.wait(timeout=5))
        return images.flatten(1).sum(1)

    latents = torch.arange(5.0).view(5, 1)
    images, pending = decode_while_scoring(decode, latents, 2, {"remote": score}, list("abcde"), list("abcde"))
    assert decoded == [2, 2, 1] and torch.equal(images, latents * 2)
    assert pending["remote"]().tolist() == [0.0, 2.0, 4.0, 6.0, 8.0], "values in sample order"
    assert overlapped == [True], "the first request waited for the second decode: they overlapped"


def test_an_error_in_an_overlapped_term_surfaces_when_collected():
    def broken(prompts, refined, images):
        raise RuntimeError("server said no")

    _, pending = decode_while_scoring(lambda x: x, torch.zeros(4, 1), 2, {"r": broken}, list("abcd"), list("abcd"))
    with pytest.raises(RuntimeError, match="server said no"):
        pending["r"]()


@pytest.mark.integration
def test_the_trainer_computes_advantages_from_the_normalized_terms_and_logs_them_raw(tmp_path, monkeypatch):
    import unirl_pl.method.experience as experience

    seen: list[torch.Tensor] = []
    original = experience.compute_advantages

    def spy(rewards, *args, **kwargs):
        seen.append(rewards.clone())
        return original(rewards, *args, **kwargs)

    monkeypatch.setattr(experience, "compute_advantages", spy)
    cli = run_cli(
        tmp_path,
        "--trainer.max_steps=1",
        "--trainer.limit_val_batches=0",
        "--model.rollout.num_steps=4",
        "--model.generator_algorithm.init_args.sde_window=[0,2]",
        "--model.rewards={brightness: 100.0, contains_word: 1.0}",
        "--model.reward_normalization=group",
    )
    (combined,) = seen
    # Each of the 4 prompts' 4 samples: two terms, each normalized to mean 0 within the group.
    assert combined.view(4, 4).sum(1).abs().max() < 1e-4, "group-normalized terms sum to 0 in each group"
    # Grouped by text sample (one image each here) every value would be 0: the group is the prompt's.
    assert combined.abs().max() > 0.1, combined
    assert combined.abs().max() < 2 * 101 / 1.0, "weights apply to unit-scale terms"
    rows = read_metrics(cli)
    assert 0.0 < series(rows, "reward/brightness")[0] < 1.0, "the term is logged raw"
    assert series(rows, "reward/brightness_std")[0] > 0
    raw_mean = 100 * series(rows, "reward/brightness")[0] + series(rows, "reward/contains_word")[0]
    assert series(rows, "reward/mean")[0] == pytest.approx(raw_mean, rel=1e-4), "reward/mean is the raw total"
