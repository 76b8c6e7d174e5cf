"""A recipe file as the CLI reads it: the one module of ``unirl_pl`` that imports ``yaml``.

A recipe's settings are the CLI parser's: ``fit``, ``validate`` and ``predict`` parse them, and ``plan``
parses them with the same parser (:func:`unirl_pl.cli.parse_config`), so a key a recipe leaves out takes its
constructor's default everywhere and no command keeps a copy of the defaults. This module holds what comes
before or beside that parse:

- :func:`config_paths`: the ``--config`` files of a command line, the one scan of that flag (the CLI's
  file check and :mod:`unirl_pl.option_hints` both use it);
- :func:`load_recipe`: one file checked and loaded as written, with a message that names the file (and line)
  when it is missing, not UTF-8 or not YAML. The CLI checks each ``--config`` with it before jsonargparse
  reads them (whose YAML errors name ``"<unicode string>"``, not the file). Its other readers want the
  recipe as written, not its resolved settings: ``export`` (the model and data of a saved run),
  ``option_hints`` (the classes a recipe names), ``bench`` and ``ablate`` (the callbacks it lists).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import yaml

from unirl_pl.errors import ConfigError


def config_paths(args: Sequence[str]) -> list[str]:
    """The ``--config`` files of a command line (``--config F`` and ``--config=F``), in their order (later wins)."""
    paths: list[str] = []
    for i, arg in enumerate(args):
        if arg == "--config" and i + 1 < len(args):
            paths.append(args[i + 1])
        elif arg.startswith("--config="):
            paths.append(arg.split("=", 1)[1])
    return paths


def load_recipe(path: str) -> dict[str, Any]:
    """The mapping recipe file ``path`` holds (an empty file: ``{}``), as written: no defaults, no overlays.

    Raises :class:`~unirl_pl.errors.ConfigError` naming the file (and the line) when it is missing or
    unreadable, not UTF-8 (a binary file is said to be one), not valid YAML, or not a mapping.
    """
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise ConfigError(f"--config {path}: no such file") from None
    except OSError as err:
        raise ConfigError(f"--config {path}: cannot be read ({err.strerror or err})") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line = raw.count(b"\n", 0, err.start) + 1
        hint = "a binary file, not a YAML recipe" if b"\0" in raw[:4096] else "save the recipe as UTF-8"
        raise ConfigError(f"{path}: line {line}: not UTF-8 text (byte {raw[err.start]:#04x}); {hint}") from None
    try:
        loaded = yaml.safe_load(text)
    except yaml.YAMLError as err:
        where = getattr(err, "problem_mark", None)
        line = f" line {where.line + 1}, column {where.column + 1}:" if where is not None else ""
        raise ConfigError(f"{path}:{line} not valid YAML ({getattr(err, 'problem', None) or err})") from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"{path}: a recipe is a YAML mapping of keys, got a {type(loaded).__name__}")
    return loaded
