"""A tiny offline word-level tokenizer for the embedded default experts."""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast
from transformers.models.auto.tokenization_auto import get_tokenizer_config

SPECIAL_TOKENS: tuple[str, ...] = ("<pad>", "<eos>", "<unk>", "<bos>")

_COLORS = (
    "red green blue yellow purple orange white black gray grey pink brown cyan magenta "
    "crimson scarlet ruby maroon cherry azure navy cobalt sapphire teal turquoise aqua sky "
    "emerald lime jade olive mint forest golden gold lemon amber mustard violet lilac plum lavender "
    "indigo tangerine peach coral apricot ivory cream snow ebony charcoal onyx jet silver slate ash "
    "rose salmon fuchsia chocolate tan beige khaki bronze copper rust burgundy wine blush sand mauve"
)
_SHAPES = (
    "circle square triangle ball disc disk ring dot orb sphere oval round box block tile cube "
    "rectangle diamond wedge pyramid cone arrow star heart hexagon pentagon octagon crescent cross "
    "shape shapes object objects"
)
_SHAPE_PLURALS = (
    "circles squares triangles balls discs disks rings dots orbs spheres ovals boxes blocks tiles cubes "
    "rectangles diamonds wedges pyramids cones arrows stars hearts "
    "hexagons pentagons octagons crescents crosses"
)
_COUNTS = "a an one two three four five single pair couple trio of some several few many both"
_POSITIONS = (
    "left right above below to the on top under beside next near center middle corner side bottom "
    "upper lower over at each other against around between"
)
_FILLER = (
    "picture photo photograph image drawing painting illustration sketch showing shows with and in "
    "small big large tiny huge little bright dark light pale deep vivid simple plain scene style art "
    "render rendering high quality detailed clean background minimal flat colorful colored shaded "
    "solid outlined is are there it its digital vector realistic sharp soft lighting shadow texture "
    "canvas paper glossy matte neon pastel shiny placed centered floating sitting lying"
)
_PUNCTUATION = ", . :"
# Classes a saved tokenizer declares when its whole pipeline lives in ``tokenizer.json``.
_GENERIC_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")

DEFAULT_WORDS: tuple[str, ...] = tuple(
    dict.fromkeys(" ".join((_COLORS, _SHAPES, _SHAPE_PLURALS, _COUNTS, _POSITIONS, _FILLER, _PUNCTUATION)).split())
)


def build_word_tokenizer(words: Sequence[str] = DEFAULT_WORDS, padding_side: str = "left") -> PreTrainedTokenizerFast:
    """Build a word-level ``transformers`` fast tokenizer over ``words``, fully offline.

    Ids 0-3 are ``<pad>``, ``<eos>``, ``<unk>``, ``<bos>``; the words follow in order (duplicates are
    dropped). Text is lowercased, split on whitespace, and punctuation becomes its own token, so
    ``"Red circle, left."`` is ``red circle , left .``. Decoding joins tokens with single spaces (no
    clean-up of spaces before punctuation) so a decoded prompt re-encodes to the same ids. No special
    tokens are added on encode; callers append ``<eos>`` where a model needs it. ``padding_side`` is
    ``"left"`` for causal generation and ``"right"`` for a text encoder.
    """
    if padding_side not in ("left", "right"):
        raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}")
    vocab: dict[str, int] = {}
    for token in (*SPECIAL_TOKENS, *(w.lower() for w in words)):
        vocab.setdefault(token, len(vocab))
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.normalizer = normalizers.Lowercase()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation(behavior="isolated")]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        eos_token="<eos>",
        unk_token="<unk>",
        bos_token="<bos>",
        padding_side=padding_side,
        clean_up_tokenization_spaces=False,
    )


def special_token_ids(tokenizer: PreTrainedTokenizerBase) -> dict[str, int | None]:
    """The pad, end and start token ids of ``tokenizer`` as a model config's keyword arguments."""
    return {
        "pad_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "bos_token_id": tokenizer.bos_token_id,
    }


def load_tokenizer(path: str, subfolder: str | None = None) -> PreTrainedTokenizerBase:
    """Load a tokenizer from a local folder or hub id (optionally a ``subfolder``) with the same code
    for real checkpoints and saved word tokenizers.

    ``AutoTokenizer`` in transformers 5 ignores a generic ``tokenizer_class`` declared next to the
    config of some model types (Qwen2 among them) and rebuilds that model's BPE pipeline from the
    vocabulary, which silently turns a saved word tokenizer into one that maps every word to nothing.
    A folder that declares a generic class is therefore loaded with ``PreTrainedTokenizerFast``
    straight from its ``tokenizer.json``; everything else goes through ``AutoTokenizer``.
    """
    kwargs = {"subfolder": subfolder} if subfolder else {}
    declared = get_tokenizer_config(path, **kwargs).get("tokenizer_class")
    if declared in _GENERIC_TOKENIZER_CLASSES:
        return PreTrainedTokenizerFast.from_pretrained(path, **kwargs)
    return AutoTokenizer.from_pretrained(path, **kwargs)
