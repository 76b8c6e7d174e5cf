"""``--vary KEY=V1,V2,...``: arms, the variants of the recipe that an ablation crosses with modes and seeds.

An arm is what one set of values adds to every command line of its runs: overlay recipes (extra
``--config`` files, right after the recipe) and ``--KEY=V`` overrides. For the algorithm keys
(``model.generator_algorithm``, ``model.llm_algorithm``) a bare name is the algorithm's overlay,
``recipes/algorithms/<name>.yaml`` (next to the recipe, else the repository's), and a ``.yaml`` path is an
overlay as given; the key ``overlay`` takes recipe overlays (``.yaml`` paths, or ``none`` for the recipe as
is), e.g. ``--vary overlay=none,recipes/overlays/two_updates_ema.yaml``; every other value, and every other
key, is passed as ``--KEY=V``. Several ``--vary`` flags are crossed; with none there is one arm with an empty
label, the recipe as it is.
"""

from __future__ import annotations

import argparse
import itertools
import re
from dataclasses import dataclass
from pathlib import Path

ALGORITHM_KEYS = ("model.generator_algorithm", "model.llm_algorithm")
OVERLAY_KEY = "overlay"
# Keys the ablation sets itself: varying them would fight its own flags.
RESERVED = {"model.mode": "--modes", "seed_everything": "--seeds", "data.seed": "--seeds"}
REPO_OVERLAYS = Path(__file__).resolve().parents[2] / "recipes" / "algorithms"
KEY_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")
NAME_RE = re.compile(r"[A-Za-z0-9_]+")


@dataclass(frozen=True)
class Arm:
    """One variant of the recipe: its label in run names (``joint-<label>_s0``) and what it adds to a command."""

    label: str = ""
    configs: tuple[str, ...] = ()
    overrides: tuple[str, ...] = ()

    def describe(self) -> str:
        parts = [f"--config {c}" for c in self.configs] + list(self.overrides)
        return " ".join(parts) or "the recipe as is"


def parse_vary(text: str) -> tuple[str, tuple[str, ...]]:
    """``KEY=V1,V2,...`` of ``--vary`` (argparse type): the key and its distinct values, in order."""
    key, sep, values = text.partition("=")
    key = key.strip().removeprefix("--")
    if not sep or not KEY_RE.fullmatch(key):
        raise argparse.ArgumentTypeError(f"expected KEY=V1,V2,... (a dotted config key), got {text!r}")
    if key in RESERVED:
        raise argparse.ArgumentTypeError(f"{key} is set by the ablation itself: use {RESERVED[key]}")
    items = tuple(dict.fromkeys(v.strip() for v in values.split(",")))
    if not items or "" in items:
        raise argparse.ArgumentTypeError(f"--vary {key}: expected comma-separated non-empty values, got {values!r}")
    return key, items


def overlay_path(name: str, recipe: str) -> Path | None:
    """The overlay of algorithm ``name``: ``algorithms/<name>.yaml`` beside the recipe, else the repository's."""
    for folder in (Path(recipe).parent / "algorithms", REPO_OVERLAYS):
        path = folder / f"{name}.yaml"
        if path.is_file():
            return path
    return None


def _label(text: str) -> str:
    # Run names become folder and logger names: keep them to a portable alphabet.
    return re.sub(r"[^A-Za-z0-9_.+-]+", "_", text).strip("_") or "_"


def value_arm(key: str, value: str, recipe: str) -> Arm:
    """The arm of one value of one key; raises ``ValueError`` for an algorithm name with no overlay."""
    if key == OVERLAY_KEY:
        if value == "none":
            return Arm("none")
        if not value.endswith((".yaml", ".yml")) or not Path(value).is_file():
            raise ValueError(f"--vary {OVERLAY_KEY}: expected 'none' or an existing .yaml overlay, got {value!r}")
        return Arm(_label(Path(value).stem), configs=(value,))
    if key in ALGORITHM_KEYS and NAME_RE.fullmatch(value):
        path = overlay_path(value, recipe)
        if path is None:
            known = sorted(
                {p.stem for d in (Path(recipe).parent / "algorithms", REPO_OVERLAYS) for p in d.glob("*.yaml")}
            )
            raise ValueError(f"--vary {key}: no overlay {value}.yaml (known: {', '.join(known) or 'none'})")
        return Arm(value, configs=(str(path),))
    if key in ALGORITHM_KEYS and value.endswith((".yaml", ".yml")):
        if not Path(value).is_file():
            raise ValueError(f"--vary {key}: {value} does not exist")
        return Arm(_label(Path(value).stem), configs=(value,))
    label = _label(value) if key in ALGORITHM_KEYS else _label(f"{key.rsplit('.', 1)[-1]}_{value}")
    return Arm(label, overrides=(f"--{key}={value}",))


def build_arms(varies: list[tuple[str, tuple[str, ...]]], recipe: str) -> list[Arm]:
    """Every combination of the ``--vary`` values (the first key varies slowest); one empty arm with none.

    Raises ``ValueError`` for a key given twice, a missing overlay, or two values with the same label.
    """
    keys = [key for key, _ in varies]
    if len(set(keys)) != len(keys):
        raise ValueError(f"--vary: a key is given twice in {keys}")
    per_key = [[value_arm(key, value, recipe) for value in values] for key, values in varies]
    arms = [
        Arm(
            "-".join(a.label for a in combo),
            tuple(c for a in combo for c in a.configs),
            tuple(o for a in combo for o in a.overrides),
        )
        for combo in itertools.product(*per_key)
    ]
    labels = [a.label for a in arms]
    if len(set(labels)) != len(labels):
        raise ValueError(f"--vary: values give the same run name: {labels}")
    return arms
