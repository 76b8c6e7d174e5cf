"""``python -m unirl_pl.ablate``: an alias of ``python -m unirl_pl ablate``."""

from unirl_pl.ablate.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
