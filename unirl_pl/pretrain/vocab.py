"""The word vocabulary shared by the ShapesWorld text encoder and refiner."""

from __future__ import annotations

from transformers import PreTrainedTokenizerFast

from unirl_pl.experts.tokenizer import DEFAULT_WORDS, build_word_tokenizer
from unirl_pl.shapes.edit_prompts import EDIT_WORDS
from unirl_pl.shapes.prompts import SHAPES_WORDS

# DEFAULT_WORDS lacks some held-out paraphrase words ("verdant", "arrowhead", ...); they are appended
# (not merged in sorted order) so every DEFAULT_WORDS id stays the same and default prompts still work.
SHAPES_TOKENIZER_WORDS: tuple[str, ...] = (
    *DEFAULT_WORDS,
    *(w for w in SHAPES_WORDS if w not in set(DEFAULT_WORDS)),
)


# ShapesWorld-Edit's experts read instructions: the edit templates' words are appended in the same way, so a
# scene word keeps its id and the text-to-image text encoder's embeddings are the first rows of the edit one's.
SHAPES_EDIT_TOKENIZER_WORDS: tuple[str, ...] = (
    *SHAPES_TOKENIZER_WORDS,
    *(w for w in EDIT_WORDS if w not in set(SHAPES_TOKENIZER_WORDS)),
)
VOCABULARIES: dict[str, tuple[str, ...]] = {"scenes": SHAPES_TOKENIZER_WORDS, "edits": SHAPES_EDIT_TOKENIZER_WORDS}


def build_shapes_tokenizer(padding_side: str = "right", vocabulary: str = "scenes") -> PreTrainedTokenizerFast:
    """Word tokenizer covering every ShapesWorld prompt word (``vocabulary="scenes"``) or every scene and
    instruction word (``"edits"``); saved next to each exported model."""
    if vocabulary not in VOCABULARIES:
        raise ValueError(f"vocabulary must be one of {sorted(VOCABULARIES)}, got {vocabulary!r}")
    return build_word_tokenizer(VOCABULARIES[vocabulary], padding_side=padding_side)
