"""A fake GenEval scorer for CPU runs: it checks that each image arrives with its prompt's GenEval row and
scores from that row, so a run against it proves the metadata travels from the prompt file to the server.

Serve it with the reference server (the CPU block of recipes/sd35_geneval.yaml points at it)::

    python -m unirl_pl serve-reward --reward tests.geneval_server.FakeGenEval --port 18085 \\
        --reward-args '{"prompt_file": "recipes/prompts/geneval_example.jsonl"}'

A sample whose metadata is missing or is not its prompt's row is a failed call (the server answers 500, the
trainer's fit stops); every sample seen and every mismatch is kept for a test to read, and, given a ``record``
file, written there too (the server builds the scorer in a worker process of its own: :func:`read_record`).
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

from torch import Tensor


def constraint_count(row: dict[str, Any]) -> int:
    """How many things a GenEval row asks of an image: each object, and each count, color and position on it."""
    count = 0
    for item in row.get("include", []):
        count += 1 + int(item.get("count", 1) > 1) + int("color" in item) + int("position" in item)
    return count + len(row.get("exclude", []))


def metadata_score(row: dict[str, Any]) -> float:
    """The fake's score before the image's share: 1 / (1 + constraints), so every GenEval tag scores apart."""
    return 1.0 / (1.0 + constraint_count(row))


class FakeGenEval:
    """Scores ``metadata_score(row) + 0.01 * brightness`` per image, after checking ``row`` is the prompt's own.

    Args:
        prompt_file: The GenEval metadata file (JSONL) the trainer reads its prompts from.
        record: A file to append each call's samples and mismatches to, one JSON line a call.
    """

    def __init__(self, prompt_file: str, record: str | None = None) -> None:
        rows = [json.loads(line) for line in Path(prompt_file).read_text().splitlines() if line.strip()]
        self.rows = {row["prompt"]: row for row in rows}
        self.record = record
        self.seen: list[tuple[str, dict[str, Any] | None]] = []  # (prompt, metadata) of every sample scored
        self.mismatches: list[str] = []
        self.lock = threading.Lock()

    def __call__(
        self,
        prompts: list[str],
        refined_prompts: list[str],
        images: Tensor,
        metadata: list[dict[str, Any] | None] | None = None,
    ) -> list[float]:
        items = metadata if metadata is not None else [None] * len(prompts)
        bad = [
            f"{prompt!r}: got {meta!r}, expected {self.rows.get(prompt)!r}"
            for prompt, meta in zip(prompts, items, strict=True)
            if meta is None or meta != self.rows.get(prompt)
        ]
        with self.lock:
            self.seen += list(zip(prompts, items, strict=True))
            self.mismatches += bad
            if self.record is not None:
                with open(self.record, "a") as f:
                    f.write(json.dumps({"seen": list(zip(prompts, items, strict=True)), "mismatches": bad}) + "\n")
        if bad:
            raise ValueError(f"{len(bad)} of {len(prompts)} samples without their prompt's GenEval row: {bad[0]}")
        brightness = images.float().mean(dim=tuple(range(1, images.ndim))).tolist()
        return [metadata_score(meta) + 0.01 * b for meta, b in zip(items, brightness, strict=True)]  # type: ignore[arg-type]


def read_record(record: str | Path) -> tuple[list[tuple[str, dict[str, Any] | None]], list[str]]:
    """Every sample (prompt, metadata) and every mismatch a :class:`FakeGenEval` wrote to ``record``."""
    calls = [json.loads(line) for line in Path(record).read_text().splitlines()]
    return [(p, m) for call in calls for p, m in call["seen"]], [b for call in calls for b in call["mismatches"]]
