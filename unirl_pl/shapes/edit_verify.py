"""ShapesWorld-Edit verifier: score an edited image against an EditSpec, the RL reward of the edit task.

Detection is ``verify.detect``; an object is *found* when some detection has its color and shape and a
centroid within ``tol_px`` (2 px at 32x32, scaled with the image) of where a clean render of its target
placement puts it (``edits.expected_detection``). The constraints come in two groups:

* ``target/...``, what the instruction asked. recolor and reshape: the new object is found in the edited
  object's box (``target/blue circle``) and its old color-shape pair is gone (``target/no red circle``);
  remove: the pair is gone; add and move: the object is detected anywhere (``target/green circle``) and
  some detection of it lies on the relation's side of some detection of the anchor by centroids, with
  position scenes' margin (``target/green circle left of red square``, ``verify.relation_holds``).
* ``keep/...``, what it did not ask. Every other object of the target is found (``keep/red square``: same
  color, same shape, moved at most ``tol_px``) and the image holds no more objects than the target
  (``keep/no_extra``), so a stray or duplicated object fails.

``strict`` holds when every constraint holds; ``soft`` is the fraction that hold. The unedited source
fails at least one target constraint for every kind: a move's source never satisfies its relation.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

from unirl_pl.shapes.edit_prompts import noun
from unirl_pl.shapes.edits import EDIT_KINDS, EditSpec, expected_detection
from unirl_pl.shapes.render import DEFAULT_SIZE, Placement
from unirl_pl.shapes.verify import (
    DEFAULT_TOL,
    RELATION_MARGIN_FRAC,
    Detection,
    as_float_hwc,
    detect,
    grouped_scores,
    relation_holds,
)

# A clean re-render of an untouched object puts its centroid exactly where it was; 2 px at 32x32 (a sixth
# of the smallest object's side) forgives a generated object drawn a pixel larger or off, not a move.
CENTROID_TOL_AT_32 = 2.0


@dataclass(frozen=True)
class EditVerdict:
    """Edit verification: ``strict`` (all hold), ``soft`` (fraction that hold) and each named constraint."""

    strict: bool
    soft: float
    constraints: dict[str, bool]
    detections: tuple[Detection, ...] = field(default=(), repr=False)

    @property
    def target(self) -> bool:
        """Whether every ``target/`` constraint holds: the instruction was carried out."""
        return all(ok for name, ok in self.constraints.items() if name.startswith("target/"))

    @property
    def preserved(self) -> bool:
        """Whether every ``keep/`` constraint holds: nothing else changed."""
        return all(ok for name, ok in self.constraints.items() if name.startswith("keep/"))


def _of(detections: list[Detection], p: Placement) -> list[Detection]:
    return [d for d in detections if d.color == p.color and d.shape == p.shape]


@lru_cache(maxsize=4096)
def _clean_centroid(p: Placement) -> tuple[float, float]:
    """``expected_detection(p).centroid``, computed once per placement: every verdict asks it of each object."""
    return expected_detection(p).centroid


def _found(detections: list[Detection], p: Placement, tol_px: float) -> bool:
    """Whether some detection has ``p``'s color and shape within ``tol_px`` of its clean centroid."""
    x, y = _clean_centroid(p)
    return any(math.hypot(d.centroid[0] - x, d.centroid[1] - y) <= tol_px for d in _of(detections, p))


def edit_constraints(edit: EditSpec, detections: list[Detection], tol_px: float) -> dict[str, bool]:
    """Evaluate every target and preservation constraint of ``edit`` (see the module doc for the names)."""
    constraints: dict[str, bool] = {}
    new = edit.edited
    if edit.kind in ("recolor", "reshape"):
        constraints[f"target/{noun(new)}"] = _found(detections, new, tol_px)
    if edit.kind in ("recolor", "reshape", "remove"):
        old = edit.source[edit.index]
        constraints[f"target/no {noun(old)}"] = not _of(detections, old)
    if edit.relation is not None and edit.anchor is not None:
        anchor = edit.target[edit.anchor]
        margin = RELATION_MARGIN_FRAC * edit.size
        constraints[f"target/{noun(new)}"] = bool(_of(detections, new))
        constraints[f"target/{noun(new)} {edit.relation} {noun(anchor)}"] = any(
            relation_holds(a, b, edit.relation, margin) for a in _of(detections, new) for b in _of(detections, anchor)
        )
    for k, p in enumerate(edit.target):
        if edit.kind == "remove" or k != edit.index:
            constraints[f"keep/{noun(p)}"] = _found(detections, p, tol_px)
    constraints["keep/no_extra"] = len(detections) <= len(edit.target)
    return constraints


def verify_edit(
    edit: EditSpec,
    image: np.ndarray,
    tol_px: float | None = None,
    tol: float = DEFAULT_TOL,
    min_area: int | None = None,
) -> EditVerdict:
    """Check one edited image (uint8 or float [0, 1], HWC or CHW, ``edit.size`` square) against ``edit``.

    ``tol_px`` is the centroid tolerance in pixels (default ``CENTROID_TOL_AT_32`` scaled with the size);
    ``tol`` and ``min_area`` go to ``verify.detect``. Returns an EditVerdict whose ``strict`` holds only
    when every constraint holds and whose ``soft`` is the fraction that hold (the denser RL reward).
    """
    img = as_float_hwc(image)
    if img.shape[:2] != (edit.size, edit.size):
        raise ValueError(f"expected a {edit.size}x{edit.size} image for this edit, got {img.shape[:2]}")
    if tol_px is None:
        tol_px = CENTROID_TOL_AT_32 * edit.size / DEFAULT_SIZE
    detections = detect(img, tol, min_area)
    constraints = edit_constraints(edit, detections, tol_px)
    passed = sum(constraints.values())
    return EditVerdict(passed == len(constraints), passed / len(constraints), constraints, tuple(detections))


def edit_breakdown(
    edits: Sequence[EditSpec], images: Sequence[np.ndarray] | np.ndarray
) -> dict[str, tuple[float, int]]:
    """``{key: (mean, count)}`` of strict and soft scores per kind and overall (``strict/recolor``), like
    ``ShapesGenEval.breakdown``: counts let a caller average exactly over batches; kinds absent from the
    batch are left out; ``overall`` is the mean over images.
    """
    verdicts = [verify_edit(edit, image) for edit, image in zip(edits, images, strict=True)]
    return grouped_scores([edit.kind for edit in edits], verdicts, EDIT_KINDS)
