"""Tiny Qwen2.5-VL and Qwen3-VL folders in their real layouts, built offline, for tests of the VLM refiner.

Each folder holds what a hub checkpoint of that family holds and ``from_pretrained`` reads: ``config.json``
of the real model type (a text config with multimodal RoPE, a vision config, the vision token ids), the
weights, ``generation_config.json`` (both end ids, as the instruct checkpoints list them), a tokenizer with
the family's chat template and its ChatML and vision special tokens, and ``preprocessor_config.json`` of
the image processor. Sizes follow FINDINGS (text hidden 64, 4 heads of 16, ``mrope_section`` [2, 3, 3];
vision depth 2, hidden 32, merge 2, ``out_hidden_size`` = text hidden).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import AddedToken
from transformers import (
    PreTrainedTokenizerFast,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
)
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from tests.chat_lm import DEFAULT_SYSTEM, _pieces
from unirl_pl.experts.chat import DEFAULT_INSTRUCTION, GENEVAL_INSTRUCTION
from unirl_pl.experts.tokenizer import DEFAULT_WORDS, build_word_tokenizer

# Qwen2.5-VL-Instruct's template, as its checkpoints ship it: a default system turn when the first message is
# not one; a message's content is a string or a list of parts (text, image, video), each image or video a
# ``<|vision_start|><|..._pad|><|vision_end|>`` placeholder the processor expands.
QWEN2_5_VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\n" + DEFAULT_SYSTEM + "<|im_end|>\n"
    "{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}"
    "{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Qwen3-VL-Instruct's shape, reduced to what a refiner uses: no default system turn, string or list content,
# the same vision placeholders, the assistant generation prompt (tools and reasoning history left out).
QWEN3_VL_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for content in message['content'] %}"
    "{%- if content['type'] == 'image' or 'image' in content %}{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif content['type'] == 'video' or 'video' in content %}"
    "{{- '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{%- elif 'text' in content %}{{- content['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

CHAT_TOKENS: tuple[str, ...] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
VISION_TOKENS: tuple[str, ...] = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
# Plain text in the real BPE vocabularies; added (not special) here so the word tokenizer keeps them whole and
# ``decode(skip_special_tokens=True)`` keeps them for the reply parser and the format reward.
REPLY_TAGS: tuple[str, ...] = ("<answer>", "</answer>", "<think>", "</think>")

FAMILIES: tuple[str, ...] = ("qwen2_5_vl", "qwen3_vl")
_HIDDEN, _HEADS, _KV_HEADS, _HEAD_DIM = 64, 4, 2, 16
_MROPE_SECTION = [2, 3, 3]  # sums to head_dim / 2


def _tokenizer(template: str) -> PreTrainedTokenizerFast:
    words = (
        *DEFAULT_WORDS,
        "system",
        "user",
        "assistant",
        *_pieces(DEFAULT_INSTRUCTION),
        *_pieces(GENEVAL_INSTRUCTION),
        *_pieces(DEFAULT_SYSTEM),
    )
    tokenizer = build_word_tokenizer(words=tuple(dict.fromkeys(words)), padding_side="left")
    tokenizer.add_special_tokens({"additional_special_tokens": [*CHAT_TOKENS, *VISION_TOKENS]})
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in REPLY_TAGS])
    # As the instruct checkpoints: EOS ends the assistant turn, padding is the document end.
    tokenizer.eos_token = "<|im_end|>"
    tokenizer.pad_token = "<|endoftext|>"
    tokenizer.chat_template = template
    return tokenizer


def _ids(tokenizer: PreTrainedTokenizerFast) -> dict[str, int]:
    convert = tokenizer.convert_tokens_to_ids
    return {
        "image_token_id": convert("<|image_pad|>"),
        "video_token_id": convert("<|video_pad|>"),
        "vision_start_token_id": convert("<|vision_start|>"),
        "vision_end_token_id": convert("<|vision_end|>"),
    }


def _text_config(tokenizer: PreTrainedTokenizerFast, **rope: object) -> dict[str, object]:
    return {
        "vocab_size": len(tokenizer),
        "hidden_size": _HIDDEN,
        "intermediate_size": 2 * _HIDDEN,
        "num_hidden_layers": 2,
        "num_attention_heads": _HEADS,
        "num_key_value_heads": _KV_HEADS,
        "max_position_embeddings": 1024,
        "initializer_range": 0.2,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": _MROPE_SECTION, **rope},
        "pad_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "bos_token_id": None,
    }


def _model(family: str, tokenizer: PreTrainedTokenizerFast) -> tuple[torch.nn.Module, int]:
    """The randomly initialized model of ``family`` and its vision patch size."""
    if family == "qwen2_5_vl":
        text = _text_config(tokenizer)
        vision = {
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "window_size": 56,
            "fullatt_block_indexes": [1],
            "out_hidden_size": _HIDDEN,
        }
        config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True, **_ids(tokenizer))
        return Qwen2_5_VLForConditionalGeneration(config), 14
    text = _text_config(tokenizer, mrope_interleaved=True) | {"head_dim": _HEAD_DIM}
    vision = {
        "depth": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "num_position_embeddings": 64,
        "deepstack_visual_indexes": [1],
        "out_hidden_size": _HIDDEN,
    }
    config = Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True, **_ids(tokenizer))
    return Qwen3VLForConditionalGeneration(config), 16


def make_vlm(family: str, path: str | Path, seed: int = 0) -> str:
    """Save a tiny ``family`` (``qwen2_5_vl`` or ``qwen3_vl``) instruct VLM folder into ``path``; return it.

    Weights are random, seeded by ``seed`` without touching the global RNG. The folder loads with
    ``AutoModelForImageTextToText.from_pretrained``, ``AutoTokenizer.from_pretrained`` and
    ``AutoImageProcessor.from_pretrained`` offline, and with
    :class:`~unirl_pl.experts.vlm.VLMRefinerExpert`.
    """
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
    path = Path(path)
    template = QWEN2_5_VL_CHAT_TEMPLATE if family == "qwen2_5_vl" else QWEN3_VL_CHAT_TEMPLATE
    tokenizer = _tokenizer(template)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model, patch = _model(family, tokenizer)
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, tokenizer.pad_token_id]
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    # 4 merged tokens for a (2 * patch * merge)-pixel square image; larger images are capped at 64.
    merged = patch * 2
    Qwen2VLImageProcessorPil(
        patch_size=patch,
        merge_size=2,
        temporal_patch_size=2,
        min_pixels=(2 * merged) ** 2,
        max_pixels=64 * merged**2,
    ).save_pretrained(path)
    # A hub checkpoint names its processor class beside the image processor's settings; nothing here builds it.
    config_path = path / "preprocessor_config.json"
    settings = json.loads(config_path.read_text())
    settings["processor_class"] = "Qwen2_5_VLProcessor" if family == "qwen2_5_vl" else "Qwen3VLProcessor"
    config_path.write_text(json.dumps(settings, indent=2) + "\n")
    return str(path)


if __name__ == "__main__":
    # python -m tests.vlm_lm {qwen2_5_vl|qwen3_vl} FOLDER: a tiny VLM folder for CPU runs of the VLM refiner.
    import sys

    if len(sys.argv) != 3 or sys.argv[1] not in FAMILIES:
        sys.exit(f"usage: python -m tests.vlm_lm {{{'|'.join(FAMILIES)}}} FOLDER")
    print(make_vlm(sys.argv[1], sys.argv[2]))
