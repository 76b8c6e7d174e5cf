"""ShapesWorld user prompts: paraphrases of canonical captions, and the benchmark's three splits.

The generator is trained on canonical captions; users speak differently. Paraphrases swap in synonyms
for colors, shapes, quantities, conjunctions and relations and wrap the scene in a template. Every
synonym table and the template list are split by hand into a train part (which also keeps the
canonical word) and a held-out part. The splits:

* ``train``: scenes of the RL training compositions, phrased with train words and templates.
* ``composition``: scenes whose composition RL training never shows (a held-out color-shape binding,
  ``HELDOUT_BINDINGS``, or the circle-and-triangle pair), phrased with train words only but wrapped in
  templates that combine train templates (``COMPOSITION_TEMPLATES``). Every word is one the experts
  saw in pretraining; what is new is the combination. The benchmark's main held-out split.
* ``vocabulary``: the same held-out compositions phrased with held-out synonyms and templates that no
  pretraining or training data contains: the second, harder split.
* ``canonical``: captions of uniformly drawn scenes (what the generator is pretrained on).

``canonical_of`` inverts any paraphrase exactly (a deterministic table parser, not a model), which is
how the reward finds the scene a user actually asked for. Every word anywhere is in ``SHAPES_WORDS``.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np

from unirl_pl.shapes.scenes import (
    CATEGORIES,
    COLORS,
    COUNT_WORDS,
    PLURALS,
    RELATIONS,
    SHAPES,
    ObjectSpec,
    SceneSpec,
    caption,
    parse_caption,
    sample_scene,
)

SPLITS: tuple[str, ...] = ("train", "composition", "vocabulary", "canonical")

# Color-shape bindings that no RL training prompt contains: each color loses one shape and each shape
# two colors, so every color and every shape still occurs in training, only these pairings do not.
HELDOUT_BINDINGS: frozenset[tuple[str, str]] = frozenset(
    {
        ("red", "triangle"),
        ("yellow", "triangle"),
        ("green", "circle"),
        ("purple", "circle"),
        ("blue", "square"),
        ("cyan", "square"),
    }
)
# Uncolored two-object scenes of this shape pair (either order) are held out too.
HELDOUT_SHAPE_PAIR: frozenset[str] = frozenset({"circle", "triangle"})

# canonical -> (train synonyms, held-out synonyms). The canonical word itself belongs to train only.
COLOR_SYNONYMS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "red": (("crimson", "scarlet"), ("ruby", "cherry")),
    "green": (("emerald", "lime"), ("jade", "verdant")),
    "blue": (("azure", "cobalt"), ("navy", "sapphire")),
    "yellow": (("golden", "lemon"), ("amber", "gold")),
    "purple": (("violet", "magenta"), ("lilac", "plum")),
    "cyan": (("teal", "aqua"), ("turquoise", "aquamarine")),
}
# canonical shape -> (train, held-out) as (singular, plural) pairs.
SHAPE_SYNONYMS: dict[str, tuple[tuple[tuple[str, str], ...], tuple[tuple[str, str], ...]]] = {
    "circle": ((("disc", "discs"), ("dot", "dots"), ("ball", "balls")), (("orb", "orbs"), ("disk", "disks"))),
    "square": ((("box", "boxes"), ("block", "blocks")), (("tile", "tiles"), ("cube", "cubes"))),
    "triangle": (
        (("wedge", "wedges"), ("pyramid", "pyramids")),
        (("delta", "deltas"), ("arrowhead", "arrowheads")),
    ),
}
# count -> (train, held-out) quantity phrases; "a" becomes "an" before a vowel.
# In every table below the canonical word is a train option in addition to the listed train synonyms.
QUANTITY_SYNONYMS: dict[int, tuple[tuple[str, ...], tuple[str, ...]]] = {
    1: (("one",), ("a single", "just one")),
    2: (("a pair of",), ("a couple of",)),
    3: (("a trio of",), ("a group of three",)),
}
RELATION_SYNONYMS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "left of": (("to the left of", "on the left of"), ("on the left side of",)),
    "right of": (("to the right of", "on the right of"), ("on the right side of",)),
    "above": (("on top of", "over"), ("atop", "higher than")),
    "below": (("under", "beneath"), ("underneath", "lower than")),
}
CONJUNCTIONS: tuple[tuple[str, ...], tuple[str, ...]] = (("with", "plus"), ("together with", "as well as"))
TEMPLATES: tuple[tuple[str, ...], tuple[str, ...]] = (
    (
        "{x}",
        "a picture of {x}",
        "a photo of {x}",
        "an image of {x}",
        "{x} on a dark background",
        "a drawing of {x}",
        "please draw {x}",
        "render {x}",
    ),
    (
        "show me {x}",
        "a simple illustration of {x}",
        "{x}, on a black canvas",
        "generate {x}",
        "a minimal sketch of {x}",
    ),
)


# New templates for the composition split, each made only of train-template words.
COMPOSITION_TEMPLATES: tuple[str, ...] = (
    "a drawing of {x} on a dark background",
    "please draw a picture of {x}",
    "render a photo of {x}",
    "an image of {x} on a dark background",
    "please render {x}",
)


def is_heldout_composition(spec: SceneSpec) -> bool:
    """Whether RL training never shows this scene: a held-out binding or the held-out shape pair.

    Single-object scenes (three of them) are never held out; in the held-out splits they differ from
    training only in phrasing.
    """
    if spec.category == "two_object":
        return {o.shape for o in spec.objects} == HELDOUT_SHAPE_PAIR
    return any((o.color, o.shape) in HELDOUT_BINDINGS for o in spec.objects)


def _split_index(split: str) -> int:
    """0: train words and templates; 1: held-out ones (the vocabulary split)."""
    if split not in ("train", "composition", "vocabulary"):
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
    return 1 if split == "vocabulary" else 0


def _tokens(text: str) -> list[str]:
    return re.findall(r"[a-z]+|,", text.lower())


def tokenize_words(text: str) -> list[str]:
    """Split a prompt into the word-level tokens ``SHAPES_WORDS`` covers: lowercase words and commas."""
    return _tokens(text)


def _pool(canonical: str, synonyms: tuple[tuple[str, ...], tuple[str, ...]], split: str) -> tuple[str, ...]:
    train, heldout = synonyms
    return (canonical, *train) if _split_index(split) == 0 else heldout


def _pick(pool: tuple[str, ...], rng: np.random.Generator) -> str:
    return pool[int(rng.integers(len(pool)))]


def _with_article(words: list[str]) -> list[str]:
    """Turn a leading ``a`` into ``an`` before a vowel sound, as a user would write it."""
    if words[0] == "a" and len(words) > 1 and words[1][0] in "aeiou":
        return ["an", *words[1:]]
    return words


def _object_paraphrase(obj: ObjectSpec, rng: np.random.Generator, split: str) -> str:
    quantity_pool = QUANTITY_SYNONYMS[obj.count]
    words = _pick(_pool(COUNT_WORDS[obj.count], quantity_pool, split), rng).split()
    if obj.color is not None:
        words.append(_pick(_pool(obj.color, COLOR_SYNONYMS[obj.color], split), rng))
    train, heldout = SHAPE_SYNONYMS[obj.shape]
    forms = heldout if _split_index(split) == 1 else ((obj.shape, PLURALS[obj.shape]), *train)
    singular, plural = forms[int(rng.integers(len(forms)))]
    words.append(singular if obj.count == 1 else plural)
    return " ".join(_with_article(words))


def paraphrase(spec: SceneSpec, rng: np.random.Generator, split: str) -> str:
    """Write a user prompt for ``spec`` in the phrasing of ``split`` (see the module doc).

    ``train`` draws each slot (template, quantity, color, shape, conjunction, relation) from the
    canonical word plus the train synonyms; ``composition`` does the same but wraps the scene in a
    ``COMPOSITION_TEMPLATES`` template; ``vocabulary`` draws only from held-out synonyms and templates,
    so it is phrased in a way train prompts never are; ``canonical`` returns the caption itself. The
    split decides phrasing only (``make_prompt_set`` picks the scenes). Deterministic for a given
    generator state.
    """
    if split == "canonical":
        return caption(spec)
    _split_index(split)
    phrases = [_object_paraphrase(o, rng, split) for o in spec.objects]
    if len(phrases) == 1:
        scene = phrases[0]
    else:
        if spec.relation is not None:
            link = _pick(_pool(spec.relation, RELATION_SYNONYMS[spec.relation], split), rng)
        else:
            link = _pick(_pool("and", CONJUNCTIONS, split), rng)
        scene = f"{phrases[0]} {link} {phrases[1]}"
    templates = COMPOSITION_TEMPLATES if split == "composition" else TEMPLATES[_split_index(split)]
    template = _pick(templates, rng)
    return " ".join(_with_article(template.replace("{x}", scene).split())).replace(" ,", ",")


def _phrase_table() -> dict[tuple[str, ...], tuple[str, ...]]:
    """Every surface phrase (train, held-out or canonical) -> its canonical caption tokens."""
    table: dict[tuple[str, ...], tuple[str, ...]] = {}

    def add(phrase: str, canonical: str) -> None:
        table[tuple(phrase.split())] = tuple(canonical.split())

    for count, (train, heldout) in QUANTITY_SYNONYMS.items():
        for phrase in (COUNT_WORDS[count], *train, *heldout):
            add(phrase, COUNT_WORDS[count])
    add("an", "a")
    for color, (train, heldout) in COLOR_SYNONYMS.items():
        for word in (color, *train, *heldout):
            add(word, color)
    for shape, (train, heldout) in SHAPE_SYNONYMS.items():
        for singular, plural in ((shape, PLURALS[shape]), *train, *heldout):
            add(singular, shape)
            add(plural, PLURALS[shape])
    for relation, (train, heldout) in RELATION_SYNONYMS.items():
        for phrase in (relation, *train, *heldout):
            add(phrase, relation)
    for phrase in ("and", *CONJUNCTIONS[0], *CONJUNCTIONS[1]):
        add(phrase, "and")
    return table


_PHRASES = _phrase_table()
_MAX_PHRASE = max(len(p) for p in _PHRASES)
# Most literal words first, so "{x}" (which matches anything) is the last resort.
_TEMPLATE_TOKENS: tuple[tuple[list[str], list[str]], ...] = tuple(
    sorted(
        (
            (_tokens(t.split("{x}")[0]), _tokens(t.split("{x}")[1]))
            for t in (*TEMPLATES[0], *TEMPLATES[1], *COMPOSITION_TEMPLATES)
        ),
        key=lambda parts: -(len(parts[0]) + len(parts[1])),
    )
)


def _canonical_tokens(words: list[str]) -> list[str] | None:
    """Rewrite a scene phrase to canonical tokens by longest match, or None if a word is unknown."""
    out: list[str] = []
    i = 0
    while i < len(words):
        if words[i] == ",":
            i += 1
            continue
        for n in range(min(_MAX_PHRASE, len(words) - i), 0, -1):
            canonical = _PHRASES.get(tuple(words[i : i + n]))
            if canonical is not None:
                out += canonical
                i += n
                break
        else:
            return None
    return out


def canonical_of(prompt: str) -> str:
    """Map any prompt (canonical, train or held-out paraphrase) to its canonical caption.

    Strips a known template (those with the most literal words first), rewrites synonyms to
    canonical words by longest phrase match, then checks the result with ``parse_caption``.
    Deterministic; raises ValueError naming the prompt when no template yields a valid caption.
    """
    words = _tokens(prompt)
    for prefix, suffix in _TEMPLATE_TOKENS:
        if len(words) < len(prefix) + len(suffix) + 1:
            continue
        if words[: len(prefix)] != prefix or (suffix and words[len(words) - len(suffix) :] != suffix):
            continue
        inner = _canonical_tokens(words[len(prefix) : len(words) - len(suffix)])
        if inner is None:
            continue
        try:
            return caption(parse_caption(" ".join(inner)))
        except ValueError:
            continue
    raise ValueError(f"cannot map prompt {prompt!r} to a ShapesWorld caption")


def spec_of(prompt: str) -> SceneSpec:
    """The SceneSpec a prompt asks for: ``parse_caption(canonical_of(prompt))``."""
    return parse_caption(canonical_of(prompt))


def sample_split_scene(rng: np.random.Generator, category: str, split: str) -> SceneSpec:
    """A uniform scene of ``category`` from the compositions of ``split``.

    ``train`` rejects held-out compositions, ``composition`` and ``vocabulary`` keep only them (any
    single-object scene qualifies), ``canonical`` takes every scene.
    """
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
    while True:
        spec = sample_scene(rng, category)
        if split == "canonical" or spec.category == "single_object":
            return spec
        if is_heldout_composition(spec) == (split != "train"):
            return spec


def make_prompt_set(n: int, seed: int, split: str) -> list[dict[str, str]]:
    """Build ``n`` prompt rows ``{"prompt", "caption", "category"}`` with categories balanced round-robin.

    Row i has category ``CATEGORIES[i % 6]``; its scene (``sample_split_scene``) and phrasing
    (``paraphrase``) come from one generator seeded by ``seed``, so the same (n, seed, split) always
    yields the same rows.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        spec = sample_split_scene(rng, CATEGORIES[i % len(CATEGORIES)], split)
        rows.append({"prompt": paraphrase(spec, rng, split), "caption": caption(spec), "category": spec.category})
    return rows


def write_jsonl(rows: list[dict[str, str]], path: str | os.PathLike[str]) -> None:
    """Write rows as JSON lines (one object per line), creating parent folders."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def read_jsonl(path: str | os.PathLike[str]) -> list[dict[str, str]]:
    """Read rows written by ``write_jsonl``; blank lines are skipped."""
    with Path(path).open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _all_words() -> tuple[str, ...]:
    words = {",", "an", "and", *COLORS, *SHAPES, *PLURALS.values(), *COUNT_WORDS.values()}
    for relation in RELATIONS:
        words.update(relation.split())
    for phrase in _PHRASES:
        words.update(phrase)
    for template in (*TEMPLATES[0], *TEMPLATES[1], *COMPOSITION_TEMPLATES):
        words.update(_tokens(template.replace("{x}", " ")))
    return tuple(sorted(words))


SHAPES_WORDS: tuple[str, ...] = _all_words()


# The shipped prompt files: (file name, rows, seed, split). RL trains on the first and validates on the
# second; the third is the harder vocabulary split, reported separately.
PROMPT_FILES: tuple[tuple[str, int, int, str], ...] = (
    ("prompts_train.jsonl", 240, 1, "train"),
    ("prompts_composition.jsonl", 120, 1000, "composition"),
    ("prompts_vocabulary.jsonl", 120, 1000, "vocabulary"),
)


def write_prompt_files(folder: str | os.PathLike[str]) -> list[Path]:
    """Write the ``PROMPT_FILES`` into ``folder`` (what ``unirl_pl/assets/shapes`` ships); returns the paths."""
    paths = []
    for name, n, seed, split in PROMPT_FILES:
        path = Path(folder) / name
        write_jsonl(make_prompt_set(n, seed, split), path)
        paths.append(path)
    return paths


if __name__ == "__main__":
    import sys

    for written in write_prompt_files(sys.argv[1] if len(sys.argv) > 1 else "runs/shapes/export"):
        print(written)
