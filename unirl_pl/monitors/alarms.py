"""The alarm rules: a signal against its own baseline, and the training reward against a gold reward.

Pure functions of the values the callback has collected; the callback decides what an alarm does.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

Direction = Literal["up", "down"]
"""Which way a signal moves when the run hacks its reward: ``up`` (dark pixels, repetition of a phrase) or
``down`` (diversity within a group, distinct n-grams)."""


def baseline(values: Sequence[float]) -> float:
    """A signal's baseline: the mean of its finite values over the baseline steps (NaN when there are none)."""
    finite = [v for v in values if math.isfinite(v)]
    return sum(finite) / len(finite) if finite else math.nan


def crossed(value: float, base: float, threshold: float, direction: Direction, relative: bool) -> bool:
    """Whether ``value`` has moved past its baseline ``base`` by more than ``threshold`` in ``direction``.

    Absolute: ``value - base > threshold`` (``up``) or ``base - value > threshold`` (``down``). Relative: the
    same change measured in units of ``|base|``, so ``threshold = 0.5`` fires at a 50 % move; a zero baseline
    then fires on any move in ``direction``. A NaN value or baseline never fires (nothing was measured).
    """
    if not (math.isfinite(value) and math.isfinite(base)):
        return False
    change = value - base if direction == "up" else base - value
    return change > threshold * abs(base) if relative else change > threshold


def gold_divergence(train: Sequence[float], gold: Sequence[float], window: int, gold_drop: float) -> bool:
    """Whether the training reward rose while the gold reward fell by more than ``gold_drop`` over the last
    ``window`` intervals (the last ``window + 1`` paired values, oldest first).

    ``train[i]`` and ``gold[i]`` are measured at the same point (a validation). The training reward is rising
    when its last value is above its first; the gold reward has fallen when its first value exceeds its last by
    more than ``gold_drop``. False until ``window + 1`` pairs exist or when any value in the window is NaN.
    """
    if len(train) != len(gold):
        raise ValueError(f"{len(train)} training rewards for {len(gold)} gold rewards")
    if window < 1 or len(train) < window + 1:
        return False
    t, g = list(train[-window - 1 :]), list(gold[-window - 1 :])
    if not all(math.isfinite(v) for v in t + g):
        return False
    return t[-1] > t[0] and g[0] - g[-1] > gold_drop
