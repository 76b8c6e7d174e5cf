"""ShapesWorld-Edit: edit specs, splits, instructions and the edit verifier's target and preservation checks."""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

import numpy as np
import pytest

from unirl_pl.shapes import (
    COLORS,
    EDIT_KINDS,
    PALETTE,
    RELATIONS,
    SHAPES,
    EditSpec,
    detect,
    edit_breakdown,
    edit_of,
    is_heldout_edit,
    make_edit_set,
    parse_caption,
    parse_instruction,
    render_source,
    render_target,
    sample_edit,
    verify_edit,
)
from unirl_pl.shapes import prompts as P
from unirl_pl.shapes.edits import expected_detection
from unirl_pl.shapes.render import Placement, draw, relation_holds_boxes
from unirl_pl.shapes.verify import relation_holds

OPPOSITE = {"left of": "right of", "right of": "left of", "above": "below", "below": "above"}
# The split rule written out independently of the module: (kind, edited color, value) pairs held out.
HELDOUT_BINDINGS = {
    ("red", "triangle"),
    ("yellow", "triangle"),
    ("green", "circle"),
    ("purple", "circle"),
    ("blue", "square"),
    ("cyan", "square"),
}
HELDOUT_RELATIONS = {
    ("red", "left of"),
    ("green", "right of"),
    ("blue", "above"),
    ("yellow", "below"),
    ("purple", "left of"),
    ("cyan", "right of"),
}
HELDOUT_RECOLORS = {("red", "yellow"), ("green", "purple"), ("blue", "cyan")}
HELDOUT: dict[str, set[tuple[str, str]]] = {
    "recolor": HELDOUT_RECOLORS | {(new, old) for old, new in HELDOUT_RECOLORS},
    "reshape": HELDOUT_BINDINGS,
    "remove": HELDOUT_BINDINGS,
    "add": HELDOUT_RELATIONS,
    "move": HELDOUT_RELATIONS,
}


@pytest.fixture(scope="module")
def edits() -> list[EditSpec]:
    rows = make_edit_set(60, seed=7, split="train") + make_edit_set(40, seed=8, split="heldout")
    return [edit_of(row) for row in rows]


def _composition(edit: EditSpec) -> tuple[str, str]:
    """(edited color, value) read off the placements, not from the module's own bookkeeping."""
    if edit.kind == "add":
        return edit.target[edit.index].color, str(edit.relation)
    old = edit.source[edit.index]
    if edit.kind == "remove":
        return old.color, old.shape
    new = edit.target[edit.index]
    return old.color, {"recolor": new.color, "reshape": new.shape, "move": str(edit.relation)}[edit.kind]


def _noun(p: Placement) -> str:
    return f"{p.color} {p.shape}"


def _canonical(edit: EditSpec) -> str:
    """The canonical instruction spelled out from the placements."""
    if edit.kind == "add":
        new, anchor = edit.target[edit.index], edit.target[edit.anchor]
        return f"add a {_noun(new)} {edit.relation} the {_noun(anchor)}"
    old = edit.source[edit.index]
    if edit.kind == "remove":
        return f"remove the {_noun(old)}"
    new = edit.target[edit.index]
    if edit.kind == "recolor":
        return f"make the {_noun(old)} {new.color}"
    if edit.kind == "reshape":
        return f"turn the {_noun(old)} into a {new.shape}"
    return f"move the {_noun(old)} {edit.relation} the {_noun(edit.target[edit.anchor])}"


def _apart(a: Placement, b: Placement, gap: int) -> bool:
    return any(relation_holds_boxes(a, b, r, gap) for r in RELATIONS)


def _wrong_side(edit: EditSpec) -> tuple[Placement | None, bool]:
    """A box for the added or moved object clear of the others where its relation to the anchor fails by
    centroids: on the opposite side if there is room (second value True), else anywhere that fails."""
    p, anchor = edit.target[edit.index], edit.target[edit.anchor]
    others = [q for k, q in enumerate(edit.target) if k != edit.index]
    fallback = None
    for y0 in range(1, edit.size - p.side):
        for x0 in range(1, edit.size - p.side):
            box = dataclasses.replace(p, x0=x0, y0=y0)
            if not all(_apart(box, q, 2) for q in others):
                continue
            if relation_holds_boxes(box, anchor, OPPOSITE[edit.relation], 2):
                return box, True
            if fallback is None and not relation_holds(
                expected_detection(box), expected_detection(anchor), edit.relation, 2.0
            ):
                fallback = box
    return fallback, False


def _fresh(edit: EditSpec) -> list[tuple[str, str]]:
    """Color-shape pairs that occur in neither the source nor the target (so a stray cannot pass for one)."""
    used = {(p.color, p.shape) for p in (*edit.source, *edit.target)}
    return [(c, s) for c in COLORS for s in SHAPES if (c, s) not in used]


# ---------------------------------------------------------------- specs and images


def test_target_scores_one_and_the_unedited_source_fails_for_every_kind(edits: list[EditSpec]) -> None:
    seen = set()
    for edit in edits:
        target = verify_edit(edit, render_target(edit))
        assert target.strict and target.soft == 1.0 and target.target and target.preserved, (edit, target)
        source = verify_edit(edit, render_source(edit))
        # The edit was not done: some target constraint fails, whatever preservation says.
        assert not source.strict and source.soft < 1.0 and not source.target, (edit, source)
        # Only remove's source has an object too many; every other source keeps what the target keeps.
        assert source.preserved == (edit.kind != "remove"), (edit, source)
        seen.add(edit.kind)
    assert seen == set(EDIT_KINDS)


def test_untouched_objects_are_pixel_identical_and_the_edit_changes_pixels(edits: list[EditSpec]) -> None:
    for edit in edits:
        src, tgt = render_source(edit), render_target(edit)
        outside = np.ones(src.shape[:2], dtype=bool)
        changed = [edit.edited] if edit.kind == "add" else [edit.source[edit.index], edit.edited]
        for p in changed:
            outside[p.y0 : p.y0 + p.side, p.x0 : p.x0 + p.side] = False
        assert np.array_equal(src[outside], tgt[outside]), edit
        assert not np.array_equal(src, tgt), edit
        untouched = [p for k, p in enumerate(edit.target) if edit.kind == "remove" or k != edit.index]
        assert all(p in edit.source for p in untouched), edit


def test_expected_detection_is_what_detect_reports() -> None:
    for k, (color, shape) in enumerate((c, s) for c in COLORS for s in SHAPES):
        for side in (8, 11, 12):
            p = Placement(color, shape, 3 + k % 9, 2 + side % 5, side)
            assert detect(draw([p])) == [expected_detection(p)], p


def test_edit_spec_rejects_edits_that_change_more_than_the_named_object() -> None:
    a, b = Placement("red", "circle", 2, 2, 10), Placement("blue", "square", 18, 2, 10)
    moved_b = dataclasses.replace(b, x0=17)
    assert EditSpec("recolor", (a, b), (dataclasses.replace(a, color="green"), b), 0).instruction == (
        "make the red circle green"
    )
    bad = {
        "recolor also reshapes": ("recolor", (dataclasses.replace(a, color="green", shape="square"), b), 0, None, None),
        "recolor moves another": ("recolor", (dataclasses.replace(a, color="green"), moved_b), 0, None, None),
        "reshape changes nothing": ("reshape", (a, b), 0, None, None),
        "move resizes": ("move", (a, dataclasses.replace(b, y0=18, side=9)), 1, 0, "below"),
        "remove the other one": ("remove", (a,), 0, None, None),
        "add needs a relation": ("add", (a, b, Placement("green", "triangle", 2, 18, 10)), 2, None, None),
        "added box overlaps": ("add", (a, b, Placement("green", "triangle", 14, 4, 10)), 2, 0, "right of"),
        "added box on the wrong side": ("add", (a, b, Placement("green", "triangle", 2, 18, 10)), 2, 0, "above"),
        "unknown kind": ("blur", (a, b), 0, None, None),
    }
    for name, (kind, target, index, anchor, relation) in bad.items():
        with pytest.raises(ValueError, match="invalid"):
            EditSpec(kind, (a, b), target, index, anchor, relation)
            pytest.fail(name)
    # Each scene's objects must be distinct color-shape pairs, or "the blue circle" names two objects.
    blue_circle = Placement("blue", "circle", 18, 18, 10)
    with pytest.raises(ValueError, match="distinct"):
        EditSpec("recolor", (a, blue_circle), (dataclasses.replace(a, color="blue"), blue_circle), 0)
    # A move whose source already satisfies the relation would let the unedited image pass.
    with pytest.raises(ValueError, match="already satisfies"):
        EditSpec("move", (a, b), (a, dataclasses.replace(b, y0=16)), 1, 0, "right of")
    assert EditSpec("move", (a, b), (dataclasses.replace(a, y0=16), b), 0, 1, "below").instruction == (
        "move the red circle below the blue square"
    )


def test_slot_grid_edits_stay_in_cells_and_verify() -> None:
    for row in make_edit_set(25, seed=3, split="train", slots=2):
        edit = edit_of(row)
        assert all(p.side == 12 and p.x0 in (2, 18) and p.y0 in (2, 18) for p in (*edit.source, *edit.target))
        assert verify_edit(edit, render_target(edit)).strict and not verify_edit(edit, render_source(edit)).strict


# ---------------------------------------------------------------- the verifier


def test_wrong_edits_fail(edits: list[EditSpec]) -> None:
    seen: dict[str, int] = {}

    def fails(name: str, edit: EditSpec, placements: list[Placement]) -> None:
        verdict = verify_edit(edit, draw(placements, edit.size))
        assert not verdict.strict and not verdict.target and verdict.soft < 1.0, (name, edit, verdict)
        seen[name] = seen.get(name, 0) + 1

    for edit in edits:
        i, tgt = edit.index, list(edit.target)
        if edit.kind == "recolor":
            old, new = edit.source[i], tgt[i]
            wrong = [c for c in COLORS if c not in (old.color, new.color) and (c, old.shape) in _fresh(edit)]
            if wrong:
                fails("wrong color", edit, [*tgt[:i], dataclasses.replace(new, color=wrong[0]), *tgt[i + 1 :]])
        if edit.kind == "reshape":
            new = tgt[i]
            wrong = [s for s in SHAPES if (new.color, s) in _fresh(edit)]
            if wrong:
                fails("wrong shape", edit, [*tgt[:i], dataclasses.replace(new, shape=wrong[0]), *tgt[i + 1 :]])
        if edit.kind == "remove":
            for k in range(len(edit.source)):
                if k != i:
                    fails("removed the wrong object", edit, [p for j, p in enumerate(edit.source) if j != k])
        if edit.kind in ("add", "move"):
            box, opposite = _wrong_side(edit)
            if box is not None:
                fails(f"{edit.kind} on a wrong side", edit, [*tgt[:i], box, *tgt[i + 1 :]])
                seen["on the opposite side"] = seen.get("on the opposite side", 0) + opposite
            if edit.kind == "add":
                color = next(c for c in COLORS if (c, tgt[i].shape) in _fresh(edit))
                fails("added the wrong color", edit, [*tgt[:i], dataclasses.replace(tgt[i], color=color)])
    assert min(seen.values()) >= 3 and len(seen) == 7, seen


def test_an_edit_that_also_changes_another_object_fails_preservation(edits: list[EditSpec]) -> None:
    seen: dict[str, int] = {}
    for edit in edits:
        image = render_target(edit)
        for k, p in enumerate(edit.target):
            if (edit.kind != "remove" and k == edit.index) or k == edit.anchor:
                continue  # the edited object and the relation's anchor are the target's business
            box = (slice(p.y0, p.y0 + p.side), slice(p.x0, p.x0 + p.side))
            others = [q for j, q in enumerate(edit.target) if j != k]
            collateral: dict[str, np.ndarray] = {}
            erased = image.copy()
            erased[box] = 0
            collateral["erased by pixels"] = erased
            color, _ = next((c, s) for c, s in _fresh(edit) if s == p.shape)
            repainted = image.copy()
            repainted[box][np.any(image[box] > 0, axis=-1)] = PALETTE[color]
            collateral["recolored by pixels"] = repainted
            for dx, dy in ((3, 0), (-3, 0), (0, 3), (0, -3)):
                shifted = dataclasses.replace(p, x0=p.x0 + dx, y0=p.y0 + dy)
                inside = 0 <= shifted.x0 and shifted.x0 + p.side <= edit.size and 0 <= shifted.y0
                if inside and shifted.y0 + p.side <= edit.size and all(_apart(shifted, q, 1) for q in others):
                    collateral["shifted 3 px"] = draw([*others, shifted], edit.size)
                    # One pixel is within the tolerance: a generator may draw an untouched object a pixel off.
                    nudged = dataclasses.replace(p, x0=p.x0 + dx // 3, y0=p.y0 + dy // 3)
                    assert verify_edit(edit, draw([*others, nudged], edit.size)).strict, (edit, nudged)
                    break
            for name, bad in collateral.items():
                verdict = verify_edit(edit, bad)
                assert verdict.target and not verdict.preserved, (name, edit, verdict)
                assert not verdict.strict and verdict.soft < 1.0 and not verdict.constraints[f"keep/{_noun(p)}"]
                seen[f"{edit.kind}: {name}"] = seen.get(f"{edit.kind}: {name}", 0) + 1
    assert {key.split(":")[0] for key in seen} == set(EDIT_KINDS), seen
    assert {key.split(": ")[1] for key in seen} == {"erased by pixels", "recolored by pixels", "shifted 3 px"}


def test_a_stray_or_duplicated_object_fails_preservation(edits: list[EditSpec]) -> None:
    checked = 0
    for edit in edits:
        stray = next(
            (
                Placement(c, s, x0, y0, 8)
                for c, s in _fresh(edit)[:1]
                for y0 in range(1, edit.size - 8)
                for x0 in range(1, edit.size - 8)
                if all(_apart(Placement(c, s, x0, y0, 8), q, 2) for q in edit.target)
            ),
            None,
        )
        if stray is None:
            continue
        verdict = verify_edit(edit, draw([*edit.target, stray], edit.size))
        failed = {name for name, ok in verdict.constraints.items() if not ok}
        assert failed == {"keep/no_extra"} and not verdict.strict and verdict.soft < 1.0, (edit, verdict)
        checked += 1
    assert checked >= 50
    # A move that copies the object instead of moving it leaves the original behind.
    move = next(e for e in edits if e.kind == "move" and _apart(e.source[e.index], e.target[e.index], 2))
    verdict = verify_edit(move, draw([*move.target, move.source[move.index]], move.size))
    assert verdict.target and not verdict.constraints["keep/no_extra"] and not verdict.strict


def test_verify_edit_accepts_float_chw_and_checks_the_size(edits: list[EditSpec]) -> None:
    edit = edits[0]
    chw = render_target(edit).transpose(2, 0, 1).astype(np.float32) / 255.0
    assert verify_edit(edit, chw).strict
    with pytest.raises(ValueError, match="32x32"):
        verify_edit(edit, np.zeros((16, 16, 3), dtype=np.uint8))


def test_edit_breakdown_per_kind_and_overall(edits: list[EditSpec]) -> None:
    batch = [e for e in edits if e.kind in ("recolor", "move")][:8]
    done = [(k // 2) % 2 == 0 for k in range(len(batch))]  # each kind: an edited image, then its source
    images = [render_target(e) if ok else render_source(e) for e, ok in zip(batch, done, strict=True)]
    out = edit_breakdown(batch, images)
    expected = {e.kind: [ok for f, ok in zip(batch, done, strict=True) if f.kind == e.kind] for e in batch}
    assert set(out) == {f"{m}/{k}" for m in ("strict", "soft") for k in (*expected, "overall")}
    for kind, passed in expected.items():
        assert out[f"strict/{kind}"] == (pytest.approx(np.mean(passed)), len(passed))
        assert out[f"soft/{kind}"][0] > out[f"strict/{kind}"][0]  # the sources meet part of the constraints
    assert out["strict/overall"] == (0.5, 8)
    with pytest.raises(ValueError):
        edit_breakdown(batch, images[:-1])


# ---------------------------------------------------------------- splits, rows and instructions


def test_splits_hold_out_compositions_and_keep_every_value_in_training() -> None:
    assert is_heldout_edit("recolor", "red", "yellow") and not is_heldout_edit("recolor", "red", "blue")
    assert is_heldout_edit("reshape", "blue", "square") and not is_heldout_edit("reshape", "blue", "circle")
    assert is_heldout_edit("move", "blue", "above") and not is_heldout_edit("add", "blue", "below")
    values: dict[str, set[str]] = {kind: set() for kind in EDIT_KINDS}
    for split, n, seed in (("train", 300, 1), ("heldout", 150, 2)):
        rows = make_edit_set(n, seed=seed, split=split)
        assert [r["kind"] for r in rows[:5]] == list(EDIT_KINDS)
        for row in rows:
            composition = _composition(edit_of(row))
            assert (row["color"], row["value"]) == composition, row
            assert (composition in HELDOUT[row["kind"]]) == (split == "heldout"), row
            assert is_heldout_edit(row["kind"], *composition) == (split == "heldout"), row
            if split == "train":
                values[row["kind"]].add(composition[1])
    # Held-out compositions pair known things: every color, shape and relation still occurs in training.
    assert values["recolor"] == set(COLORS) and values["add"] == values["move"] == set(RELATIONS), values
    assert values["reshape"] == values["remove"] == set(SHAPES), values


def test_edit_set_is_deterministic_and_json_round_trips() -> None:
    rows = make_edit_set(15, seed=4, split="heldout")
    assert rows == make_edit_set(15, seed=4, split="heldout")
    assert rows != make_edit_set(15, seed=5, split="heldout")
    again = json.loads(json.dumps(rows))
    for row, loaded in zip(rows, again, strict=True):
        assert edit_of(loaded) == edit_of(row)
        assert np.array_equal(render_source(edit_of(loaded)), render_source(edit_of(row)))
        assert np.array_equal(render_target(edit_of(loaded)), render_target(edit_of(row)))
    a, b = np.random.default_rng(6), np.random.default_rng(6)
    assert [sample_edit(a, k) for k in EDIT_KINDS] == [sample_edit(b, k) for k in EDIT_KINDS]
    with pytest.raises(ValueError, match="split"):
        sample_edit(a, "recolor", "test")
    with pytest.raises(RuntimeError, match="no train move edit fits"):
        sample_edit(a, "move", slots=1)  # one cell holds one object: nothing to move it beside


def _rows_both_phrasings() -> list[dict[str, Any]]:
    return make_edit_set(100, seed=12, split="train") + make_edit_set(100, seed=12, split="heldout")


def test_instructions_parse_back_and_name_the_edited_object() -> None:
    for row in _rows_both_phrasings():
        edit = edit_of(row)
        assert row["instruction"] == _canonical(edit), row
        assert parse_instruction(row["prompt"]) == (row["kind"], row["instruction"]), row
        for caption, scene in ((row["source"], edit.source), (row["target"], edit.target)):
            assert caption.count(" a ") + 1 == len(scene) and all(f"a {_noun(p)}" in caption for p in scene), row
        if edit.relation is not None and len(edit.target) == 2:
            # Two-object targets of add and move are position captions: the edited object, the relation, the anchor.
            spec = parse_caption(row["target"])
            assert (spec.relation, spec.objects[0].noun) == (edit.relation, _noun(edit.edited)), row
    for text in ("make the red elephant blue", "remove the red circle please", "paint it black"):
        with pytest.raises(ValueError, match=re.escape(text)):
            parse_instruction(text)


def test_heldout_phrasing_uses_words_train_never_does() -> None:
    def words(rows: list[dict[str, Any]]) -> list[set[str]]:
        return [set(r["prompt"].split()) for r in rows]

    train = words(make_edit_set(500, seed=21, split="train"))
    train_vocab = set().union(*train)
    heldout = words(make_edit_set(120, seed=22, split="heldout"))
    # Every held-out instruction has a template or synonym no train instruction uses.
    assert all(w - train_vocab for w in heldout), [sorted(w) for w in heldout if not w - train_vocab][:3]
    # New compositions in known words: the held-out split phrased with the train pool.
    known = words(make_edit_set(120, seed=22, split="heldout", phrasing="train"))
    assert all(w <= train_vocab for w in known), [sorted(w - train_vocab) for w in known if w - train_vocab][:3]
    # Word by word: held-out instructions name colors and shapes only by held-out synonyms, train ones never do.
    train_words, heldout_words = set(COLORS) | set(SHAPES), set()
    for train_pool, heldout_pool in P.COLOR_SYNONYMS.values():
        train_words |= set(train_pool)
        heldout_words |= set(heldout_pool)
    for train_pool, heldout_pool in P.SHAPE_SYNONYMS.values():
        train_words |= {singular for singular, _ in train_pool}
        heldout_words |= {singular for singular, _ in heldout_pool}
    assert all(not w & train_words and w & heldout_words for w in heldout)
    assert not heldout_words & train_vocab and train_words <= train_vocab
    assert {"atop", "erase", "relocate"} <= set().union(*heldout) and not {"atop", "erase", "relocate"} & train_vocab
