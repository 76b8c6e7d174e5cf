"""ShapesWorld renderer: crisp solid shapes on a black canvas, placed to satisfy a SceneSpec.

Shapes are rasterized with numpy pixel-center tests (no anti-aliasing), so every object pixel is an
exact palette color. Each object is a square bounding box of side ``s``: a square fills it, a circle
is inscribed in it, a triangle is upright and isosceles with its apex at the top-center. Bounding
boxes never overlap and keep ``gap`` background pixels between them, which keeps same-colored
objects separate components even after a 3x3 blur.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from unirl_pl.shapes.scenes import COLORS, PALETTE, SceneSpec

# At 32x32 a side of 8..12 px keeps shape classes apart even after a 3x3 blur plus noise (a side-7
# triangle loses its tip), while three objects plus gaps still fit: ~4.5% of random draws are valid,
# so the 500-draw rejection loop essentially never has to shrink objects.
DEFAULT_SIZE = 32
OBJECT_SIZE_AT_32 = (8, 12)
GAP = 2
EDGE_MARGIN = 1
_MAX_TRIES = 500


@dataclass(frozen=True)
class Placement:
    """One drawn object: its color name, shape, bounding box top-left corner and side in pixels."""

    color: str
    shape: str
    x0: int
    y0: int
    side: int


def shape_mask(shape: str, height: int, width: int | None = None) -> np.ndarray:
    """Boolean (height, width) mask of ``shape`` filling that box, sampled at pixel centers.

    A square fills the box, a circle (an ellipse when the box is not square) is inscribed, and a
    triangle is upright and isosceles with its apex at the top-center. The verifier reuses this to
    build the ideal template for a detected component's bounding box.
    """
    width = height if width is None else width
    ys = (np.arange(height) + 0.5)[:, None] / height  # pixel centers in box units [0, 1]
    xs = (np.arange(width) + 0.5)[None, :] / width
    if shape == "square":
        return np.ones((height, width), dtype=bool)
    if shape == "circle":
        return (xs - 0.5) ** 2 + (ys - 0.5) ** 2 <= 0.25
    if shape == "triangle":
        # Apex at (0.5, 0), base along y = 1: half-width grows linearly with depth.
        return np.abs(xs - 0.5) <= ys / 2
    raise ValueError(f"unknown shape {shape!r}")


def _separated(a: Placement, b: Placement, gap: int) -> bool:
    """True when the two bounding boxes are at least ``gap`` background pixels apart on some axis."""
    return (
        a.x0 + a.side + gap <= b.x0
        or b.x0 + b.side + gap <= a.x0
        or a.y0 + a.side + gap <= b.y0
        or b.y0 + b.side + gap <= a.y0
    )


def relation_holds_boxes(a: Placement, b: Placement, relation: str, gap: int) -> bool:
    """Whether box ``a`` is strictly on the ``relation`` side of box ``b`` (extents disjoint by ``gap``)."""
    if relation == "left of":
        return a.x0 + a.side + gap <= b.x0
    if relation == "right of":
        return b.x0 + b.side + gap <= a.x0
    if relation == "above":
        return a.y0 + a.side + gap <= b.y0
    if relation == "below":
        return b.y0 + b.side + gap <= a.y0
    raise ValueError(f"unknown relation {relation!r}")


def layout(
    spec: SceneSpec,
    rng: np.random.Generator,
    size: int = DEFAULT_SIZE,
    object_size: tuple[int, int] | None = None,
    slots: int = 0,
) -> list[Placement]:
    """Choose colors, sizes and non-overlapping positions for every object instance of ``spec``.

    Objects with an unspecified color get a uniform palette color. Positions are rejection-sampled
    until all boxes are separated and, for position scenes, object 0's box lies wholly on the
    relation's side of object 1's box (a far stronger margin than the verifier's centroid test). If
    a layout keeps failing, the largest allowed side shrinks by one and sampling continues.

    ``slots`` > 0 places objects in a ``slots`` x ``slots`` grid of cells instead: each object is
    centered in its own cell (distinct cells drawn uniformly, subject to the relation) with a side of
    the cell minus ``2 * SLOT_MARGIN``. The layout is then one discrete choice per object, which a
    tiny DiT learns to make coherently in minutes; free placement needs far more training.
    """
    if slots:
        return _slot_layout(spec, rng, size, slots)
    lo, hi = object_size or scaled_object_size(size)
    if not 1 <= lo <= hi or hi + 2 * EDGE_MARGIN > size:
        raise ValueError(f"object sizes {lo}..{hi} do not fit a {size}x{size} canvas")
    items: list[tuple[str, str]] = []
    for obj in spec.objects:
        color = obj.color if obj.color is not None else COLORS[int(rng.integers(len(COLORS)))]
        items += [(color, obj.shape)] * obj.count
    while True:
        for _ in range(_MAX_TRIES):
            placed: list[Placement] = []
            for color, shape in items:
                side = int(rng.integers(lo, hi + 1))
                x0, y0 = (int(v) for v in rng.integers(EDGE_MARGIN, size - EDGE_MARGIN - side + 1, size=2))
                placed.append(Placement(color, shape, x0, y0, side))
            ok = all(_separated(a, b, GAP) for i, a in enumerate(placed) for b in placed[i + 1 :])
            if ok and spec.relation is not None:
                ok = relation_holds_boxes(placed[0], placed[1], spec.relation, GAP)
            if ok:
                return placed
        if hi == lo:
            raise RuntimeError(f"cannot lay out {spec} on a {size}x{size} canvas")
        hi -= 1


SLOT_MARGIN = 2


def _slot_layout(spec: SceneSpec, rng: np.random.Generator, size: int, slots: int) -> list[Placement]:
    """Objects centered in distinct cells of a ``slots`` x ``slots`` grid (see ``layout``)."""
    pitch = size // slots
    side = pitch - 2 * SLOT_MARGIN
    items: list[tuple[str, str]] = []
    for obj in spec.objects:
        color = obj.color if obj.color is not None else COLORS[int(rng.integers(len(COLORS)))]
        items += [(color, obj.shape)] * obj.count
    if side < 3 or len(items) > slots * slots:
        raise ValueError(f"{len(items)} objects do not fit {slots}x{slots} slots of a {size}x{size} canvas")
    while True:
        cells = rng.choice(slots * slots, size=len(items), replace=False)
        placed = [
            Placement(
                color, shape, (int(c) % slots) * pitch + SLOT_MARGIN, (int(c) // slots) * pitch + SLOT_MARGIN, side
            )
            for (color, shape), c in zip(items, cells, strict=True)
        ]
        if spec.relation is None or relation_holds_boxes(placed[0], placed[1], spec.relation, GAP):
            return placed


def scaled_object_size(size: int) -> tuple[int, int]:
    """Object side range for a canvas, scaled linearly from the 32x32 calibration."""
    lo, hi = OBJECT_SIZE_AT_32
    return max(3, round(lo * size / DEFAULT_SIZE)), max(3, round(hi * size / DEFAULT_SIZE))


def draw(placements: list[Placement], size: int = DEFAULT_SIZE) -> np.ndarray:
    """Paint placements onto a black (size, size, 3) uint8 canvas."""
    image = np.zeros((size, size, 3), dtype=np.uint8)
    for p in placements:
        mask = shape_mask(p.shape, p.side)
        window = image[p.y0 : p.y0 + p.side, p.x0 : p.x0 + p.side]
        window[mask] = PALETTE[p.color]
    return image


def render(
    spec: SceneSpec,
    rng: np.random.Generator,
    size: int = DEFAULT_SIZE,
    object_size: tuple[int, int] | None = None,
    slots: int = 0,
) -> np.ndarray:
    """Render one ground-truth image of ``spec`` as a (size, size, 3) uint8 array.

    Black background, solid palette-colored shapes with random sides (8..12 px at 32x32, scaled
    for other sizes unless ``object_size`` is given) at random non-overlapping positions that
    satisfy the scene's relation. Deterministic for a given generator state.
    """
    return draw(layout(spec, rng, size, object_size, slots), size)


def render_batch(specs: list[SceneSpec], seed: int, size: int = DEFAULT_SIZE, slots: int = 0) -> np.ndarray:
    """Render many specs as an (N, size, size, 3) uint8 array; image i depends only on (seed, i, spec).

    Each image gets its own generator seeded by ``(seed, i)``, so a shard or a resumed run can
    reproduce any single image without rendering the ones before it.
    """
    out = np.zeros((len(specs), size, size, 3), dtype=np.uint8)
    for i, spec in enumerate(specs):
        out[i] = render(spec, np.random.default_rng((seed, i)), size, slots=slots)
    return out
