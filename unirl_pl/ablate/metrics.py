"""Reading a run's ``metrics.csv``: the held-out scores per category, and the order they are shown in."""

from __future__ import annotations

import csv
import re
from pathlib import Path
from typing import Any

# ``val/<term>/<strict|soft>/<category>``, as the module logs a reward term's breakdown.
METRIC_RE = re.compile(r"^val/(?P<term>[^/]+)/(?P<score>strict|soft)/(?P<category>[^/]+)$")
SCORES = ("strict", "soft")

Series = dict[str, list[tuple[int, float]]]


def read_validation(path: Path, *, fit: bool) -> tuple[dict[str, float], int | None, Series]:
    """The held-out breakdown of a ``metrics.csv``: (last validation's values, its x, every validation).

    Keys are ``<term>/<strict|soft>/<category>``. x is the number of RL steps done: a fit logs its
    validation after step N at ``step`` N - 1; ``validate`` (base) runs before any step, so x = 0.
    """
    final: dict[str, float] = {}
    final_step: int | None = None
    series: Series = {}
    with path.open(newline="") as f:
        for row in csv.DictReader(f):
            values = {}
            for key, value in row.items():
                found = METRIC_RE.match(key or "")
                if found and value not in ("", None):
                    values[key[len("val/") :]] = float(value)
            if not values:
                continue
            step = int(float(row.get("step") or 0))
            x = step + 1 if fit else 0
            for key, value in values.items():
                series.setdefault(key, []).append((x, value))
            final, final_step = values, x
    return final, final_step, series


TRAIN_CPU = "time/train_cpu_seconds"  # logged with each validation by unirl_pl.callbacks.TrainCPUClock


def read_train_cpu(path: Path) -> list[tuple[int, float]]:
    """``(RL steps done, training CPU seconds so far)`` at each validation of a fit's ``metrics.csv`` that
    logged :data:`TRAIN_CPU`; empty when none did."""
    found: list[tuple[int, float]] = []
    with path.open(newline="") as f:
        for row in csv.DictReader(f):
            value = row.get(TRAIN_CPU)
            if value not in ("", None):
                found.append((int(float(row.get("step") or 0)) + 1, float(value)))
    return found


def metric_order(keys: set[str] | list[str]) -> list[str]:
    """``<term>/<score>/<category>`` keys: by term, then overall first and the ShapesWorld category order
    (a ``shapes_edit`` term's categories are edit kinds: overall first, then ``EDIT_KINDS``' order); any other
    category after those, by name."""
    try:
        from unirl_pl.shapes.edits import EDIT_KINDS
        from unirl_pl.shapes.scenes import CATEGORIES
    except ImportError:  # pragma: no cover - the package always has it
        CATEGORIES, EDIT_KINDS = (), ()
    # One rank for both vocabularies: they share no name, and each term reports only its own.
    rank = {name: i for i, name in enumerate(("overall", *CATEGORIES, *EDIT_KINDS))}

    def key(metric: str) -> tuple[Any, ...]:
        term, score, category = metric.split("/")
        return (term, rank.get(category, len(rank)), category, SCORES.index(score))

    return sorted(keys, key=key)


def strict_overall(keys: set[str] | list[str]) -> str | None:
    """The first reward term's overall strict score among ``keys`` (the headline number), if any."""
    found = metric_order({k for k in keys if k.split("/")[1:] == ["strict", "overall"]})
    return found[0] if found else None


def headers(metrics: list[str]) -> list[tuple[str, str]]:
    """``(metric, header)`` per table column (``strict overall``); the term is named only when there are several."""
    terms = {m.split("/")[0] for m in metrics}
    out = []
    for metric in metrics:
        term, score, category = metric.split("/")
        out.append((metric, f"{score} {category}" if len(terms) == 1 else f"{term} {score} {category}"))
    return out
