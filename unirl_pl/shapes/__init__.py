"""ShapesWorld: a miniature GenEval-style verifiable text-to-image task that runs on CPU.

``scenes`` defines the scene grammar and categories, ``render`` draws ground-truth images,
``verify`` checks an image against a scene (the RL reward), and ``prompts`` writes user-style
paraphrases with train and held-out phrasings and maps them back to canonical captions.

ShapesWorld-Edit builds on them: ``edits`` samples instruction edits of a scene (recolor, reshape, add,
remove, move) with train and held-out compositions, ``edit_prompts`` writes and parses the instructions,
and ``edit_verify`` scores an edited image against the target and the objects it must preserve;
``edit_files`` writes the editing prompt files (JSONL rows and source PNGs) a run trains and validates on.
"""

from typing import Any

from unirl_pl.shapes.edit_prompts import EDIT_TEMPLATES, parse_instruction
from unirl_pl.shapes.edit_verify import EditVerdict, edit_breakdown, verify_edit
from unirl_pl.shapes.edits import (
    EDIT_KINDS,
    EDIT_SPLITS,
    EditSpec,
    edit_of,
    is_heldout_edit,
    make_edit_set,
    paraphrase_edit,
    render_source,
    render_target,
    sample_edit,
)
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
    "EDIT_KINDS",
    "EDIT_SPLITS",
    "EDIT_TEMPLATES",
    "PALETTE",
    "RELATIONS",
    "SHAPES",
    "SHAPES_WORDS",
    "SPLITS",
    "Detection",
    "EditSpec",
    "EditVerdict",
    "ObjectSpec",
    "SceneSpec",
    "Verdict",
    "all_specs",
    "canonical_of",
    "caption",
    "detect",
    "edit_breakdown",
    "edit_of",
    "is_heldout_edit",
    "make_edit_set",
    "make_prompt_set",
    "paraphrase",
    "paraphrase_edit",
    "parse_caption",
    "parse_instruction",
    "read_jsonl",
    "render",
    "render_batch",
    "render_source",
    "render_target",
    "sample_edit",
    "sample_scene",
    "spec_of",
    "tokenize_words",
    "verify",
    "verify_edit",
    "write_edit_files",
    "write_jsonl",
]


def __getattr__(name: str) -> Any:
    # ``write_edit_files`` is imported on first use: importing ``edit_files`` here would put it in sys.modules
    # before ``python -m unirl_pl.shapes.edit_files`` runs it (runpy then warns), and would load Pillow for
    # every user of the scene modules.
    if name == "write_edit_files":
        from unirl_pl.shapes.edit_files import write_edit_files

        return write_edit_files
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
