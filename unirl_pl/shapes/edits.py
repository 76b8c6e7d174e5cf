"""ShapesWorld-Edit: instructions that change exactly one object of a rendered scene, with splits.

A source scene holds one to three objects, each a distinct color-shape pair (so ``the red circle``
names exactly one object). An edit changes exactly one of them:

=======  ==============================================  ========================================
kind     canonical instruction                           target scene
=======  ==============================================  ========================================
recolor  ``make the red circle blue``                    that object in the new color, in its box
reshape  ``turn the blue square into a triangle``        that object as the new shape, in its box
add      ``add a green circle left of the red square``   a new object on that side of the anchor
remove   ``remove the blue triangle``                    that object gone
move     ``move the red circle below the green square``  that object in a new box on that side
=======  ==============================================  ========================================

Source and target are explicit ``Placement`` lists in which every object the instruction does not name
keeps its placement, so the two renders differ only in the edited object's pixels. A move's source
never satisfies its relation already, so the source image always fails the edit. Held-out
compositions (``is_heldout_edit``) pair the edited color with a new color, shape or relation that
training never shows. ``edit_prompts`` writes the instructions, canonical or paraphrased in train or
held-out phrasings, and parses them back.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from unirl_pl.shapes.edit_prompts import fill_instruction, scene_caption, target_caption
from unirl_pl.shapes.prompts import HELDOUT_BINDINGS
from unirl_pl.shapes.render import (
    DEFAULT_SIZE,
    EDGE_MARGIN,
    GAP,
    SLOT_MARGIN,
    Placement,
    draw,
    relation_holds_boxes,
    scaled_object_size,
    shape_mask,
)
from unirl_pl.shapes.scenes import COLORS, RELATIONS, SHAPES
from unirl_pl.shapes.verify import RELATION_MARGIN_FRAC, Detection, relation_holds, shape_features

EDIT_KINDS: tuple[str, ...] = ("recolor", "reshape", "add", "remove", "move")
EDIT_SPLITS: tuple[str, ...] = ("train", "heldout")
# Object counts of a source scene; add starts smaller so its target keeps to the three objects a 32x32
# canvas holds, and every other kind leaves at least one untouched object for preservation to test.
SOURCE_COUNTS: dict[str, tuple[int, int]] = {kind: (1, 2) if kind == "add" else (2, 3) for kind in EDIT_KINDS}
# Redraws before ``sample_edit`` gives up; a valid draw needs a few at 32x32, so this only stops a canvas or
# split that admits no edit at all from looping forever.
_MAX_DRAWS = 1000

# Held-out compositions, each a (color, value) set: every color and every value still occurs in training.
# recolor (old color, new color): three swaps, both ways, so each color loses one new color and one old one.
HELDOUT_RECOLORS: frozenset[tuple[str, str]] = frozenset(
    {("red", "yellow"), ("yellow", "red"), ("green", "purple"), ("purple", "green"), ("blue", "cyan"), ("cyan", "blue")}
)
# add and move (the placed object's color, relation): red and purple lose "left of", green and cyan
# "right of", blue "above", yellow "below"; every color keeps three relations, every relation four or five colors.
HELDOUT_RELATIONS: frozenset[tuple[str, str]] = frozenset(
    zip(COLORS, ("left of", "right of", "above", "below", "left of", "right of"), strict=True)
)


@dataclass(frozen=True)
class EditSpec:
    """One edit: source and target placements, the edited object and, for add and move, the relation.

    ``index`` is the edited object's position in ``source`` (for add: the new object's, always last in
    ``target``); ``anchor`` is the position, the same in both, of the object the relation refers to.
    """

    kind: str
    source: tuple[Placement, ...]
    target: tuple[Placement, ...]
    index: int
    anchor: int | None = None
    relation: str | None = None
    size: int = DEFAULT_SIZE

    def __post_init__(self) -> None:
        problem = _edit_problem(self)
        if problem is not None:
            raise ValueError(f"invalid {self.kind} edit: {problem}")

    @property
    def edited(self) -> Placement:
        """The edited object as the target shows it (as the source shows it for remove)."""
        return self.source[self.index] if self.kind == "remove" else self.target[self.index]

    @property
    def composition(self) -> tuple[str, str, str]:
        """``(kind, color, value)``: the edited object's source color (the new object's for add) and the new
        color (recolor), new shape (reshape), removed shape (remove) or relation (add, move)."""
        old = self.edited if self.kind == "add" else self.source[self.index]
        value = {"recolor": self.edited.color, "reshape": self.edited.shape, "remove": old.shape}
        return self.kind, old.color, value.get(self.kind, self.relation or "")

    @property
    def instruction(self) -> str:
        """The canonical instruction, e.g. ``make the red circle blue``."""
        return fill_instruction(self.kind, _slots(self))


def _edit_problem(edit: EditSpec) -> str | None:
    """Why ``edit`` is not a change of exactly the named object, or None."""
    src, tgt, i, kind = edit.source, edit.target, edit.index, edit.kind
    if kind not in EDIT_KINDS:
        return f"unknown kind; expected one of {EDIT_KINDS}"
    for scene in (src, tgt):
        if len({(p.color, p.shape) for p in scene}) != len(scene):
            return "objects of a scene must be distinct color-shape pairs"
    if not 0 <= i < len(tgt if kind == "add" else src):
        return f"index {i} out of range"
    if (edit.relation is not None) != (kind in ("add", "move")) or (edit.anchor is None) == (edit.relation is not None):
        return "add and move need an anchor and a relation; other kinds neither"
    if edit.relation is not None and (edit.relation not in RELATIONS or edit.anchor == i):
        return f"bad relation {edit.relation!r} or anchor {edit.anchor}"
    if edit.anchor is not None and not 0 <= edit.anchor < len(src):
        return f"anchor {edit.anchor} out of range"
    if kind == "add" and (tgt[:-1] != src or i != len(src)):
        return "add must append one object to the source"
    if kind == "remove":
        return None if tgt == src[:i] + src[i + 1 :] else "remove must drop exactly the indexed object"
    if kind != "add":
        if len(tgt) != len(src) or tgt[:i] + tgt[i + 1 :] != src[:i] + src[i + 1 :]:
            return "objects other than the edited one must keep their placements"
        changed = {f for f in ("color", "shape", "x0", "y0", "side") if getattr(src[i], f) != getattr(tgt[i], f)}
        allowed = {"recolor": {"color"}, "reshape": {"shape"}, "move": {"x0", "y0"}}[kind]
        if not changed or not changed <= allowed:
            return f"{kind} may change only {sorted(allowed)}, changed {sorted(changed)}"
    if edit.relation is not None and edit.anchor is not None:
        placed, others = tgt[i], tgt[:i] + tgt[i + 1 :]
        if not relation_holds_boxes(placed, tgt[edit.anchor], edit.relation, GAP) or not all(
            _clear(placed, o) for o in others
        ):
            return "the placed object must be clear of the others and wholly on the relation's side of the anchor"
        if kind == "move" and _relation_by_centroids(src[i], src[edit.anchor], edit.relation, edit.size):
            return "the source already satisfies the relation, so the unedited image would pass"
    return None


def _clear(a: Placement, b: Placement) -> bool:
    """Whether two boxes are ``GAP`` apart: one lies wholly on some side of the other (``render.layout``'s rule)."""
    return any(relation_holds_boxes(a, b, r, GAP) for r in RELATIONS)


def _relation_by_centroids(a: Placement, b: Placement, relation: str, size: int) -> bool:
    """The verifier's relation test (``verify.relation_holds``, position scenes' margin) on clean renders."""
    return relation_holds(expected_detection(a), expected_detection(b), relation, RELATION_MARGIN_FRAC * size)


def is_heldout_edit(kind: str, color: str, value: str) -> bool:
    """Whether training never shows this composition (see ``EditSpec.composition``).

    recolor: the (old, new) color pair is in ``HELDOUT_RECOLORS``; reshape and remove: the (color, new or
    removed shape) binding is one of ``prompts.HELDOUT_BINDINGS``; add and move: the (color, relation)
    pair is in ``HELDOUT_RELATIONS``.
    """
    if kind == "recolor":
        return (color, value) in HELDOUT_RECOLORS
    if kind in ("reshape", "remove"):
        return (color, value) in HELDOUT_BINDINGS
    if kind in ("add", "move"):
        return (color, value) in HELDOUT_RELATIONS
    raise ValueError(f"unknown kind {kind!r}; expected one of {EDIT_KINDS}")


def expected_detection(p: Placement) -> Detection:
    """What ``verify.detect`` reports for ``p`` drawn alone on a clean canvas (its centroid is the
    reference position the edit verifier measures displacement from)."""
    mask = shape_mask(p.shape, p.side)
    ys, xs = np.nonzero(mask)
    fill, taper, _, _ = shape_features(mask[ys.min() : ys.max() + 1, xs.min() : xs.max() + 1])
    # Canvas coordinates before the mean, as ``detect`` sums them, so the centroid matches it bit for bit.
    centroid = (float((xs + p.x0).mean()) + 0.5, float((ys + p.y0).mean()) + 0.5)
    bbox = (p.x0 + int(xs.min()), p.y0 + int(ys.min()), p.x0 + int(xs.max()), p.y0 + int(ys.max()))
    return Detection(p.color, p.shape, int(mask.sum()), centroid, bbox, fill, taper)


def _place(
    rng: np.random.Generator,
    item: tuple[str, str],
    others: tuple[Placement, ...],
    size: int,
    slots: int,
    side: int | None = None,
    relation: tuple[str, Placement] | None = None,
) -> Placement | None:
    """A box for ``item`` (color, shape) at least ``GAP`` from every box of ``others`` and, given
    ``relation`` (relation, anchor), wholly on that side of the anchor; None when nothing fits.

    Drawn uniformly among every fitting position: the cells of a ``slots`` x ``slots`` grid (as in
    ``render.layout``), or every top-left corner for a side drawn from ``render.layout``'s range (unless
    ``side`` is given). Enumerating the positions, rather than rejection sampling them, says at once
    when none fits (an anchor at the left edge has nothing left of it).
    """
    if slots:
        pitch = size // slots
        side = pitch - 2 * SLOT_MARGIN
        cells = np.arange(slots * slots)
        x0, y0 = cells % slots * pitch + SLOT_MARGIN, cells // slots * pitch + SLOT_MARGIN
    else:
        lo, hi = scaled_object_size(size)
        side = int(rng.integers(lo, hi + 1)) if side is None else side
        span = np.arange(EDGE_MARGIN, size - EDGE_MARGIN - side + 1)
        y0, x0 = (grid.ravel() for grid in np.meshgrid(span, span, indexing="ij"))
    # ``relation_holds_boxes`` is plain arithmetic, so one call tests every candidate corner at once.
    boxes = Placement(*item, x0, y0, side)  # type: ignore[arg-type]
    ok = np.ones(x0.shape, dtype=bool)
    for other in others:
        ok &= np.any([relation_holds_boxes(boxes, other, r, GAP) for r in RELATIONS], axis=0)
    if relation is not None:
        ok &= relation_holds_boxes(boxes, relation[1], relation[0], GAP)
    fitting = np.flatnonzero(ok)
    if fitting.size == 0:
        return None
    k = int(fitting[rng.integers(fitting.size)])
    return Placement(*item, int(x0[k]), int(y0[k]), side)


def _draw_edit(
    rng: np.random.Generator, kind: str, src: tuple[Placement, ...], heldout: bool, size: int, slots: int
) -> EditSpec | None:
    """One edit of ``kind`` on ``src`` whose composition is held out iff ``heldout``, or None if none fits."""

    def choose(options: list[Any]) -> Any:
        return options[int(rng.integers(len(options)))] if options else None

    used = {(p.color, p.shape) for p in src}
    n = len(src)
    if kind == "add":
        item = choose([(c, s) for c in COLORS for s in SHAPES if (c, s) not in used])
        j = int(rng.integers(n))
        rel = choose([r for r in RELATIONS if is_heldout_edit(kind, item[0], r) == heldout])
        new = _place(rng, item, src, size, slots, relation=(rel, src[j])) if rel else None
        return EditSpec(kind, src, (*src, new), n, j, rel, size) if new else None
    if kind == "remove":
        i = choose([k for k, p in enumerate(src) if is_heldout_edit(kind, p.color, p.shape) == heldout])
        return None if i is None else EditSpec(kind, src, src[:i] + src[i + 1 :], i, size=size)
    i = int(rng.integers(n))
    old = src[i]
    if kind in ("recolor", "reshape"):
        field, pool = ("color", COLORS) if kind == "recolor" else ("shape", SHAPES)
        options = [replace(old, **{field: v}) for v in pool if v != getattr(old, field)]
        fits = [
            q
            for q in options
            if (q.color, q.shape) not in used and is_heldout_edit(kind, old.color, getattr(q, field)) == heldout
        ]
        new = choose(fits)
        return None if new is None else EditSpec(kind, src, src[:i] + (new,) + src[i + 1 :], i, size=size)
    j = choose([k for k in range(n) if k != i])
    # The source must fail the relation the verifier checks, or the unedited image would pass.
    rel = choose(
        [
            r
            for r in RELATIONS
            if is_heldout_edit(kind, old.color, r) == heldout and not _relation_by_centroids(old, src[j], r, size)
        ]
    )
    others = src[:i] + src[i + 1 :]
    new = _place(rng, (old.color, old.shape), others, size, slots, old.side, (rel, src[j])) if rel else None
    return EditSpec(kind, src, src[:i] + (new,) + src[i + 1 :], i, j, rel, size) if new else None


def sample_edit(
    rng: np.random.Generator, kind: str, split: str = "train", size: int = DEFAULT_SIZE, slots: int = 0
) -> EditSpec:
    """Draw an edit of ``kind`` whose composition is a train one (``split="train"``) or held out (``"heldout"``).

    The source's objects are distinct color-shape pairs placed one at a time (``_place``: sides 8..12 px at
    32x32 as in ``render.layout``, or the cells of a ``slots`` x ``slots`` grid), then the edited object, its
    new attribute and (add, move) the anchor and relation are drawn uniformly among those of the split; a
    draw that fits nothing starts over (RuntimeError after ``_MAX_DRAWS``). Deterministic for a given generator state.
    """
    if kind not in EDIT_KINDS:
        raise ValueError(f"unknown kind {kind!r}; expected one of {EDIT_KINDS}")
    if split not in EDIT_SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {EDIT_SPLITS}")
    pairs = [(c, s) for c in COLORS for s in SHAPES]
    lo, hi = SOURCE_COUNTS[kind]
    for _ in range(_MAX_DRAWS):
        src: tuple[Placement, ...] = ()
        for k in rng.choice(len(pairs), size=int(rng.integers(lo, hi + 1)), replace=False):
            placed = _place(rng, pairs[int(k)], src, size, slots)
            if placed is None:
                break
            src = (*src, placed)
        else:
            edit = _draw_edit(rng, kind, src, split == "heldout", size, slots)
            if edit is not None:
                return edit
    raise RuntimeError(f"no {split} {kind} edit fits a {size}x{size} canvas (slots={slots}) in {_MAX_DRAWS} draws")


def _slots(edit: EditSpec) -> dict[str, tuple[str, ...]]:
    """The canonical words of every slot an instruction of ``edit`` can use (``edit_prompts.SLOT_WORDS``)."""
    new = edit.edited
    old = new if edit.kind == "add" else edit.source[edit.index]
    slots = {
        "obj": (old.color, old.shape),
        "color": (new.color,),
        "shape": (new.shape,),
        "new": ("a", new.color, new.shape),
    }
    if edit.anchor is not None and edit.relation is not None:
        slots |= {"rel": (edit.relation,), "anchor": (edit.target[edit.anchor].color, edit.target[edit.anchor].shape)}
    return slots


def paraphrase_edit(edit: EditSpec, rng: np.random.Generator, phrasing: str) -> str:
    """A user instruction for ``edit`` in ``phrasing`` (``train`` or ``heldout``; see ``edit_prompts``)."""
    return fill_instruction(edit.kind, _slots(edit), rng, phrasing)


def render_source(edit: EditSpec) -> np.ndarray:
    """The source image, (size, size, 3) uint8 like ``render.render``."""
    return draw(list(edit.source), edit.size)


def render_target(edit: EditSpec) -> np.ndarray:
    """The target image: pixel-identical to the source outside the edited object's boxes."""
    return draw(list(edit.target), edit.size)


def edit_row(edit: EditSpec, prompt: str) -> dict[str, Any]:
    """A JSON-able row: the prompt, the canonical texts, the composition and everything ``edit_of`` needs."""
    kind, color, value = edit.composition
    return {
        "prompt": prompt,
        "instruction": edit.instruction,
        "kind": kind,
        "source": scene_caption(edit.source),
        "target": target_caption(edit.target, edit.index, edit.anchor, edit.relation),
        "color": color,
        "value": value,
        "index": edit.index,
        "anchor": edit.anchor,
        "relation": edit.relation,
        "size": edit.size,
        "source_placements": [[p.color, p.shape, p.x0, p.y0, p.side] for p in edit.source],
        "target_placements": [[p.color, p.shape, p.x0, p.y0, p.side] for p in edit.target],
    }


def edit_of(row: dict[str, Any]) -> EditSpec:
    """The EditSpec a row of ``make_edit_set`` (or its JSON) describes."""
    source = tuple(Placement(*p) for p in row["source_placements"])
    target = tuple(Placement(*p) for p in row["target_placements"])
    return EditSpec(row["kind"], source, target, row["index"], row["anchor"], row["relation"], row["size"])


def make_edit_set(
    n: int, seed: int, split: str, phrasing: str | None = None, size: int = DEFAULT_SIZE, slots: int = 0
) -> list[dict[str, Any]]:
    """Build ``n`` rows (``edit_row``) with kinds balanced round-robin (row i: ``EDIT_KINDS[i % 5]``).

    ``split`` picks the compositions and, unless ``phrasing`` is given, the phrasing too: ``phrasing="train"``
    with ``split="heldout"`` asks for new compositions in known words. One generator seeded by ``seed``
    draws everything, so the same arguments always give the same rows (and, through the placements, images).
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        edit = sample_edit(rng, EDIT_KINDS[i % len(EDIT_KINDS)], split, size, slots)
        rows.append(edit_row(edit, paraphrase_edit(edit, rng, phrasing or split)))
    return rows
