"""Where a misplaced option lives: the keys of a command line's recipes that accept the option's name.

jsonargparse refuses ``--model.generator.init_args.lora_rank=8`` on the main recipe with "Option
'lora_rank' is not accepted" and stops there. The recipes name every class they build (``class_path``), so
the keys that do take ``lora_rank`` follow from those classes' signatures: the refiner's
``--model.llm.init_args.lora_rank`` and the DiT's ``--model.generator.init_args.transformer.init_args.
lora_rank``. Reading the recipe files and the signatures costs milliseconds; a second parse of the whole
command line would cost seconds, on a path the user is already waiting on.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import inspect
import re
import typing
from collections.abc import Iterator
from typing import Any

from unirl_pl.errors import ConfigError
from unirl_pl.recipes import config_paths, load_recipe

# Lightning's subcommands build these from a fixed class; ``model`` and ``data`` name theirs in the recipe.
FIXED_ROOTS = {"trainer": "lightning.pytorch.Trainer"}


def refused_option(message: str) -> str | None:
    """The option name a jsonargparse refusal is about (``lora_rank``), or None for other errors."""
    found = re.search(r"Option '(\w+)' is not accepted", message)
    if found:
        return found.group(1)
    found = re.search(r"unrecognized arguments?:\s*--([\w.]+)", message, re.IGNORECASE)
    return found.group(1).rsplit(".", 1)[-1] if found else None


def option_homes(args: list[str], name: str, limit: int = 4) -> list[str]:
    """``--key`` forms that accept ``name`` in the configuration the ``--config`` recipes of ``args`` build
    (exact names first; close spellings when none is exact), without the key the user gave."""
    given = {a.split("=", 1)[0] for a in args if a.startswith("--")}
    params = dict(_accepting(_merged_recipes(args)))
    exact = [key for key, param in params.items() if param == name]
    close = set(difflib.get_close_matches(name, set(params.values()), n=limit, cutoff=0.75))
    keys = exact or [key for key, param in params.items() if param in close]
    found = [f"--{_short(k)}" for k in keys]
    return [k for k in dict.fromkeys(found) if k not in given][:limit]


def _merged_recipes(args: list[str]) -> dict[str, Any]:
    # The recipes as written, not parsed: only the class_path names they hold matter here, and a parse is what
    # just failed. A file that cannot be read adds nothing; the error being explained is another one.
    tree: dict[str, Any] = {}
    for path in config_paths(args):
        try:
            loaded = load_recipe(path)
        except ConfigError:
            continue
        _merge(tree, loaded)
    return tree


def _merge(into: dict[str, Any], new: dict[str, Any]) -> None:
    for key, value in new.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value


def _accepting(tree: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(key, parameter name) for every parameter of every class the tree names, at its config key."""
    for root, class_path in FIXED_ROOTS.items():
        yield from _parameters(class_path, root)
    yield from _walk(tree, "")


def _walk(node: Any, path: str) -> Iterator[tuple[str, str]]:
    if not isinstance(node, dict):
        return
    class_path = node.get("class_path")
    if isinstance(class_path, str):
        yield from _parameters(class_path, f"{path}.init_args")
    for key, value in node.items():
        yield from _walk(value, f"{path}.{key}" if path else key)


def _parameters(class_path: str, at: str) -> Iterator[tuple[str, str]]:
    """Each constructor parameter of ``class_path`` at ``at``, and the fields of a dataclass-typed one."""
    cls = _load(class_path)
    if cls is None:
        return
    try:
        signature = inspect.signature(cls)
        hints = typing.get_type_hints(cls.__init__)
    except (TypeError, ValueError, NameError):
        return
    for param in signature.parameters.values():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        yield f"{at}.{param.name}", param.name
        hint = hints.get(param.name)
        if dataclasses.is_dataclass(hint):
            for field in dataclasses.fields(hint):
                yield f"{at}.{param.name}.{field.name}", field.name


def _load(class_path: str) -> Any:
    module, _, name = class_path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return None


def _short(key: str) -> str:
    # LightningCLI takes --model.X and --data.X for the init_args of the recipe's model and data classes.
    return re.sub(r"^(model|data)\.init_args\.", r"\1.", key)
