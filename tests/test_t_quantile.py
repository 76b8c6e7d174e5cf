"""The ablation's hand-written Student-t quantile (``unirl_pl.ablate.stats.t_quantile``, no scipy at run
time) against ``scipy.stats.t.ppf``: every integer degree of freedom 1..60 at the probabilities a
confidence interval uses and beyond. scipy's values are read from ``tests/reference/scipy_t_ppf.csv``, written by
``scripts/t_quantile_reference.py`` (the suite does not install scipy).

Tolerance: relative 1e-10. The function's largest relative error over this grid is 1.8e-11 (p = 0.501,
where the quantile is small and 2p - 1 loses digits), 5.8e-12 at p = 0.99999 (the tail 1 - p carries
float rounding) and under 1e-12 elsewhere; the bisection stops at a relative width of 1e-12.

Probabilities within 1e-3 of 0.5 are left out on purpose: there scipy's own ``t.ppf`` is the less
accurate one. At df 4, p = 0.5000001 it is 4e-4 off the exact 2.6667e-7, which a high-precision
integration of the density confirms and this function matches.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest

from unirl_pl.ablate.stats import t_quantile

TABLE = Path(__file__).resolve().parent / "reference" / "scipy_t_ppf.csv"


def scipy_table() -> tuple[list[float], dict[int, list[float]]]:
    """The probabilities (the header) and, per degree of freedom, scipy's quantile at each."""
    rows = [row for row in csv.reader(TABLE.read_text().splitlines()) if row and not row[0].startswith("#")]
    header, body = rows[0], rows[1:]
    return [float(p) for p in header[1:]], {int(row[0]): [float(v) for v in row[1:]] for row in body}


PROBABILITIES, SCIPY = scipy_table()


def test_the_reference_table_covers_every_degree_of_freedom_and_probability():
    assert sorted(SCIPY) == list(range(1, 61))
    assert len(PROBABILITIES) == 14 and min(PROBABILITIES) == 0.501 and max(PROBABILITIES) == 0.99999
    assert all(len(values) == len(PROBABILITIES) for values in SCIPY.values())
    # Spot values of the t distribution every statistics table prints (to its 3 decimals).
    assert round(SCIPY[1][PROBABILITIES.index(0.975)], 3) == 12.706
    assert round(SCIPY[4][PROBABILITIES.index(0.975)], 3) == 2.776
    assert round(SCIPY[60][PROBABILITIES.index(0.95)], 3) == 1.671


@pytest.mark.parametrize("dof", range(1, 61))
def test_t_quantile_matches_scipy(dof):
    ours = [t_quantile(p, dof) for p in PROBABILITIES]
    assert ours == pytest.approx(SCIPY[dof], rel=1e-10, abs=0)


def test_t_quantile_at_one_and_two_degrees_of_freedom_has_closed_forms():
    # df 1 is the Cauchy distribution, tan(pi (p - 1/2)); df 2 is (2p - 1) / sqrt(2 p (1 - p)).
    for p in (0.6, 0.9, 0.975, 0.999):
        assert t_quantile(p, 1) == pytest.approx(math.tan(math.pi * (p - 0.5)), rel=1e-10)
        assert t_quantile(p, 2) == pytest.approx((2 * p - 1) / math.sqrt(2 * p * (1 - p)), rel=1e-10)
