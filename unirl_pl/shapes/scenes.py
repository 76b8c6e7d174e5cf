"""ShapesWorld scene specs: the vocabulary, the canonical caption grammar and its inverse.

A scene is one or two object groups (a color, a shape and a count) plus an optional spatial relation,
tagged with one of GenEval's six categories. The category is always recoverable from the caption, so
``parse_caption(caption(spec)) == spec`` holds for every valid spec:

==============  =====================================  ==========================================
category        caption                                what it tests
==============  =====================================  ==========================================
single_object   ``a circle``                           one shape is present (color unspecified)
colors          ``a red circle``                       the shape is present in the named color
counting        ``three blue squares`` (count 2 or 3)  exactly that many of the named kind
two_object      ``a circle and a square``              two distinct shapes both present
color_attr      ``a red circle and a blue square``     each color bound to its own shape
position        ``a red circle left of a blue square`` both present and the relation holds
==============  =====================================  ==========================================
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

# The six non-black, non-white corners of the RGB cube: every pair is at least 255 apart (Euclidean,
# 0-255 scale) and so is every color from the black background, which keeps the verifier's
# nearest-palette rule robust to noisy or blurry generated pixels. "purple" is rendered as magenta and
# cyan replaces orange, whose natural RGB sits only ~128 from both red and yellow.
PALETTE: dict[str, tuple[int, int, int]] = {
    "red": (255, 0, 0),
    "green": (0, 255, 0),
    "blue": (0, 0, 255),
    "yellow": (255, 255, 0),
    "purple": (255, 0, 255),
    "cyan": (0, 255, 255),
}
COLORS: tuple[str, ...] = tuple(PALETTE)
SHAPES: tuple[str, ...] = ("circle", "square", "triangle")
RELATIONS: tuple[str, ...] = ("left of", "right of", "above", "below")
CATEGORIES: tuple[str, ...] = ("single_object", "two_object", "counting", "colors", "position", "color_attr")
MAX_COUNT = 3
COUNT_WORDS: dict[int, str] = {1: "a", 2: "two", 3: "three"}
PLURALS: dict[str, str] = {shape: shape + "s" for shape in SHAPES}

_WORD_COUNTS = {word: count for count, word in COUNT_WORDS.items()}
_SINGULARS = {plural: shape for shape, plural in PLURALS.items()}


@dataclass(frozen=True)
class ObjectSpec:
    """One group of identical objects: ``count`` shapes of one color (``None`` = any color)."""

    color: str | None
    shape: str
    count: int = 1

    def __post_init__(self) -> None:
        if self.color is not None and self.color not in PALETTE:
            raise ValueError(f"unknown color {self.color!r}; expected one of {COLORS}")
        if self.shape not in SHAPES:
            raise ValueError(f"unknown shape {self.shape!r}; expected one of {SHAPES}")
        if not 1 <= self.count <= MAX_COUNT:
            raise ValueError(f"count must be in 1..{MAX_COUNT}, got {self.count}")

    @property
    def noun(self) -> str:
        """The object without its quantity word, e.g. ``red circle`` or ``circle``."""
        return self.shape if self.color is None else f"{self.color} {self.shape}"


@dataclass(frozen=True)
class SceneSpec:
    """A scene: its object groups, an optional relation (object 0 <relation> object 1) and its category."""

    objects: tuple[ObjectSpec, ...]
    relation: str | None
    category: str

    @property
    def num_objects(self) -> int:
        """How many objects the scene names in all (counts included)."""
        return sum(obj.count for obj in self.objects)

    def __post_init__(self) -> None:
        problem = _category_problem(self)
        if problem is not None:
            raise ValueError(f"invalid {self.category} scene {self.objects!r} relation={self.relation!r}: {problem}")


def _category_problem(spec: SceneSpec) -> str | None:
    """Why ``spec`` breaks its category's rules, or None; kept apart so the rules read as one table."""
    objs, cat = spec.objects, spec.category
    if cat not in CATEGORIES:
        return f"unknown category; expected one of {CATEGORIES}"
    if not isinstance(objs, tuple) or not all(isinstance(o, ObjectSpec) for o in objs):
        return "objects must be a tuple of ObjectSpec"
    n_expected = 1 if cat in ("single_object", "colors", "counting") else 2
    if len(objs) != n_expected:
        return f"needs {n_expected} object(s), got {len(objs)}"
    if (spec.relation is not None) != (cat == "position"):
        return "a relation is required for position scenes and forbidden otherwise"
    if spec.relation is not None and spec.relation not in RELATIONS:
        return f"unknown relation; expected one of {RELATIONS}"
    if cat == "counting":
        if objs[0].count < 2 or objs[0].color is None:
            return "counting needs a colored object with count 2 or 3"
        return None
    if any(o.count != 1 for o in objs):
        return "only counting scenes may have count > 1"
    colored = [o.color is not None for o in objs]
    # Color presence is what tells these categories apart in the caption, so it must be uniform.
    if cat in ("single_object", "two_object") and any(colored):
        return "colors must be unspecified"
    if cat in ("colors", "color_attr", "position") and not all(colored):
        return "every object needs a color"
    if cat == "two_object" and objs[0].shape == objs[1].shape:
        return "the two shapes must differ"
    if cat == "color_attr" and (objs[0].shape == objs[1].shape or objs[0].color == objs[1].color):
        return "colors and shapes must both differ, or the binding is untestable"
    if cat == "position" and objs[0] == objs[1]:
        return "the two objects must be distinguishable"
    return None


def object_phrase(obj: ObjectSpec) -> str:
    """Canonical phrase for one object group: ``a red circle``, ``two circles``, ``three blue squares``."""
    shape = obj.shape if obj.count == 1 else PLURALS[obj.shape]
    words = [COUNT_WORDS[obj.count]] + ([obj.color] if obj.color is not None else []) + [shape]
    return " ".join(words)


def caption(spec: SceneSpec) -> str:
    """Render a scene spec as its canonical caption, the exact text the generator is conditioned on.

    One object is its phrase; two objects are joined by ``and`` or, for position scenes, by the
    relation (``a red circle left of a blue square`` means object 0 is left of object 1).
    """
    phrases = [object_phrase(o) for o in spec.objects]
    if len(phrases) == 1:
        return phrases[0]
    return f"{phrases[0]} {spec.relation or 'and'} {phrases[1]}"


def _parse_object(words: list[str], i: int, text: str) -> tuple[ObjectSpec, int]:
    """Parse one object phrase starting at ``words[i]``; return it and the index after it."""
    if i >= len(words) or words[i] not in _WORD_COUNTS:
        raise ValueError(f"cannot parse caption {text!r}: expected a count word (a, two, three) at word {i}")
    count = _WORD_COUNTS[words[i]]
    i += 1
    color = None
    if i < len(words) and words[i] in PALETTE:
        color, i = words[i], i + 1
    if i >= len(words):
        raise ValueError(f"cannot parse caption {text!r}: missing shape")
    noun = words[i]
    shape = noun if count == 1 else _SINGULARS.get(noun)
    if shape not in SHAPES:
        form = "singular" if count == 1 else "plural"
        raise ValueError(f"cannot parse caption {text!r}: expected a {form} shape, got {noun!r}")
    return ObjectSpec(color, shape, count), i + 1


def requested_objects(text: str) -> int:
    """How many objects a caption-like text asks for: each shape noun counts once if singular, and as its
    count word (``two``, ``three``; 2 if none) if plural. Words that are not canonical shape nouns count
    nothing, so a user's synonyms (``disc``, ``boxes``) add nothing.

    ``requested_objects("a circle below a circle")`` is 2; ``requested_objects("three red squares")`` is 3.
    """
    words = text.split()
    total = 0
    for i, word in enumerate(words):
        if word in SHAPES:
            total += 1
        elif word in _SINGULARS:
            before = [_WORD_COUNTS[w] for w in words[max(0, i - 2) : i] if w in _WORD_COUNTS]
            total += before[-1] if before and before[-1] > 1 else 2
    return total


def _category_of(objects: tuple[ObjectSpec, ...], relation: str | None) -> str:
    """Infer the category from the caption's structure (the inverse of the table in the module doc)."""
    if relation is not None:
        return "position"
    if len(objects) == 1:
        obj = objects[0]
        if obj.count > 1:
            return "counting"
        return "single_object" if obj.color is None else "colors"
    return "two_object" if objects[0].color is None else "color_attr"


def parse_caption(text: str) -> SceneSpec:
    """Parse a canonical caption back into its SceneSpec, category included.

    Only the exact canonical grammar produced by ``caption`` is accepted (lowercase, single spaces
    tolerated around words); paraphrases go through ``prompts.canonical_of`` first. Raises ValueError
    naming the text when it is not a valid caption.
    """
    words = text.strip().split()
    first, i = _parse_object(words, 0, text)
    if i == len(words):
        objects, relation = (first,), None
    else:
        relation = None
        for rel in RELATIONS:
            rel_words = rel.split()
            if words[i : i + len(rel_words)] == rel_words:
                relation, i = rel, i + len(rel_words)
                break
        else:
            if words[i] != "and":
                raise ValueError(f"cannot parse caption {text!r}: expected 'and' or a relation at {words[i]!r}")
            i += 1
        second, i = _parse_object(words, i, text)
        if i != len(words):
            raise ValueError(f"cannot parse caption {text!r}: trailing words {words[i:]!r}")
        objects = (first, second)
    try:
        return SceneSpec(objects, relation, _category_of(objects, relation))
    except ValueError as err:
        raise ValueError(f"cannot parse caption {text!r}: {err}") from err


def sample_scene(rng: np.random.Generator, category: str | None = None) -> SceneSpec:
    """Draw a random valid scene, uniformly over categories unless ``category`` is given.

    Within a category, colors, shapes, counts and relations are uniform subject to the category's
    rules (distinct shapes for two_object, distinct colors and shapes for color_attr, distinguishable
    objects for position). Deterministic for a given generator state.
    """
    if category is None:
        category = CATEGORIES[int(rng.integers(len(CATEGORIES)))]
    if category not in CATEGORIES:
        raise ValueError(f"unknown category {category!r}; expected one of {CATEGORIES}")

    def color() -> str:
        return COLORS[int(rng.integers(len(COLORS)))]

    def shape() -> str:
        return SHAPES[int(rng.integers(len(SHAPES)))]

    def two_distinct(pool: tuple[str, ...]) -> tuple[str, str]:
        a, b = rng.choice(len(pool), size=2, replace=False)
        return pool[int(a)], pool[int(b)]

    if category == "single_object":
        return SceneSpec((ObjectSpec(None, shape()),), None, category)
    if category == "colors":
        return SceneSpec((ObjectSpec(color(), shape()),), None, category)
    if category == "counting":
        count = int(rng.integers(2, MAX_COUNT + 1))
        return SceneSpec((ObjectSpec(color(), shape(), count),), None, category)
    if category == "two_object":
        s0, s1 = two_distinct(SHAPES)
        return SceneSpec((ObjectSpec(None, s0), ObjectSpec(None, s1)), None, category)
    if category == "color_attr":
        (c0, c1), (s0, s1) = two_distinct(COLORS), two_distinct(SHAPES)
        return SceneSpec((ObjectSpec(c0, s0), ObjectSpec(c1, s1)), None, category)
    relation = RELATIONS[int(rng.integers(len(RELATIONS)))]
    first = ObjectSpec(color(), shape())
    second = first
    while second == first:
        second = ObjectSpec(color(), shape())
    return SceneSpec((first, second), relation, category)


def all_specs(category: str | None = None) -> tuple[SceneSpec, ...]:
    """Every valid scene (optionally of one category) in a fixed order, for exhaustive tests and splits."""
    cats = CATEGORIES if category is None else (category,)
    specs: list[SceneSpec] = []
    colored = [ObjectSpec(c, s) for c in COLORS for s in SHAPES]
    for cat in cats:
        if cat == "single_object":
            specs += [SceneSpec((ObjectSpec(None, s),), None, cat) for s in SHAPES]
        elif cat == "colors":
            specs += [SceneSpec((o,), None, cat) for o in colored]
        elif cat == "counting":
            specs += [
                SceneSpec((ObjectSpec(c, s, n),), None, cat)
                for n in range(2, MAX_COUNT + 1)
                for c in COLORS
                for s in SHAPES
            ]
        elif cat == "two_object":
            specs += [
                SceneSpec((ObjectSpec(None, a), ObjectSpec(None, b)), None, cat)
                for a, b in itertools.permutations(SHAPES, 2)
            ]
        elif cat == "color_attr":
            specs += [
                SceneSpec((a, b), None, cat)
                for a, b in itertools.permutations(colored, 2)
                if a.color != b.color and a.shape != b.shape
            ]
        elif cat == "position":
            specs += [SceneSpec((a, b), rel, cat) for rel in RELATIONS for a, b in itertools.permutations(colored, 2)]
        else:
            raise ValueError(f"unknown category {cat!r}; expected one of {CATEGORIES}")
    return tuple(specs)
