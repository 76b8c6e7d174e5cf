"""The statistics of an ablation: mean ± std over seeds, and paired differences with a t interval.

Pure functions on lists of floats, no numpy or scipy: the ablation is a tool users run on a bare install.
Student's t quantile is computed from the exact closed form of the t distribution for an integer number
of degrees of freedom (Abramowitz & Stegun 26.7.3-4), inverted by bisection.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Readings of a confidence interval of a difference, in neutral words.
ABOVE, INCLUDES, BELOW, NO_INTERVAL = "interval above 0", "includes 0", "below 0", "no interval (n < 2)"


def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (n - 1; nan for a single value)."""
    n = len(values)
    if not n:
        return math.nan, math.nan
    mean = sum(values) / n
    if n == 1:
        return mean, math.nan
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))


def t_central_probability(t: float, dof: int) -> float:
    """P(|T| <= t) for Student's t with ``dof`` (a positive integer) degrees of freedom, t >= 0.

    With theta = atan(t / sqrt(dof)), the probability is a finite trigonometric series: for odd dof
    (2/pi)(theta + sin cos (1 + 2/3 cos^2 + 2*4/(3*5) cos^4 + ...)), for even dof
    sin (1 + 1/2 cos^2 + 1*3/(2*4) cos^4 + ...), each with (dof - 1) // 2 or dof // 2 terms.
    """
    if dof < 1 or int(dof) != dof:
        raise ValueError(f"dof must be a positive integer, got {dof}")
    if t <= 0:
        return 0.0
    theta = math.atan(t / math.sqrt(dof))
    sin, cos2 = math.sin(theta), math.cos(theta) ** 2
    if dof % 2:
        # Terms 2*4*...*(2k) / (3*5*...*(2k+1)) cos^(2k), k = 1 .. (dof - 3) / 2.
        term, total = 1.0, 1.0
        for k in range(1, (dof - 1) // 2):
            term *= (2 * k) / (2 * k + 1) * cos2
            total += term
        series = sin * math.cos(theta) * total if dof > 1 else 0.0
        return 2 / math.pi * (theta + series)
    # Terms 1*3*...*(2k-1) / (2*4*...*(2k)) cos^(2k), k = 1 .. (dof - 2) / 2.
    term, total = 1.0, 1.0
    for k in range(1, dof // 2):
        term *= (2 * k - 1) / (2 * k) * cos2
        total += term
    return sin * total


def t_quantile(p: float, dof: int) -> float:
    """The ``p`` quantile (0.5 < p < 1) of Student's t with ``dof`` integer degrees of freedom.

    Solves P(|T| <= t) = 2p - 1 by bisection on t (the probability rises monotonically in t), to a
    relative precision far below the three decimals a report shows.
    """
    if not 0.5 < p < 1:
        raise ValueError(f"p must be in (0.5, 1), got {p}")
    target = 2 * p - 1
    low, high = 0.0, 1.0
    while t_central_probability(high, dof) < target:
        low, high = high, high * 2
    for _ in range(200):
        mid = (low + high) / 2
        if t_central_probability(mid, dof) < target:
            low = mid
        else:
            high = mid
        if high - low <= 1e-12 * high:
            break
    return (low + high) / 2


@dataclass(frozen=True)
class Paired:
    """Paired differences a - b over the seeds both sides have, and their mean's t interval.

    ``ci_low``/``ci_high``: mean ± t_{(1+level)/2, n-1} sd / sqrt(n) (nan with fewer than 2 seeds).
    ``wins_a``/``wins_b``: seeds where a (b) is strictly higher; ``ties`` the others.
    """

    seeds: tuple[int, ...]
    a: tuple[float, ...]
    b: tuple[float, ...]
    level: float = 0.95

    @property
    def diffs(self) -> tuple[float, ...]:
        return tuple(x - y for x, y in zip(self.a, self.b, strict=True))

    @property
    def n(self) -> int:
        return len(self.seeds)

    @property
    def mean_a(self) -> float:
        return mean_std(list(self.a))[0]

    @property
    def mean_b(self) -> float:
        return mean_std(list(self.b))[0]

    @property
    def mean(self) -> float:
        return mean_std(list(self.diffs))[0]

    @property
    def sd(self) -> float:
        return mean_std(list(self.diffs))[1]

    @property
    def t(self) -> float:
        return t_quantile((1 + self.level) / 2, self.n - 1) if self.n >= 2 else math.nan

    @property
    def half_width(self) -> float:
        return self.t * self.sd / math.sqrt(self.n) if self.n >= 2 else math.nan

    @property
    def ci_low(self) -> float:
        return self.mean - self.half_width

    @property
    def ci_high(self) -> float:
        return self.mean + self.half_width

    @property
    def wins_a(self) -> int:
        return sum(d > 0 for d in self.diffs)

    @property
    def wins_b(self) -> int:
        return sum(d < 0 for d in self.diffs)

    @property
    def ties(self) -> int:
        return self.n - self.wins_a - self.wins_b

    @property
    def reading(self) -> str:
        """Where the interval lies against 0: above, includes, below (closed: an end at 0 includes it)."""
        if self.n < 2:
            return NO_INTERVAL
        if self.ci_low > 0:
            return ABOVE
        if self.ci_high < 0:
            return BELOW
        return INCLUDES


def paired(a: dict[int, float], b: dict[int, float], level: float = 0.95) -> Paired:
    """Pair two ``seed -> value`` maps on the seeds both have (sorted)."""
    seeds = tuple(sorted(set(a) & set(b)))
    return Paired(seeds, tuple(a[s] for s in seeds), tuple(b[s] for s in seeds), level)
