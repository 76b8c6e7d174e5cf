"""``python -m unirl_pl.bench``: an alias of ``python -m unirl_pl bench``."""

from unirl_pl.bench.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
