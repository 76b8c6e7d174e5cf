"""ShapesWorld: a miniature GenEval-style verifiable text-to-image task that runs on CPU.

``scenes`` defines the scene grammar and categories, ``render`` draws ground-truth images,
``verify`` checks an image against a scene (the RL reward), and ``prompts`` writes user-style
paraphrases with train and held-out phrasings and maps them back to canonical captions.
"""

from unirl_pl.shapes.prompts import (
    SHAPES_WORDS,
    SPLITS,
    canonical_of,
    make_prompt_set,
    paraphrase,
    read_jsonl,
    spec_of,
    tokenize_words,
    write_jsonl,
)
from unirl_pl.shapes.render import DEFAULT_SIZE, render, render_batch
from unirl_pl.shapes.scenes import (
    CATEGORIES,
    COLORS,
    PALETTE,
    RELATIONS,
    SHAPES,
    ObjectSpec,
    SceneSpec,
    all_specs,
    caption,
    parse_caption,
    sample_scene,
)
from unirl_pl.shapes.verify import Detection, Verdict, detect, verify

__all__ = [
    "CATEGORIES",
    "COLORS",
    "DEFAULT_SIZE",
    "PALETTE",
    "RELATIONS",
    "SHAPES",
    "SHAPES_WORDS",
    "SPLITS",
    "Detection",
    "ObjectSpec",
    "SceneSpec",
    "Verdict",
    "all_specs",
    "canonical_of",
    "caption",
    "detect",
    "make_prompt_set",
    "paraphrase",
    "parse_caption",
    "read_jsonl",
    "render",
    "render_batch",
    "sample_scene",
    "spec_of",
    "tokenize_words",
    "verify",
    "write_jsonl",
]
