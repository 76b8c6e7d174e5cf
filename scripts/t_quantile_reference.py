"""Write scipy's Student-t quantiles, the reference ``tests/test_t_quantile.py`` checks the ablation's own
``t_quantile`` against, as CSV: one row per degree of freedom 1..60 at the test's probabilities.

The table is committed (``tests/reference/scipy_t_ppf.csv``) so the suite does not install scipy: with scipy
installed, torchmetrics imports ``scipy.signal`` at its own import, and every CLI process of the suite paid for it.
Regenerate it (scipy needed, ``pip install scipy``) when the probabilities change:

    python scripts/t_quantile_reference.py > tests/reference/scipy_t_ppf.csv
"""

from __future__ import annotations

import csv
import sys

import scipy
from scipy import stats

# The probabilities a confidence interval uses and beyond; within 1e-3 of 0.5 scipy is the less accurate one.
PROBABILITIES = (0.501, 0.51, 0.55, 0.6, 0.75, 0.8, 0.9, 0.95, 0.975, 0.99, 0.995, 0.999, 0.9995, 0.99999)
DEGREES_OF_FREEDOM = range(1, 61)


def main() -> int:
    print(f"# scipy {scipy.__version__} stats.t.ppf(p, dof); repr of each float64")
    writer = csv.writer(sys.stdout, lineterminator="\n")
    writer.writerow(["dof", *PROBABILITIES])
    for dof in DEGREES_OF_FREEDOM:
        writer.writerow([dof, *(repr(float(stats.t.ppf(p, dof))) for p in PROBABILITIES)])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
