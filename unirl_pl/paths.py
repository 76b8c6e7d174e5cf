"""Input paths in a recipe resolve from the recipe's folder or the package, so a recipe runs from any directory.

A recipe names inputs (pretrained experts, prompt files, checkpoints) by relative path, e.g.
``unirl_pl/assets/shapes/refiner``. A relative path that exists relative to the current directory
is used as is; otherwise it is looked up relative to the recipe file's folder and the two above it
(nearest first: ``recipes/`` then the repository root) and relative to the folder holding the installed
``unirl_pl`` package, and the first hit replaces it. Only input keys are touched: names ending in
``path`` (``pretrained_path``, ``pipeline_path``, ``ckpt_path``; not ``dirpath``) and ``prompts``,
``val_prompts``, ``predict_prompts``. Output folders (``save_dir``, ``output_dir``, ``dirpath``)
stay relative to the current directory.

An input that clearly names a local file (absolute, ``./``, ``~``, or under a folder that exists)
but exists nowhere is a configuration error, raised before any model is built.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from jsonargparse import Namespace

from unirl_pl.errors import InputError

PACKAGE_PARENT = Path(__file__).resolve().parents[1]
PROMPT_KEYS = frozenset({"prompts", "val_prompts", "predict_prompts"})
OUTPUT_KEYS = frozenset({"dirpath"})
MAX_LEVELS = 3  # the recipe's folder and two above: recipes/shapes/x.yaml reaches the repository root


def is_input_key(name: str) -> bool:
    """Whether a config key (its last segment) names an input path."""
    return name in PROMPT_KEYS or (name.endswith("path") and name not in OUTPUT_KEYS)


def search_roots(config_files: Iterable[str | os.PathLike]) -> list[Path]:
    """Folders a relative input is looked up in: above each recipe (nearest first), then the package's parent."""
    roots: list[Path] = []
    for file in config_files:
        for folder in Path(file).resolve().parents[:MAX_LEVELS]:
            if folder not in roots:
                roots.append(folder)
    if PACKAGE_PARENT not in roots:
        roots.append(PACKAGE_PARENT)
    return roots


def resolve(value: str, roots: list[Path], key: str = "") -> str:
    """``value`` as is when it exists (or is not a relative local path), else its first hit under ``roots``.

    Raises ``FileNotFoundError`` for a value that names a local path that exists nowhere.
    """
    expanded = os.path.expanduser(value)
    if not value or "://" in value or os.path.exists(expanded):
        return value
    if not os.path.isabs(expanded):
        for root in roots:
            if (root / value).exists():
                return str(root / value)
    first = Path(value).parts[0] if Path(value).parts else ""
    local = (
        os.path.isabs(expanded)
        or value.startswith(("./", "../", "~"))
        or ("/" in value and any((base / first).is_dir() for base in [Path.cwd(), *roots]))
    )
    if local:
        where = "" if os.path.isabs(expanded) else f" (looked in {Path.cwd()} and {', '.join(map(str, roots))})"
        raise FileNotFoundError(f"{key or 'path'}: {value!r} does not exist{where}")
    return value  # a hub id or a name, not a local path


def resolve_inputs(node: Any, roots: list[Path], key: str = "") -> Any:
    """Resolve every input path in a nested config (jsonargparse ``Namespace``, dict or list), in place."""
    if isinstance(node, Namespace):
        items = list(vars(node).items())
        setter = node.__setattr__
    elif isinstance(node, dict):
        items, setter = list(node.items()), node.__setitem__
    elif isinstance(node, list):
        items, setter = list(enumerate(node)), node.__setitem__
    else:
        return node
    for name, value in items:
        # Named as on the command line, where init_args may be skipped: model.llm.pretrained_path.
        path = key if name == "init_args" else f"{key}.{name}" if key else str(name)
        if isinstance(value, str) and isinstance(name, str) and is_input_key(name):
            setter(name, resolve(value, roots, path))
        elif not isinstance(value, str):  # a list of prompts is not a list of paths: strings are left alone
            resolve_inputs(value, roots, path)
    return node


def read_json_file(file: str | os.PathLike) -> Any:
    """The parsed content of a JSON input file; :class:`InputError` in one line naming the file and the line.

    ``json.loads`` reports a syntax error as "line 3 column 5 (char 40)" of a string it does not name,
    and a binary file fails earlier with a codec error: both are said against the file here.
    """
    import json

    path = Path(file)
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise InputError(
            f"{path}: not UTF-8 JSON text (byte {raw[err.start]:#04x} at offset {err.start}); is it a binary file?"
        ) from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise InputError(f"{path}:{err.lineno}: not valid JSON ({err.msg} at column {err.colno})") from None
