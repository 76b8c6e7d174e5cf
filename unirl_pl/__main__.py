"""``python -m unirl_pl``: see :mod:`unirl_pl.commands` and :mod:`unirl_pl.cli`."""

import sys

from unirl_pl.commands import run_before_lightning
from unirl_pl.threads import set_threads

if __name__ == "__main__":
    # Before torch loads: on a CPU run its OpenMP pool (and numpy's BLAS) then start with one thread;
    # OMP_NUM_THREADS wins, and a GPU run keeps torch's default (unirl_pl.threads).
    set_threads()
    handled = run_before_lightning(sys.argv[1:])  # --help and the tools: without importing Lightning
    if handled is not None:
        raise SystemExit(handled)
    from unirl_pl.cli import main

    main()
