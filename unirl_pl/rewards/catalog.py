"""``python -m unirl_pl rewards [NAME]``: the rewards a recipe can name, or one reward's arguments.

Without a name it lists every registered reward: its short name, the ``class_path`` a component term gives,
and the first line of its docstring. With a short name or a class path it prints that class's arguments as
``--help`` prints any component's (types, defaults and the docstring's ``Args:``), read by the same parser
that checks a recipe's ``init_args``, so what it shows is what a recipe may set.
"""

from __future__ import annotations

import argparse
import importlib
import inspect

from jsonargparse import ArgumentParser

from unirl_pl.rewards.builtin import REGISTRY


def reward_class(name: str) -> type:
    """The class a short name stands for, or the class at a dotted ``class_path``."""
    if name in REGISTRY:
        factory = REGISTRY[name]
        if isinstance(factory, type):
            return factory
        return getattr(importlib.import_module(factory.__module__), factory.__name__)
    module, _, attr = name.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), attr) if module else None
    except (ImportError, AttributeError):
        cls = None
    if not isinstance(cls, type):
        known = ", ".join(sorted(REGISTRY))
        raise SystemExit(f"error: no reward {name!r}: give a short name ({known}) or a class path")
    return cls


def catalog() -> str:
    """One line per registered reward: short name, class path, what it scores."""
    rows = []
    for name in sorted(REGISTRY):
        cls = reward_class(name)
        first = " ".join(inspect.getdoc(cls).split("\n\n")[0].split()) if inspect.getdoc(cls) else ""
        rows.append((name, f"{cls.__module__}.{cls.__qualname__}", first))
    width = [max(len(row[i]) for row in rows) for i in (0, 1)]
    lines = [f"{'name':<{width[0]}}  {'class_path':<{width[1]}}  what it scores"]
    lines += [f"{n:<{width[0]}}  {c:<{width[1]}}  {d}" for n, c, d in rows]
    lines += ["", "One reward's arguments (its init_args): python -m unirl_pl rewards NAME"]
    return "\n".join(lines)


def arguments(name: str) -> str:
    """The help of ``name``'s class arguments, as a recipe's ``init_args`` are checked against them."""
    cls = reward_class(name)
    parser = ArgumentParser(prog=f"init_args of {cls.__module__}.{cls.__qualname__}", add_help=False)
    parser.add_class_arguments(cls, fail_untyped=False)
    return parser.format_help()


def main(argv: list[str] | None = None) -> int:
    cli = argparse.ArgumentParser(prog="python -m unirl_pl rewards", description=__doc__.splitlines()[0])
    cli.add_argument("name", nargs="?", help="a short name (pickscore) or a class path (unirl_pl.rewards.PickScore)")
    args = cli.parse_args(argv)
    print(arguments(args.name) if args.name else catalog())
    return 0
