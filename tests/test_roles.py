"""Roles, not names: outside the card, no component or loop name is written as a string.

The card (``unirl_pl/card.py``) is the one place that says the refiner is the component ``llm`` and the
denoise loop is ``diffusion_denoise``; everything else reaches them as ``Role.REFINER``, ``Loop.DENOISE``.
A string literal ``"llm"`` in a dict key, an index or a comparison elsewhere is a second definition that a
card with other components would silently miss. Diffusers' own folder names (``subfolder="transformer"``,
``read_config("transformer")``, ``has_component(index, "transformer")``) are file layout, not roles.
"""

from __future__ import annotations

import io
import tokenize
from pathlib import Path

import pytest

from unirl_pl.card import LOOPS, Card, Loop, Role

ROOT = Path(__file__).resolve().parents[1] / "unirl_pl"
NAMES = {"llm", "transformer", "ar_decode", "diffusion_denoise"}
# The modules the issue names, plus the records and adapter export that index by loop and role.
SCOPE = ["module.py", "method", "callbacks", "plan", "bench", "export.py", "records.py", "adapters.py"]
# A line reading a diffusers folder may name it.
FOLDER_CALLS = ("subfolder", "read_config(", "has_component(")


def literal_names(source: str) -> list[tuple[int, str]]:
    """(line, text) of every string literal in ``source`` that equals a component or loop name."""
    found = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.STRING and tok.string.strip("\"'") in NAMES and tok.string[0] in "\"'":
            if not any(call in tok.line for call in FOLDER_CALLS):
                found.append((tok.start[0], tok.line.strip()))
    return found


def scoped_files() -> list[Path]:
    files: list[Path] = []
    for entry in SCOPE:
        path = ROOT / entry
        files += sorted(path.rglob("*.py")) if path.is_dir() else [path]
    return files


def test_no_component_or_loop_name_is_spelled_outside_the_card() -> None:
    offenders = {
        str(path.relative_to(ROOT)): hits for path in scoped_files() if (hits := literal_names(path.read_text()))
    }
    assert not offenders, f"use unirl_pl.card.Role / Loop instead: {offenders}"


def test_the_scan_sees_keys_indexes_and_comparisons() -> None:
    """The check above must catch each way a name is used as a key (else it passes on anything)."""
    for line in ('d = {"llm": 1}', 'x = d["transformer"]', 'if name == "ar_decode": pass', "y = 'diffusion_denoise'"):
        assert literal_names(line + "\n"), line
    assert not literal_names('cfg = read_config("transformer")\n')
    assert not literal_names('x = "llm_loss"\n')


def test_roles_are_the_card_names_checkpoints_have_always_used() -> None:
    card = Card.unified()
    assert set(card.components) >= {Role.REFINER, Role.GENERATOR}
    assert card.owner(Loop.DECODE) == "llm" and card.owner(Loop.DENOISE) == "transformer"
    assert LOOPS == ("ar_decode", "diffusion_denoise")
    # Plain strings, not enum members: a checkpoint keyed by them loads with weights_only.
    for key in [*card.components, *card.loops, *card.trained_components("joint")]:
        assert type(key) is str, type(key)


@pytest.mark.parametrize("has_llm", [True, False])
def test_the_card_without_a_refiner_trains_only_the_generator(has_llm: bool) -> None:
    card = Card.unified(has_llm=has_llm)
    assert card.trained_components("generator_only") == [Role.GENERATOR]
    assert card.runs_loop("generator_only", Loop.DECODE) is has_llm
