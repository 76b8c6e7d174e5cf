"""A tiny ``QwenImageEditPlusPipeline`` folder (Qwen-Image-Edit-2509 / 2511) in the published layout, built offline.

The folder holds what the hub checkpoint holds and the pipeline's ``from_pretrained`` reads: ``model_index.json``
naming every component (``processor`` as ``Qwen2VLProcessor``), ``scheduler/``, ``text_encoder/`` (a tiny
``Qwen2_5_VLForConditionalGeneration`` with a vision tower), ``tokenizer/``, ``processor/`` (the tokenizer again
and the image processor's ``preprocessor_config.json``, as the hub's processor folder), ``transformer/`` and
``vae/`` as :func:`tests.pipelines.make_qwenimage_pipeline` builds them. ``Qwen2VLProcessor`` itself cannot be
built on a machine without torchvision (FINDINGS): load the pipeline with ``processor=None`` and give it a stand-in
(the tests do) when its ``encode_prompt`` must run.
"""

from __future__ import annotations

import json
from pathlib import Path

from diffusers import FlowMatchEulerDiscreteScheduler, QwenImageEditPlusPipeline
from tokenizers import AddedToken
from transformers import PreTrainedTokenizerFast
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from tests.chat_lm import _pieces
from tests.pipelines import _WORDS, QWENIMAGE_SCHEDULER, qwenimage_components
from tests.vlm_lm import CHAT_TOKENS, VISION_TOKENS
from unirl_pl.experts.tokenizer import DEFAULT_WORDS, build_word_tokenizer
from unirl_pl.generators.qwenimage_edit import EDIT_PROMPT_TEMPLATE, EDIT_TEMPLATE_TOKENS, IMAGE_PROMPT

# The image processor of the tiny folder: Qwen2.5-VL's (patch 14, merge 2, temporal patch 2, CLIP mean/std) with a
# pixel budget of 16..64 merged tokens, so the pipeline's 384x384-area condition image becomes 64 image tokens.
PATCH, MERGE = 14, 2
MIN_PIXELS, MAX_PIXELS = 16 * (PATCH * MERGE) ** 2, 64 * (PATCH * MERGE) ** 2


def qwenimage_edit_tokenizer() -> PreTrainedTokenizerFast:
    """The offline word tokenizer (right padding) over the edit pipeline's prompt template, its ``Picture N:``
    labels and a few words, with Qwen2.5-VL's ChatML and vision special tokens, the newline as a token of its own,
    and ``'s`` and ``),`` kept whole as Qwen2.5-VL's BPE keeps them, so the template's system turn and user header
    are exactly the pipeline's ``prompt_template_encode_start_idx`` (64) tokens."""
    labels = " ".join(IMAGE_PROMPT.format(i) for i in range(1, 4))
    words = (*DEFAULT_WORDS, *_WORDS, *_pieces(EDIT_PROMPT_TEMPLATE.replace("{}", " ")), *_pieces(labels))
    tokenizer = build_word_tokenizer(words=tuple(dict.fromkeys(words)), padding_side="right")
    tokenizer.add_special_tokens({"additional_special_tokens": [*CHAT_TOKENS, *VISION_TOKENS]})
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in ("\n", "'s", "),")])
    tokenizer.pad_token = "<|endoftext|>"
    prefix = EDIT_PROMPT_TEMPLATE.split("{}")[0]
    assert len(tokenizer(prefix).input_ids) == EDIT_TEMPLATE_TOKENS, tokenizer.tokenize(prefix)
    return tokenizer


def make_qwenimage_edit_plus_pipeline(path: str | Path, seed: int = 0, zero_cond_t: bool = False) -> Path:
    """Save a tiny ``QwenImageEditPlusPipeline`` in the published layout and return it:
    :func:`tests.pipelines.qwenimage_components` over :func:`qwenimage_edit_tokenizer` (the vision tower of patch 14
    and merge 2; the transformer's ``zero_cond_t`` as Qwen-Image-Edit-2511's sets it), a ``processor/`` folder with
    the same tokenizer and Qwen2.5-VL's image processor settings (a small pixel budget), and Qwen-Image's
    scheduler."""
    path = Path(path)
    tokenizer = qwenimage_edit_tokenizer()
    pipe = QwenImageEditPlusPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**QWENIMAGE_SCHEDULER),
        processor=None,
        **qwenimage_components(tokenizer, seed, patch=PATCH, merge=MERGE, zero_cond_t=zero_cond_t),
    )
    pipe.save_pretrained(str(path))
    # The processor folder as the hub's: its tokenizer and the image processor's settings (a Qwen2VLProcessor
    # cannot be built or saved without torchvision, so its parts are saved one by one).
    processor = path / "processor"
    tokenizer.save_pretrained(str(processor))
    Qwen2VLImageProcessorPil(
        patch_size=PATCH,
        merge_size=MERGE,
        temporal_patch_size=2,
        min_pixels=MIN_PIXELS,
        max_pixels=MAX_PIXELS,
    ).save_pretrained(str(processor))
    settings = json.loads((processor / "preprocessor_config.json").read_text())
    settings.update(image_processor_type="Qwen2VLImageProcessor", processor_class="Qwen2VLProcessor")
    (processor / "preprocessor_config.json").write_text(json.dumps(settings, indent=2) + "\n")
    index = json.loads((path / "model_index.json").read_text())
    index["processor"] = ["transformers", "Qwen2VLProcessor"]
    (path / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")
    return path


if __name__ == "__main__":
    # python -m tests.pipelines_qwen_edit FOLDER [2511]: a tiny Qwen-Image-Edit-Plus folder for CPU runs.
    import sys

    if len(sys.argv) not in (2, 3):
        sys.exit("usage: python -m tests.pipelines_qwen_edit FOLDER [2511]")
    print(make_qwenimage_edit_plus_pipeline(sys.argv[1], zero_cond_t=sys.argv[2:] == ["2511"]))
