"""``python -m unirl_pl``: see :mod:`unirl_pl.cli`."""

from unirl_pl.threads import set_threads

# Before torch loads: its OpenMP pool (and numpy's BLAS) then start with one thread; OMP_NUM_THREADS wins.
set_threads()

from unirl_pl.cli import main  # noqa: E402

if __name__ == "__main__":
    main()
