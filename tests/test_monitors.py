"""The reward-hacking signals of :mod:`unirl_pl.monitors` on hand-built inputs, and the monitor's own rules
(baseline, one alarm per excursion, the gold rule, refusals, state round trip) without a trainer."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from unirl_pl.callbacks import RewardHackingMonitor
from unirl_pl.callbacks.hacking import REFINEMENT_SIGNALS, Alarm, _mean_over_ranks
from unirl_pl.monitors import (
    baseline,
    blank_fraction,
    colourfulness,
    crossed,
    dark_fraction,
    distinct_n,
    gold_divergence,
    group_diversity,
    high_frequency_share,
    image_stats,
    mean_length,
    mean_luminance,
    novel_token_share,
    recurring_phrase,
    refinement_stats,
    saturated_fraction,
)


def smooth(n: int = 2, size: int = 16) -> torch.Tensor:
    """``n`` RGB images of a horizontal ramp from 0.3 to 0.7: no dark, no saturated pixel, low frequencies."""
    ramp = torch.linspace(0.3, 0.7, size).view(1, 1, 1, size).expand(n, 3, size, size)
    return ramp.clone()


def checker(size: int = 16) -> torch.Tensor:
    return ((torch.arange(size).view(-1, 1) + torch.arange(size).view(1, -1)) % 2).float()


# ---------------------------------------------------------------- images
def test_dark_fraction_counts_pixels_below_the_level():
    images = smooth()
    assert dark_fraction(images) == 0.0
    images[0, :, :4] = 0.0  # a quarter of one image's rows black: 1/8 of the batch's pixels
    assert dark_fraction(images) == pytest.approx(1 / 8)
    assert dark_fraction(images * 0.01) == 1.0


def test_mean_luminance_weights_the_channels_as_rec_601():
    images = torch.zeros(2, 3, 4, 4)
    assert mean_luminance(images) == 0.0
    images[0, 1] = 1.0  # one image's green channel full: 0.587 of that image, half of the batch
    assert mean_luminance(images) == pytest.approx(0.587 / 2)
    assert mean_luminance(torch.ones(2, 3, 4, 4)) == pytest.approx(1.0)
    assert mean_luminance(torch.full((2, 1, 4, 4), 0.25)) == pytest.approx(0.25)  # one channel: itself


def test_brightening_images_raise_the_luminance_alarm_and_no_other():
    """A generator washing its images out (a brightness-liking reward) moves the mean luminance past its
    threshold; on ShapesWorld's black backgrounds no other image statistic alarms (dark_frac falls, its
    direction is up)."""
    torch.manual_seed(0)
    scenes = torch.zeros(8, 3, 16, 16)
    scenes[:, 0, 4:10, 4:10] = 1.0  # a red square on black
    scenes += 0.02 * torch.rand_like(scenes)
    prompts = ["a red square"] * 4 + ["a red box"] * 4
    monitor = RewardHackingMonitor(baseline_steps=2, refinement_stats=False)
    raised = []
    for step, grey in enumerate([0.0, 0.0, 0.1, 0.2, 0.3]):
        exp = SimpleNamespace(images=(scenes + grey).clamp(0, 1), prompts=prompts)
        raised += monitor.observe(monitor.measure(exp), step)
    assert [(a.signal, a.step) for a in raised] == [("luminance", 3)]  # +0.1 is inside the default 0.15
    assert raised[0].value - raised[0].baseline > 0.15


def test_saturated_fraction_counts_values_at_either_end():
    images = smooth()
    assert saturated_fraction(images) == 0.0
    images[:, 0] = 1.0  # the red channel burnt out
    assert saturated_fraction(images) == pytest.approx(1 / 3)
    images[:, 2] = 0.0
    assert saturated_fraction(images) == pytest.approx(2 / 3)


def test_blank_fraction_counts_near_uniform_images():
    images = smooth(4)
    assert blank_fraction(images) == 0.0
    images[1] = 0.5
    images[2] = 0.5 + 0.001 * torch.randn(3, 16, 16, generator=torch.Generator().manual_seed(0))
    assert blank_fraction(images) == pytest.approx(0.5)


def test_high_frequency_share_rises_with_a_checkerboard_and_ignores_a_flat_batch():
    images = smooth()
    low = high_frequency_share(images)
    assert low < 0.1
    gridded = (images * 0.8 + 0.2 * checker()).clamp(0, 1)
    assert high_frequency_share(gridded) > 0.5
    assert high_frequency_share(0.5 * checker().expand(1, 3, 16, 16)) == pytest.approx(1.0)
    assert high_frequency_share(torch.full((2, 3, 8, 8), 0.4)) == 0.0
    # Only energy above the radius counts: a low cut-off takes in the ramp's own frequencies.
    assert high_frequency_share(images, radius=0.0) == pytest.approx(1.0)


def test_colourfulness_is_zero_for_grey_and_matches_the_formula():
    assert colourfulness(smooth()) == pytest.approx(0.0)
    red = torch.zeros(1, 3, 4, 4)
    red[:, 0] = 1.0  # rg = 255, yb = 127.5 everywhere: no spread, centre sqrt(255^2 + 127.5^2)
    assert colourfulness(red) == pytest.approx(0.3 * math.hypot(255.0, 127.5))
    half = torch.zeros(1, 3, 2, 2)
    half[0, 0, 0] = 1.0  # half the pixels red: rg std 127.5, yb std 63.75, means 127.5 and 63.75
    expected = math.hypot(127.5, 63.75) + 0.3 * math.hypot(127.5, 63.75)
    assert colourfulness(half) == pytest.approx(expected)


def test_group_diversity_is_the_mean_pairwise_rms_distance_within_groups():
    a, b = torch.zeros(3, 4, 4), torch.ones(3, 4, 4)
    images = torch.stack([a, b, a, a])
    # Group "x": a vs b, distance 1; group "y": two equal images, distance 0. Mean over groups: 0.5.
    assert group_diversity(images, ["x", "x", "y", "y"]) == pytest.approx(0.5)
    assert group_diversity(images, ["x", "x", "x", "x"]) == pytest.approx(0.5)  # 3 of its 6 pairs differ
    assert math.isnan(group_diversity(images, ["p", "q", "r", "s"]))
    with pytest.raises(ValueError, match="3 group labels for 4 images"):
        group_diversity(images, ["x", "x", "y"])


def test_image_stats_names_every_signal_and_takes_videos():
    stats = image_stats(smooth(4), groups=[0, 0, 1, 1])
    assert set(stats) == {
        "dark_frac", "luminance", "blank_frac", "saturated_frac", "high_freq", "colourfulness", "diversity"
    }  # fmt: skip
    assert stats["diversity"] == 0.0
    video = smooth(4).view(2, 2, 3, 16, 16)
    assert image_stats(video)["dark_frac"] == 0.0
    with pytest.raises(ValueError, match="images must be"):
        image_stats(torch.zeros(3, 16, 16))


# ---------------------------------------------------------------- refinements
def test_mean_length_and_distinct_n():
    assert mean_length(["a red circle", "one two three four five"]) == 4.0
    assert mean_length([]) == 0.0
    assert distinct_n(["a b c d"], 2) == 1.0
    assert distinct_n(["a b a b a b"], 2) == pytest.approx(2 / 5)
    assert distinct_n(["a b a b a b", "x y"], 2) == pytest.approx((2 / 5 + 1) / 2)
    assert distinct_n(["a"], 2) == 1.0


def test_novel_token_share_counts_words_not_in_the_own_prompt():
    prompts = ["a red circle", "a blue square"]
    assert novel_token_share(prompts, ["A red circle", "a blue square"]) == 0.0
    # 2 of 6 words new in the first, 0 of 3 in the second.
    assert novel_token_share(prompts, ["a red circle very shiny", "square blue a"]) == pytest.approx(2 / 8)
    with pytest.raises(ValueError, match="2 prompts for 1 refinements"):
        novel_token_share(prompts, ["x"])


def test_recurring_phrase_finds_a_phrase_added_to_unrelated_prompts():
    prompts = ["a red circle", "a blue square", "a green star", "two dots"]
    tail = ", trending on artstation"
    share, phrase = recurring_phrase(prompts, [prompts[0] + tail, prompts[1] + tail, prompts[2] + tail, "two dots"])
    assert (share, phrase) == (0.75, "trending on artstation")
    # The refinements of one prompt agreeing is no recurrence: two prompts, one of them adds the phrase.
    share, _ = recurring_phrase(["a", "a", "b"], ["a x y z", "a x y z", "b"])
    assert share == 0.5
    # A phrase already in the prompt is not added by the refiner.
    assert recurring_phrase(["x y z one", "x y z two"], ["x y z one", "x y z two"]) == (0.0, "")
    assert recurring_phrase(["a"], ["a x y z"]) == (0.0, "")


def test_refinement_stats_names_every_signal():
    stats = refinement_stats(["a b", "c d"], ["a b e f g", "c d e f g"])
    assert stats == {"length": 5.0, "distinct_2": 1.0, "novel_share": pytest.approx(0.6), "recurring_phrase": 1.0}


# ---------------------------------------------------------------- rules
def test_baseline_is_the_mean_of_finite_values():
    assert baseline([1.0, 3.0, math.nan]) == 2.0
    assert math.isnan(baseline([math.nan]))


@pytest.mark.parametrize(
    ("value", "base", "threshold", "direction", "relative", "fires"),
    [
        (0.35, 0.1, 0.2, "up", False, True),
        (0.25, 0.1, 0.2, "up", False, False),
        (0.0, 0.3, 0.2, "up", False, False),  # the other way: not this signal's hack
        (0.0, 0.3, 0.2, "down", False, True),
        (1.6, 1.0, 0.5, "up", True, True),
        (1.4, 1.0, 0.5, "up", True, False),
        (0.4, 1.0, 0.5, "down", True, True),
        (0.6, 1.0, 0.5, "down", True, False),
        (0.01, 0.0, 0.5, "up", True, True),  # a zero baseline: any move up
        (math.nan, 0.1, 0.2, "up", False, False),
        (0.9, math.nan, 0.2, "up", False, False),
    ],
)
def test_crossed(value, base, threshold, direction, relative, fires):
    assert crossed(value, base, threshold, direction, relative) is fires


def test_gold_divergence_needs_the_train_reward_up_and_gold_down_by_more_than_the_drop():
    assert gold_divergence([0.1, 0.2, 0.3], [0.9, 0.8, 0.7], window=2, gold_drop=0.1)
    assert not gold_divergence([0.1, 0.2, 0.3], [0.9, 0.85, 0.85], window=2, gold_drop=0.1)  # gold fell 0.05
    assert not gold_divergence([0.3, 0.2, 0.1], [0.9, 0.8, 0.7], window=2, gold_drop=0.1)  # both fell: no hack
    assert not gold_divergence([0.1, 0.3], [0.9, 0.7], window=2, gold_drop=0.1)  # not a full window yet
    # Only the last window + 1 values count: an early fall has left it.
    assert not gold_divergence([0.0, 0.1, 0.2, 0.3], [2.0, 0.8, 0.8, 0.8], window=2, gold_drop=0.1)
    assert not gold_divergence([0.1, math.nan, 0.3], [0.9, 0.8, 0.7], window=2, gold_drop=0.1)
    with pytest.raises(ValueError, match="3 training rewards for 2 gold rewards"):
        gold_divergence([0.1, 0.2, 0.3], [0.9, 0.8], window=1, gold_drop=0.1)


# ---------------------------------------------------------------- the monitor's bookkeeping
def test_monitor_alarms_after_its_baseline_once_per_excursion():
    monitor = RewardHackingMonitor(baseline_steps=2, thresholds={"dark_frac": 0.2})
    assert monitor.observe({"dark_frac": 0.9}, 0) == []  # baseline steps never alarm
    assert monitor.observe({"dark_frac": 0.1}, 1) == []
    assert monitor.baselines == {"dark_frac": 0.5}
    assert monitor.observe({"dark_frac": 0.65}, 2) == []
    assert monitor.observe({"dark_frac": 0.75}, 3) == [Alarm("dark_frac", 3, 0.75, 0.5)]
    assert monitor.observe({"dark_frac": 0.8}, 4) == []  # still over: the same excursion
    assert monitor.observe({"dark_frac": 0.5}, 5) == []
    assert [a.step for a in monitor.observe({"dark_frac": 0.9}, 6)] == [6]
    assert [a.step for a in monitor.alarms] == [3, 6]


def test_monitor_gold_rule_and_state_round_trip():
    monitor = RewardHackingMonitor(window=2, gold_drop=0.05, baseline_steps=1)
    assert monitor.check_gold(0.1, {"judge": 0.9}, 1) == []
    assert monitor.check_gold(0.2, {"judge": 0.8}, 2) == []
    assert monitor.check_gold(0.3, {"judge": 0.7}, 3) == [Alarm("gold/judge", 3, 0.7, 0.9)]
    monitor.observe({"length": 4.0}, 0)
    other = RewardHackingMonitor()
    other.load_state_dict(monitor.state_dict())
    assert other.alarms == monitor.alarms and other.baselines == {"length": 4.0}
    assert other.validations == monitor.validations and other.active == ["gold/judge"]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"baseline_steps": 0}, "baseline_steps must be >= 1"),
        ({"window": 0}, "window must be >= 1"),
        ({"gold_drop": -1.0}, "gold_drop must be >= 0"),
        ({"action": "explode"}, "action must be 'warn', 'stop' or 'rollback'"),
        ({"thresholds": {"darkness": 0.1}}, r"unknown signals \['darkness'\]"),
        ({"thresholds": {"dark_frac": -0.1}}, "thresholds must be numbers >= 0"),
    ],
)
def test_monitor_refuses_bad_settings_in_one_line(kwargs, message):
    with pytest.raises(ValueError, match=message) as err:
        RewardHackingMonitor(**kwargs)
    assert "\n" not in str(err.value)


class _TwoRanks:
    """A trainer of two ranks whose other rank holds ``other``: ``strategy.reduce`` sums the two, as a gloo or
    NCCL all-reduce would, in the layout ``_mean_over_ranks`` sends (values with NaN as 0, then the finite mask)."""

    world_size = 2

    def __init__(self, other: dict[str, float]) -> None:
        values = torch.tensor(list(other.values()), dtype=torch.float64)
        finite = torch.isfinite(values)
        self.other = torch.stack([torch.where(finite, values, torch.zeros_like(values)), finite.double()])
        self.strategy = self

    def reduce(self, tensor: torch.Tensor, reduce_op: str) -> torch.Tensor:
        assert reduce_op == "sum"
        return tensor + self.other


def test_ranks_average_what_each_measured_and_a_signal_no_rank_measured_stays_nan() -> None:
    module = SimpleNamespace(device=torch.device("cpu"))
    mine = {"dark_frac": 0.3, "length": 12.0, "novel_share": math.nan}
    other = {"dark_frac": 0.1, "length": math.nan, "novel_share": math.nan}
    mean = _mean_over_ranks(_TwoRanks(other), module, mine)
    assert mean["dark_frac"] == pytest.approx(0.2)
    assert mean["length"] == 12.0, "a rank with nothing refined does not pull the mean to NaN or to 0"
    assert math.isnan(mean["novel_share"])


def test_a_rollout_with_nothing_refined_reports_every_refinement_signal_as_nan() -> None:
    """So every rank reduces the same keys, whether or not its samples were refined."""
    prompts = ["a red cube", "two blue balls"]
    exp = SimpleNamespace(images=None, prompts=prompts, refined=list(prompts), text_index=torch.tensor([0, 1]))
    values = RewardHackingMonitor(image_stats=False).measure(exp)
    assert set(values) == set(REFINEMENT_SIGNALS) and all(math.isnan(v) for v in values.values())
    exp.refined = ["a red cube, masterpiece", "two blue balls, masterpiece"]
    values = RewardHackingMonitor(image_stats=False).measure(exp)
    assert set(values) == set(REFINEMENT_SIGNALS) and all(math.isfinite(v) for v in values.values())
