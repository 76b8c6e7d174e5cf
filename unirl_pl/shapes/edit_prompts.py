"""ShapesWorld-Edit instructions: canonical text, paraphrases in train and held-out phrasings, and the parser.

An instruction is a template with slots: ``{obj}`` the edited object, ``{color}`` / ``{shape}`` its new
color or shape, ``{new}`` the added object with its quantity word, ``{rel}`` a relation and ``{anchor}``
the object the relation refers to. As in ``prompts``, the templates of each kind and every word's
synonyms are split by hand into a train pool (which also keeps the canonical words; the first train
template is the canonical instruction) and a held-out pool that no train instruction uses; the word
synonyms are ``prompts``' own tables, so an edit instruction speaks the same words as a scene prompt.
``parse_instruction`` inverts any instruction of either pool exactly. ``scene_caption`` and
``target_caption`` describe an edit's source and target scenes in canonical words.
"""

from __future__ import annotations

import re

import numpy as np

from unirl_pl.shapes.prompts import COLOR_SYNONYMS, QUANTITY_SYNONYMS, RELATION_SYNONYMS, SHAPE_SYNONYMS
from unirl_pl.shapes.render import Placement

PHRASINGS: tuple[str, ...] = ("train", "heldout")

# kind -> (train templates, held-out templates). Kinds sharing a verb ("turn", "make", "put") stay apart
# by their slots: a color or "into a", "a" + shape, "the" + object or a quantity word.
EDIT_TEMPLATES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "recolor": (
        ("make the {obj} {color}", "paint the {obj} {color}", "color the {obj} {color}", "change the {obj} to {color}"),
        ("turn the {obj} {color}", "recolor the {obj} {color}", "the {obj} should be {color}"),
    ),
    "reshape": (
        ("turn the {obj} into a {shape}", "change the {obj} into a {shape}", "make the {obj} a {shape}"),
        ("reshape the {obj} into a {shape}", "transform the {obj} into a {shape}", "the {obj} should become a {shape}"),
    ),
    "add": (
        ("add {new} {rel} the {anchor}", "draw {new} {rel} the {anchor}", "put {new} {rel} the {anchor}"),
        ("insert {new} {rel} the {anchor}", "place {new} {rel} the {anchor}", "include {new} {rel} the {anchor}"),
    ),
    "remove": (
        ("remove the {obj}", "delete the {obj}", "take away the {obj}", "get rid of the {obj}"),
        ("erase the {obj}", "take out the {obj}", "drop the {obj}", "the {obj} should go"),
    ),
    "move": (
        ("move the {obj} {rel} the {anchor}", "shift the {obj} {rel} the {anchor}", "put the {obj} {rel} the {anchor}"),
        (
            "relocate the {obj} {rel} the {anchor}",
            "slide the {obj} {rel} the {anchor}",
            "reposition the {obj} {rel} the {anchor}",
        ),
    ),
}
# The word classes filling each slot, in order.
SLOT_WORDS: dict[str, tuple[str, ...]] = {
    "obj": ("color", "shape"),
    "color": ("color",),
    "shape": ("shape",),
    "new": ("quantity", "color", "shape"),
    "rel": ("relation",),
    "anchor": ("color", "shape"),
}
# Word class -> canonical word -> (train synonyms, held-out synonyms); shapes keep their singular forms.
_SYNONYMS: dict[str, dict[str, tuple[tuple[str, ...], tuple[str, ...]]]] = {
    "color": COLOR_SYNONYMS,
    "shape": {
        s: (tuple(p[0] for p in train), tuple(p[0] for p in held)) for s, (train, held) in SHAPE_SYNONYMS.items()
    },
    "quantity": {"a": QUANTITY_SYNONYMS[1]},
    "relation": RELATION_SYNONYMS,
}


def _template_words() -> tuple[str, ...]:
    words = {word for pools in EDIT_TEMPLATES.values() for pool in pools for t in pool for word in t.split()}
    return tuple(sorted(w for w in words if not w.startswith("{")))


# The words of every instruction template outside its slots (``make``, ``the``, ``into``, ``should``): what a word
# tokenizer must add to the scene prompts' ``SHAPES_WORDS`` to read instructions (the slots' words are theirs).
EDIT_WORDS: tuple[str, ...] = _template_words()
_WORD_OF: dict[str, dict[str, str]] = {
    cls: {w: c for c, (train, held) in table.items() for w in (c, *train, *held)} for cls, table in _SYNONYMS.items()
}


def noun(p: Placement) -> str:
    """The object's canonical noun, e.g. ``red circle``."""
    return f"{p.color} {p.shape}"


def scene_caption(placements: tuple[Placement, ...]) -> str:
    """``a red circle``, ``a red circle and a blue square``, ``a red circle, a blue square and a green triangle``
    (``nothing`` for an empty scene, what removing a lone object leaves)."""
    phrases = [f"a {noun(p)}" for p in placements] or ["nothing"]
    return phrases[0] if len(phrases) < 2 else f"{', '.join(phrases[:-1])} and {phrases[-1]}"


def target_caption(target: tuple[Placement, ...], index: int, anchor: int | None, relation: str | None) -> str:
    """The caption of an edit's target scene; for add and move (``relation`` given) the edited object
    ``target[index]`` comes first with its relation to ``target[anchor]``: ``a red circle below a green
    square and a blue triangle``, a position caption (``scenes.parse_caption``) when two objects."""
    if relation is None or anchor is None:
        return scene_caption(target)
    rest = tuple(p for k, p in enumerate(target) if k not in (index, anchor))
    lead = f"a {noun(target[index])} {relation} a {noun(target[anchor])}"
    return f"{lead} and {scene_caption(rest)}" if rest else lead


def fill_instruction(
    kind: str, slots: dict[str, tuple[str, ...]], rng: np.random.Generator | None = None, phrasing: str = "train"
) -> str:
    """Write an instruction of ``kind`` from its slots' canonical words (``SLOT_WORDS`` order).

    With ``rng`` None this is the canonical instruction (the first train template, canonical words);
    otherwise the template and every word are drawn from ``phrasing``'s pool: ``train`` the train
    templates and the canonical words plus the train synonyms, ``heldout`` only held-out ones.
    Deterministic for a given generator state.
    """
    if phrasing not in PHRASINGS:
        raise ValueError(f"unknown phrasing {phrasing!r}; expected one of {PHRASINGS}")
    templates = EDIT_TEMPLATES[kind][PHRASINGS.index(phrasing)]
    template = EDIT_TEMPLATES[kind][0][0] if rng is None else templates[int(rng.integers(len(templates)))]

    def word(cls: str, canonical: str) -> str:
        if rng is None:
            return canonical
        train, heldout = _SYNONYMS[cls][canonical]
        pool = (canonical, *train) if phrasing == "train" else heldout
        return pool[int(rng.integers(len(pool)))]

    def slot(match: re.Match[str]) -> str:
        name = match.group(1)
        return " ".join(word(cls, w) for cls, w in zip(SLOT_WORDS[name], slots[name], strict=True))

    words = re.sub(r"\{(\w+)\}", slot, template).split()
    # "a" becomes "an" before a vowel, as a user writes it ("an orb", "an azure disc").
    return " ".join(
        "an" if w == "a" and k + 1 < len(words) and words[k + 1][0] in "aeiou" else w for k, w in enumerate(words)
    )


def _slot_pattern(match: re.Match[str]) -> str:
    """Regex for one escaped ``{slot}``: a named group per word, each an alternation of its class's words."""
    name = match.group(1)
    groups = []
    for k, cls in enumerate(SLOT_WORDS[name]):
        # Longest first, so a multi-word synonym ("a single") wins over its prefix ("a").
        words = sorted(_WORD_OF[cls], key=len, reverse=True)
        groups.append(f"(?P<{name}{k}>{'|'.join(map(re.escape, words))})")
    return " ".join(groups)


_PATTERNS: tuple[tuple[str, re.Pattern[str]], ...] = tuple(
    (kind, re.compile(re.sub(r"\\\{(\w+)\\\}", _slot_pattern, re.escape(template))))
    for kind, (train, heldout) in EDIT_TEMPLATES.items()
    for template in (*train, *heldout)
)


def parse_instruction(prompt: str) -> tuple[str, str]:
    """``(kind, canonical instruction)`` of any instruction ``fill_instruction`` writes, in either phrasing.

    Matches the lowercased words against every template, each slot restricted to its word classes, and
    rewrites the slots' words to canonical ones. Raises ValueError naming the prompt when none matches.
    """
    text = " ".join("a" if w == "an" else w for w in re.findall(r"[a-z]+", prompt.lower()))
    for kind, pattern in _PATTERNS:
        match = pattern.fullmatch(text)
        if match is not None:
            found = match.groupdict()
            slots = {
                name: tuple(_WORD_OF[cls][found[f"{name}{k}"]] for k, cls in enumerate(classes))
                for name, classes in SLOT_WORDS.items()
                if f"{name}0" in found
            }
            return kind, fill_instruction(kind, slots)
    raise ValueError(f"cannot parse edit instruction {prompt!r}")
