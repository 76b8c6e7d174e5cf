"""Reward-hacking signals as pure functions: image statistics, refinement statistics and the alarm rules.

One file per signal family; nothing here imports the callbacks or the module, so the math is tested on
hand-built inputs and the :class:`~unirl_pl.callbacks.RewardHackingMonitor` only orchestrates it.
"""

from unirl_pl.monitors.alarms import Direction, baseline, crossed, gold_divergence
from unirl_pl.monitors.images import (
    blank_fraction,
    colourfulness,
    dark_fraction,
    group_diversity,
    high_frequency_share,
    image_stats,
    mean_luminance,
    saturated_fraction,
)
from unirl_pl.monitors.text import (
    distinct_n,
    mean_length,
    novel_token_share,
    recurring_phrase,
    refinement_stats,
)

__all__ = [
    "Direction",
    "baseline",
    "blank_fraction",
    "colourfulness",
    "crossed",
    "dark_fraction",
    "distinct_n",
    "gold_divergence",
    "group_diversity",
    "high_frequency_share",
    "image_stats",
    "mean_length",
    "mean_luminance",
    "novel_token_share",
    "recurring_phrase",
    "refinement_stats",
    "saturated_fraction",
]
