"""ShapesWorld-Edit reward: verify each edited image against the edit its prompt file's row describes.

An instruction alone does not say where the untouched objects are, so the edit is rebuilt from the sample's
metadata: the row of a file written by ``python -m unirl_pl.shapes.edit_files``, whose placements give the
source and target exactly (``edits.edit_of``). Neither the instruction nor the refined prompt is read, so a
refiner cannot earn reward by rewriting the request, only by helping the generator make the asked edit.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from functools import lru_cache

import torch

from unirl_pl.rewards.base import Reward
from unirl_pl.rewards.metadata import Metadata
from unirl_pl.rewards.shapes import SCORES, _images_to_numpy
from unirl_pl.shapes.edit_verify import edit_breakdown, verify_edit
from unirl_pl.shapes.edits import EDIT_KINDS, EditSpec, edit_of

# Every key ``breakdown`` can report, in its order (as ``shapes.BREAKDOWN_KEYS``): validation logs one metric per
# key on every rank, so they must be known before any image is scored.
BREAKDOWN_KEYS: tuple[str, ...] = tuple(
    f"{score}/{name}" for name in (*EDIT_KINDS, "overall") for score in ("strict", "soft")
)
# The fields of a row that ``edit_of`` reads; a row lacking any of them cannot be scored.
EDIT_FIELDS: tuple[str, ...] = ("kind", "source_placements", "target_placements", "index", "anchor", "relation", "size")
_HOW = "train it on a ShapesWorld-Edit prompt file written by python -m unirl_pl.shapes.edit_files"


@lru_cache(maxsize=65536)
def _cached_edit(key: str) -> EditSpec:
    # Prompt files are small and revisited every epoch: each distinct edit is rebuilt (and checked) once.
    return edit_of(json.loads(key))


def edits_of(metadata: Sequence[Metadata] | None, n: int, name: str = "shapes_edit") -> list[EditSpec]:
    """The edit of each of ``n`` samples from its metadata row, or a ValueError naming the reward and the fix.

    Rows are keyed by their ``EDIT_FIELDS`` only (``json.dumps(..., sort_keys=True)``): two paraphrases of one
    edit share a cache entry, and the key does not depend on the order a row's fields were written in.
    """
    if metadata is None:
        raise ValueError(f"reward {name!r} needs each sample's ShapesWorld-Edit row as metadata, got none: {_HOW}")
    if len(metadata) != n:
        raise ValueError(f"reward {name!r}: {len(metadata)} metadata rows for {n} samples")
    edits = []
    for i, row in enumerate(metadata):
        if not isinstance(row, dict):
            raise ValueError(f"reward {name!r}: sample {i} has no metadata row, so its edit is unknown: {_HOW}")
        missing = [f for f in EDIT_FIELDS if f not in row]
        if missing:
            raise ValueError(
                f"reward {name!r}: sample {i}'s metadata row lacks {', '.join(missing)}, so its edit is unknown: {_HOW}"
            )
        edits.append(_cached_edit(json.dumps({f: row[f] for f in EDIT_FIELDS}, sort_keys=True)))
    return edits


class ShapesEdit(Reward):
    """The ShapesWorld-Edit reward: per-image verifier score of the edit the sample's prompt row describes.

    ``score="soft"`` returns the fraction of the edit's constraints that hold, what was asked and what had to
    stay (a dense RL signal); ``score="strict"`` returns 1.0 only when all hold. It reads each sample's
    ``metadata`` (its prompt file row), so it only scores runs on files written by
    ``python -m unirl_pl.shapes.edit_files``; ``breakdown`` gives both scores per edit kind for validation.

    Args:
        score: ``soft`` or ``strict``, as above.
    """

    name = "shapes_edit"

    breakdown_keys: tuple[str, ...] = BREAKDOWN_KEYS

    def __init__(self, score: str = "soft") -> None:
        if score not in SCORES:
            raise ValueError(f"score must be one of {SCORES}, got {score!r}")
        self.score = score

    def __call__(
        self,
        prompts: list[str],
        refined_prompts: list[str],
        images: torch.Tensor,
        metadata: list[Metadata] | None = None,
    ) -> torch.Tensor:
        """Score ``images`` (float (N, 3, H, W) in [0, 1], each ``size`` square) against each row's edit.

        Returns N float32 scores in [0, 1]. Raises ValueError when lengths disagree or a row does not
        describe an edit (the message says which file format is expected).
        """
        if len(refined_prompts) != len(prompts):
            raise ValueError(f"got {len(refined_prompts)} refined prompts for {len(prompts)} prompts")
        edits = edits_of(metadata, len(prompts), self.name)
        arrays = _images_to_numpy(images, len(prompts))
        verdicts = [verify_edit(edit, image) for edit, image in zip(edits, arrays, strict=True)]
        scores = [float(v.strict) if self.score == "strict" else v.soft for v in verdicts]
        return torch.tensor(scores, dtype=torch.float32)

    def breakdown(
        self, prompts: list[str], images: torch.Tensor, metadata: list[Metadata] | None = None
    ) -> dict[str, tuple[float, int]]:
        """``{key: (mean, count)}`` of strict and soft scores per edit kind and overall (``strict/recolor``).

        Counts let a caller average exactly over batches; kinds absent from the batch are left out. Every key
        is one of :attr:`breakdown_keys`.
        """
        edits = edits_of(metadata, len(prompts), self.name)
        return edit_breakdown(edits, _images_to_numpy(images, len(prompts)))
