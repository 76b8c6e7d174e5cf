"""Every recipe parses: each YAML under ``recipes/`` runs ``--print_config`` through the real CLI.

Overlays (files that change only the trainer) are stacked on the main recipe, as their first comment
line says they are used; each recipe's first comment line is the exact command that runs it.
"""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
import yaml

from tests.helpers import JOINT, ROOT, printed_config

RECIPES = sorted((ROOT / "recipes").rglob("*.yaml"))


def _is_overlay(path: Path) -> bool:
    # An overlay changes settings of a recipe; it names no module class of its own.
    return "class_path" not in (yaml.safe_load(path.read_text()).get("model") or {})


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: str(p.relative_to(ROOT / "recipes")))
def test_recipe_parses_and_is_headed_by_its_command(recipe):
    first = recipe.read_text().splitlines()[0]
    assert first.startswith("# ") and "python -m unirl_pl" in first, f"{recipe.name}: first line is not its command"
    command = shlex.split(first[2:].split(" python ", 1)[-1] if first.startswith("# srun") else first[2:])
    configs = [command[i + 1] for i, word in enumerate(command) if word == "--config"]
    assert str(recipe.relative_to(ROOT)) in configs, f"{recipe.name}: its command does not use it"
    stack = [str(ROOT / c) for c in configs] if _is_overlay(recipe) else [str(recipe)]
    if _is_overlay(recipe):
        assert stack[0] == JOINT, f"overlay {recipe.name} is documented on top of the main recipe"
    config = printed_config(*[a for c in stack for a in ("--config", c)])
    assert config["model"]["class_path"] and config["data"]["class_path"]
