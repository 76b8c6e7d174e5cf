"""``python -m unirl_pl``: see :mod:`unirl_pl.cli`."""

import os

# Before torch loads: its OpenMP pool (and numpy's BLAS) then start with one thread; OMP_NUM_THREADS wins.
os.environ.setdefault("OMP_NUM_THREADS", "1")

from unirl_pl.cli import main  # noqa: E402

if __name__ == "__main__":
    main()
