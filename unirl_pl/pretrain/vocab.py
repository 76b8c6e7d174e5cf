"""The word vocabulary shared by the ShapesWorld text encoder and refiner."""

from __future__ import annotations

from transformers import PreTrainedTokenizerFast

from unirl_pl.experts.tokenizer import DEFAULT_WORDS, build_word_tokenizer
from unirl_pl.shapes.prompts import SHAPES_WORDS

# DEFAULT_WORDS lacks some held-out paraphrase words ("verdant", "arrowhead", ...); they are appended
# (not merged in sorted order) so every DEFAULT_WORDS id stays the same and default prompts still work.
SHAPES_TOKENIZER_WORDS: tuple[str, ...] = (
    *DEFAULT_WORDS,
    *(w for w in SHAPES_WORDS if w not in set(DEFAULT_WORDS)),
)


def build_shapes_tokenizer(padding_side: str = "right") -> PreTrainedTokenizerFast:
    """Word tokenizer covering every ShapesWorld prompt word; saved next to each exported model."""
    return build_word_tokenizer(SHAPES_TOKENIZER_WORDS, padding_side=padding_side)
