"""A tiny Qwen2 instruct-style LM folder, built offline, for tests of the chat-formatted refiner."""

from __future__ import annotations

import re
from pathlib import Path

import torch
from tokenizers import AddedToken
from transformers import Qwen2Config, Qwen2ForCausalLM

from unirl_pl.experts.chat import DEFAULT_INSTRUCTION
from unirl_pl.experts.tokenizer import DEFAULT_WORDS, build_word_tokenizer

DEFAULT_SYSTEM = "You are a helpful assistant."

# Qwen2.5-Instruct's shape (a default system turn when none is given, ChatML turns) plus Qwen3's
# ``enable_thinking`` switch, so one fixture covers both families' templates.
QWEN_CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- set loop_messages = messages[1:] %}"
    "{%- else %}"
    "{{- '<|im_start|>system\\n" + DEFAULT_SYSTEM + "<|im_end|>\\n' }}"
    "{%- set loop_messages = messages %}"
    "{%- endif %}"
    "{%- for message in loop_messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)
CHAT_SPECIAL_TOKENS: tuple[str, ...] = ("<|im_start|>", "<|im_end|>")
# Added but not special, as in Qwen3: ``decode(skip_special_tokens=True)`` keeps them, so the reply
# parser can still see (and drop) a think block.
THINK_TOKENS: tuple[str, ...] = ("<think>", "</think>")


def _pieces(text: str) -> list[str]:
    # The word tokenizer splits on whitespace and isolates punctuation, so its vocabulary needs the
    # lowercase alphanumeric runs and single punctuation marks of every text the template writes.
    return re.findall(r"[a-z0-9]+|[^\sa-z0-9]", text.lower())


def make_qwen2_chat_lm(path: str | Path, seed: int = 0) -> str:
    """Save a tiny instruct-style Qwen2 causal LM and its tokenizer into ``path``; return the folder.

    The tokenizer is the offline word tokenizer over the default words plus the words of the default
    instruction and system message and the ChatML roles, with ``<|im_start|>``/``<|im_end|>`` as
    special tokens, ``<think>``/``</think>`` as plain added tokens, ``<|im_end|>`` as EOS (what an
    instruct checkpoint stops on) and a Qwen-style Jinja ``chat_template``. The model is a randomly
    initialized ``Qwen2ForCausalLM`` (hidden 32, 2 layers, tied embeddings), seeded by ``seed`` without
    touching the global RNG. The folder loads with ``CausalLMExpert(pretrained_path=...)``.
    """
    path = Path(path)
    words = (*DEFAULT_WORDS, "system", "user", "assistant", *_pieces(DEFAULT_INSTRUCTION), *_pieces(DEFAULT_SYSTEM))
    tokenizer = build_word_tokenizer(words=tuple(dict.fromkeys(words)), padding_side="left")
    tokenizer.add_special_tokens({"additional_special_tokens": list(CHAT_SPECIAL_TOKENS)})
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in THINK_TOKENS])
    tokenizer.eos_token = "<|im_end|>"
    tokenizer.chat_template = QWEN_CHAT_TEMPLATE
    tokenizer.save_pretrained(path)

    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        initializer_range=0.2,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model.save_pretrained(path)
    return str(path)


if __name__ == "__main__":
    # python -m tests.chat_lm FOLDER: a tiny instruct LM folder (chat template) for CPU runs of the family recipes.
    import sys

    if len(sys.argv) != 2:
        sys.exit("usage: python -m tests.chat_lm FOLDER")
    print(make_qwen2_chat_lm(sys.argv[1]))
