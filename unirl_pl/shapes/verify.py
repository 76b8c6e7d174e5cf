"""ShapesWorld verifier: detect colored shapes in an image and check a SceneSpec against them.

Detection is deliberately simple and pure numpy: each pixel goes to its nearest palette color when
that color is nearer than black and within ``tol`` (else it is background), 4-connected same-color
pixels form components, components smaller than ``min_area`` are dropped as noise, and each remaining
component's shape is read from its tight bounding box: taper (an upright triangle is far wider in its
lower half), then fill ratio (square ~1.0, circle ~0.79; blur pulls them to >= 0.92 and <= 0.85).
Anything else (elongated, inverted or sideways, hollow) is ``unknown``. Scoring follows GenEval:
objects the prompt does not mention never count against an image, except that counting demands the
exact number of the named kind.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from unirl_pl.shapes.scenes import COLORS, PALETTE, ObjectSpec, SceneSpec

# Palette neighbors are 1.0 apart (255 on the 0-255 scale). A blurred edge pixel at 2/3 intensity of
# a two-channel color sits ~0.47 from it, so the tolerance leaves room for noise on top of blur, while
# gray (0.87 from every color) and white (>= 1.0) stay background.
DEFAULT_TOL = 0.6
# At 32x32 the smallest rendered object (a side-8 triangle, 32 px) keeps >= 20 px after a 3x3 blur,
# while isolated noise specks are a few pixels.
MIN_AREA_AT_32 = 10
# Centroids must differ by this fraction of the image width/height for a relation to hold, so a
# near-tie (two shapes stacked almost vertically) is not read as "left of".
RELATION_MARGIN_FRAC = 1 / 16
# Bounding boxes more elongated than this are no square, circle or upright triangle.
MAX_ASPECT = 1.75

_PALETTE_RGB = np.array([PALETTE[c] for c in COLORS], dtype=np.float32) / 255.0
# Measured on 32x32 renders (sides 7..12): upright triangles have taper 0.5-0.57 clean and >= 0.33 after
# a 3x3 blur, squares and circles 0; fill is 1.0 / 0.92-0.97 blurred for squares, 0.76-0.85 / >= 0.59
# blurred for circles, so the cut points below sit in the gaps with room for noise.
TRIANGLE_MIN_TAPER = 0.22
# Inverted or sideways triangles taper about -0.5 / +-0.5; noise alone moves a symmetric shape's taper
# by up to ~0.2, so a looser cut keeps noisy upright shapes while still rejecting turned triangles.
TURNED_MIN_TAPER = 0.3
SQUARE_MIN_FILL = 0.88
CIRCLE_MIN_FILL = 0.5


@dataclass(frozen=True)
class Detection:
    """One detected object: palette color, shape (or ``unknown``), area, centroid (x, y), box, features."""

    color: str
    shape: str
    area: int
    centroid: tuple[float, float]
    bbox: tuple[int, int, int, int]  # x0, y0, x1, y1 inclusive
    fill: float
    taper: float


@dataclass(frozen=True)
class Verdict:
    """Verification result: ``strict`` (all hold), ``soft`` (fraction that hold) and each named constraint."""

    strict: bool
    soft: float
    constraints: dict[str, bool]
    detections: tuple[Detection, ...] = field(default=(), repr=False)


def as_float_hwc(image: np.ndarray) -> np.ndarray:
    """Return ``image`` as float32 (H, W, 3) in [0, 1]; accepts uint8 or float, HWC or CHW."""
    arr = np.asarray(image)
    if arr.ndim != 3:
        raise ValueError(f"expected a 3-D image (H, W, 3) or (3, H, W), got shape {arr.shape}")
    if arr.shape[-1] != 3 and arr.shape[0] == 3:
        arr = np.moveaxis(arr, 0, -1)
    if arr.shape[-1] != 3:
        raise ValueError(f"expected 3 color channels, got shape {arr.shape}")
    if arr.dtype == np.uint8:
        return arr.astype(np.float32) / 255.0
    if not np.issubdtype(arr.dtype, np.floating):
        raise ValueError(f"expected uint8 or float pixels, got {arr.dtype}")
    return np.clip(np.nan_to_num(arr.astype(np.float32)), 0.0, 1.0)


def classify_pixels(image: np.ndarray, tol: float = DEFAULT_TOL) -> np.ndarray:
    """Map every pixel to a palette index (position in ``COLORS``), or -1 for background/unknown."""
    img = as_float_hwc(image)
    dist = np.linalg.norm(img[:, :, None, :] - _PALETTE_RGB[None, None], axis=-1)  # (H, W, 6)
    nearest = dist.argmin(axis=-1)
    best = dist.min(axis=-1)
    to_black = np.linalg.norm(img, axis=-1)
    return np.where((best < tol) & (best < to_black), nearest, -1)


def label_components(classes: np.ndarray) -> np.ndarray:
    """Label 4-connected regions of equal non-negative class; returns int labels, 0 for background.

    Min-label propagation with pointer jumping: every foreground pixel starts with its own index,
    repeatedly takes the smallest label among same-class neighbors, then jumps to its label's label.
    Pure numpy, converges in a handful of sweeps on convex blobs.
    """
    h, w = classes.shape
    fg = classes >= 0
    big = h * w
    flat_idx = np.arange(h * w).reshape(h, w)
    lab = np.where(fg, flat_idx, big)
    same_v = fg[:-1] & (classes[:-1] == classes[1:])
    same_h = fg[:, :-1] & (classes[:, :-1] == classes[:, 1:])
    while True:
        new = lab.copy()
        np.minimum(new[:-1], np.where(same_v, lab[1:], big), out=new[:-1])
        np.minimum(new[1:], np.where(same_v, lab[:-1], big), out=new[1:])
        np.minimum(new[:, :-1], np.where(same_h, lab[:, 1:], big), out=new[:, :-1])
        np.minimum(new[:, 1:], np.where(same_h, lab[:, :-1], big), out=new[:, 1:])
        # Labels are pixel indices inside the same component, so following them only shortens paths.
        padded = np.append(new.ravel(), big)
        new = np.where(fg, padded[new], big)
        if np.array_equal(new, lab):
            break
        lab = new
    return np.where(fg, lab + 1, 0)


def shape_features(mask: np.ndarray) -> tuple[float, float, float, float]:
    """Fill ratio, vertical taper, horizontal taper and aspect ratio of a tight bounding-box mask.

    Vertical taper is (mean row width of the lower half - that of the upper half) / box width: about
    0.5 for an upright triangle, -0.5 for an inverted one, 0 for squares and circles. Horizontal taper
    is the same along columns, so sideways triangles stand out too.
    """
    h, w = mask.shape
    fill = float(mask.sum()) / (h * w)
    return fill, _taper(mask), _taper(mask.T), max(h, w) / min(h, w)


def _taper(mask: np.ndarray) -> float:
    h, w = mask.shape
    half = h // 2
    if half == 0:
        return 0.0
    rows = mask.sum(axis=1).astype(np.float64)
    return float((rows[h - half :].mean() - rows[:half].mean()) / w)


def classify_shape(fill: float, taper: float, side_taper: float, aspect: float) -> str:
    """Name a component's shape from its features (see ``shape_features``), or ``unknown``."""
    if aspect > MAX_ASPECT or abs(side_taper) >= TURNED_MIN_TAPER or taper <= -TURNED_MIN_TAPER:
        return "unknown"
    if taper >= TRIANGLE_MIN_TAPER:
        return "triangle"
    if fill >= SQUARE_MIN_FILL:
        return "square"
    return "circle" if fill >= CIRCLE_MIN_FILL else "unknown"


def detect(image: np.ndarray, tol: float = DEFAULT_TOL, min_area: int | None = None) -> list[Detection]:
    """Find every colored object in ``image`` (uint8 or float [0, 1], HWC or CHW), largest first.

    ``min_area`` defaults to 10 px at 32x32, scaled with the image area.
    """
    classes = classify_pixels(image, tol)
    h, w = classes.shape
    if min_area is None:
        min_area = max(3, round(MIN_AREA_AT_32 * h * w / 1024))
    labels = label_components(classes)
    flat = labels.ravel()
    fg = np.flatnonzero(flat)
    if fg.size == 0:
        return []
    order = fg[np.argsort(flat[fg], kind="stable")]
    splits = np.flatnonzero(np.diff(flat[order])) + 1
    found: list[Detection] = []
    for pixels in np.split(order, splits):
        if pixels.size < min_area:
            continue
        ys, xs = np.divmod(pixels, w)
        x0, x1, y0, y1 = int(xs.min()), int(xs.max()), int(ys.min()), int(ys.max())
        mask = np.zeros((y1 - y0 + 1, x1 - x0 + 1), dtype=bool)
        mask[ys - y0, xs - x0] = True
        fill, taper, side_taper, aspect = shape_features(mask)
        shape = classify_shape(fill, taper, side_taper, aspect)
        color = COLORS[int(classes[ys[0], xs[0]])]
        centroid = (float(xs.mean()) + 0.5, float(ys.mean()) + 0.5)
        found.append(Detection(color, shape, int(pixels.size), centroid, (x0, y0, x1, y1), fill, taper))
    found.sort(key=lambda d: -d.area)
    return found


def _matches(det: Detection, obj: ObjectSpec) -> bool:
    return det.shape == obj.shape and (obj.color is None or det.color == obj.color)


def relation_holds(a: Detection, b: Detection, relation: str, margin: float) -> bool:
    """Whether detection ``a`` is ``relation`` detection ``b`` by centroids, with a margin in pixels."""
    (ax, ay), (bx, by) = a.centroid, b.centroid
    if relation == "left of":
        return ax < bx - margin
    if relation == "right of":
        return ax > bx + margin
    if relation == "above":
        return ay < by - margin
    if relation == "below":
        return ay > by + margin
    raise ValueError(f"unknown relation {relation!r}")


def check(
    spec: SceneSpec, detections: list[Detection], image_size: tuple[int, int], penalize_extra: bool = False
) -> dict[str, bool]:
    """Evaluate every constraint of ``spec`` against detections; keys name the object and the test.

    Per object group ``X`` (its noun, e.g. ``red circle``): ``X/color`` some object has the color,
    ``X/shape`` some object has the shape (both only when a color is named), then ``X/exists`` at
    least one object matches both, or for counting ``X/count`` exactly ``count`` match. Position
    scenes add ``relation/<relation>``: some matching pair satisfies the relation by centroids.
    Objects the scene does not name are ignored (GenEval's semantics) unless ``penalize_extra``
    adds ``scene/no_extra``: no more objects in the image than the scene names in all.
    """
    constraints: dict[str, bool] = {}
    for obj in spec.objects:
        matching = [d for d in detections if _matches(d, obj)]
        if obj.color is not None:
            constraints[f"{obj.noun}/color"] = any(d.color == obj.color for d in detections)
            constraints[f"{obj.noun}/shape"] = any(d.shape == obj.shape for d in detections)
        if spec.category == "counting":
            constraints[f"{obj.noun}/count"] = len(matching) == obj.count
        else:
            constraints[f"{obj.noun}/exists"] = bool(matching)
    if spec.relation is not None:
        h, w = image_size
        margin = RELATION_MARGIN_FRAC * (w if spec.relation in ("left of", "right of") else h)
        first = [d for d in detections if _matches(d, spec.objects[0])]
        second = [d for d in detections if _matches(d, spec.objects[1])]
        constraints[f"relation/{spec.relation}"] = any(
            relation_holds(a, b, spec.relation, margin) for a in first for b in second if a is not b
        )
    if penalize_extra:
        constraints["scene/no_extra"] = len(detections) <= spec.num_objects
    return constraints


def verify(
    spec: SceneSpec,
    image: np.ndarray,
    tol: float = DEFAULT_TOL,
    min_area: int | None = None,
    penalize_extra: bool = False,
) -> Verdict:
    """Check one image (uint8 or float [0, 1], HWC or CHW) against a scene spec (``penalize_extra``: see ``check``).

    Returns a Verdict whose ``strict`` is True only when every constraint holds and whose ``soft`` is
    the fraction of constraints that hold (see ``check`` for the constraint names), a denser reward
    for RL than the strict pass/fail.
    """
    img = as_float_hwc(image)
    detections = detect(img, tol, min_area)
    constraints = check(spec, detections, img.shape[:2], penalize_extra)
    passed = sum(constraints.values())
    return Verdict(passed == len(constraints), passed / len(constraints), constraints, tuple(detections))


class Scored(Protocol):
    """A verifier's verdict on one image (:class:`Verdict`, ``edit_verify.EditVerdict``)."""

    strict: bool
    soft: float


def grouped_scores(
    groups: Sequence[str], verdicts: Sequence[Scored], order: Sequence[str]
) -> dict[str, tuple[float, int]]:
    """``{key: (mean, count)}`` of the strict and soft scores of ``verdicts`` per group and overall
    (``strict/<group>``, ``soft/overall``), the groups in ``order`` (``groups[i]`` is verdict i's). Counts let a
    caller average exactly over batches of different composition; groups absent from the batch are left out;
    ``overall`` is the mean over every verdict."""
    members: dict[str, list[Scored]] = defaultdict(list)
    for group, verdict in zip(groups, verdicts, strict=True):
        members[group].append(verdict)
    members["overall"] = list(verdicts)
    out: dict[str, tuple[float, int]] = {}
    for name in (*order, "overall"):
        if members.get(name):
            n = len(members[name])
            out[f"strict/{name}"] = (float(np.mean([v.strict for v in members[name]])), n)
            out[f"soft/{name}"] = (float(np.mean([v.soft for v in members[name]])), n)
    return out
