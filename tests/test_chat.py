"""Chat formatting of refiner requests and parsing of refiner replies (``unirl_pl.experts.chat``)."""

from __future__ import annotations

import pytest
import torch

from tests.chat_lm import DEFAULT_SYSTEM, make_qwen2_chat_lm
from tests.vlm_lm import QWEN2_5_VL_CHAT_TEMPLATE, QWEN3_VL_CHAT_TEMPLATE
from tests.vlm_lm import _tokenizer as vlm_tokenizer
from unirl_pl.experts.chat import (
    DEFAULT_INSTRUCTION,
    GENEVAL_INSTRUCTION,
    ChatFormat,
    extract_tagged,
    fallback_fraction,
    format_requests,
    parse_reply,
    user_message,
)
from unirl_pl.experts.llm import CausalLMExpert
from unirl_pl.experts.tokenizer import build_word_tokenizer

PROMPT = "Red circle, left."
FMT = ChatFormat()


@pytest.fixture(scope="module")
def chat_lm(tmp_path_factory: pytest.TempPathFactory) -> CausalLMExpert:
    # One folder and one built expert for the module: building is the slow part.
    folder = make_qwen2_chat_lm(tmp_path_factory.mktemp("qwen2_chat"))
    expert = CausalLMExpert(pretrained_path=folder)
    expert.build()
    return expert


# ---------------------------------------------------------------- fixture LM


def test_fixture_builds_a_chat_expert(chat_lm: CausalLMExpert) -> None:
    tok = chat_lm.tokenizer
    assert tok.chat_template is not None
    # An instruct checkpoint stops at the end of its turn, so EOS is the end-of-turn token.
    assert tok.convert_ids_to_tokens(chat_lm.eos_token_id) == "<|im_end|>"
    assert chat_lm.pad_token_id != chat_lm.eos_token_id
    assert tok.padding_side == "left"
    # Every word the template writes is in the vocabulary, so the request text round-trips.
    text = format_requests(tok, [PROMPT], FMT)[0]
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.unk_token_id not in ids
    out = chat_lm(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    assert out.logits.shape == (1, len(ids), len(tok))


def test_fixture_keeps_think_tokens_through_decode(chat_lm: CausalLMExpert) -> None:
    # The decode loop decodes with skip_special_tokens=True; think markers must survive it for
    # parse_reply to find the block, while the ChatML markers are dropped.
    tok = chat_lm.tokenizer
    ids = tok("<think> red </think> blue circle <|im_end|>", add_special_tokens=False)["input_ids"]
    assert tok.decode(ids, skip_special_tokens=True) == "<think> red </think> blue circle"


# ---------------------------------------------------------------- format_requests


def test_format_wraps_instruction_and_prompt_in_template(chat_lm: CausalLMExpert) -> None:
    texts = format_requests(chat_lm.tokenizer, [PROMPT, "two blue squares"], FMT)
    assert len(texts) == 2
    text = texts[0]
    user = text.index("<|im_start|>user\n")
    assert text.index(DEFAULT_INSTRUCTION) > user
    assert text.index("Prompt: " + PROMPT) > text.index(DEFAULT_INSTRUCTION)
    # No system turn given: the template inserts its default one first.
    assert text.startswith(f"<|im_start|>system\n{DEFAULT_SYSTEM}<|im_end|>\n")
    # Ends with the assistant generation prompt; enable_thinking=False reached the template as a
    # variable and pre-filled an empty think block.
    assert text.endswith(f"{PROMPT}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert "two blue squares<|im_end|>" in texts[1]


def test_format_system_prompt_thinking_and_placeholder(chat_lm: CausalLMExpert) -> None:
    tok = chat_lm.tokenizer
    fmt = ChatFormat(system_prompt="You rewrite prompts.", enable_thinking=True)
    text = format_requests(tok, [PROMPT], fmt)[0]
    assert text.startswith("<|im_start|>system\nYou rewrite prompts.<|im_end|>\n<|im_start|>user\n")
    assert DEFAULT_SYSTEM not in text
    assert text.endswith("<|im_start|>assistant\n")
    # A {prompt} placeholder puts the prompt inside the instruction instead of after a label.
    fmt = ChatFormat(instruction="Improve this prompt: {prompt} Reply with the prompt only.")
    text = format_requests(tok, [PROMPT], fmt)[0]
    assert f"<|im_start|>user\nImprove this prompt: {PROMPT} Reply with the prompt only.<|im_end|>" in text


def test_format_token_counts(chat_lm: CausalLMExpert) -> None:
    # The facts the decode loop relies on: every request token precedes the generation, and the
    # template overhead is the same for every prompt, so prompts differ only by their own tokens.
    tok = chat_lm.tokenizer
    prompts = [PROMPT, "two blue squares"]
    own = [len(tok(p, add_special_tokens=False)["input_ids"]) for p in prompts]
    lens = [len(ids) for ids in tok(format_requests(tok, prompts, FMT), add_special_tokens=False)["input_ids"]]
    assert own == [5, 3]
    assert [n - k for n, k in zip(lens, own, strict=True)] == [92, 92]
    thinking = format_requests(tok, prompts, ChatFormat(enable_thinking=True))
    assert [len(ids) for ids in tok(thinking, add_special_tokens=False)["input_ids"]] == [n - 2 for n in lens]
    # This tokenizer adds no BOS, so add_special_tokens makes no difference here (it would for Llama).
    assert [len(ids) for ids in tok(format_requests(tok, prompts, FMT))["input_ids"]] == lens


def test_format_bare_mode_returns_prompts_unchanged() -> None:
    prompts = [PROMPT, "  two blue squares  "]
    # The embedded word tokenizer has no chat template: bare mode must not need one.
    assert format_requests(build_word_tokenizer(), prompts, ChatFormat(use_chat_template=False)) == prompts


def test_format_without_template_raises() -> None:
    with pytest.raises(ValueError, match="no chat_template.*use_chat_template: false"):
        format_requests(build_word_tokenizer(), [PROMPT], FMT)


# ---------------------------------------------------------------- ChatFormat validation


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_refined_chars": 0}, "max_refined_chars"),
        ({"max_refined_chars": True}, "max_refined_chars"),
        ({"max_refined_chars": 10.0}, "max_refined_chars"),
        ({"instruction": "   "}, "instruction"),
        ({"instruction": None}, "instruction"),
        ({"system_prompt": ""}, "system_prompt"),
        ({"use_chat_template": 1}, "use_chat_template"),
        ({"enable_thinking": "no"}, "enable_thinking"),
    ],
)
def test_chat_format_validation(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=f"ChatFormat.{field}"):
        ChatFormat(**kwargs)


def test_chat_format_bare_mode_allows_empty_instruction() -> None:
    assert ChatFormat(use_chat_template=False, instruction="").instruction == ""


# ---------------------------------------------------------------- parse_reply


@pytest.mark.parametrize(
    ("reply", "expected"),
    [
        ("a bright red circle on the left", "a bright red circle on the left"),
        ("<think>\nthe user wants a circle\n</think>\n\na red circle on the left", "a red circle on the left"),
        ("<think></think>a red circle", "a red circle"),
        ("a red circle <think>now let me reconsider the lighting", "a red circle"),
        ("the user wants red</think> a red circle", "a red circle"),
        ("Refined prompt: a red circle on the left", "a red circle on the left"),
        ("PROMPT:a red circle", "a red circle"),
        ("**Rewritten prompt:** a red circle", "a red circle"),
        ('"a red circle on the left"', "a red circle on the left"),
        ("\u201ca red circle\u201d", "a red circle"),
        ("Prompt: \"'a red circle'\"", "a red circle"),
        ("a red circle<|im_end|>", "a red circle"),
        ("<|im_start|>assistant a red circle", "assistant a red circle"),
        ("a red circle<|im_end|>\n<|im_start|>user\nthanks", "a red circle"),
        ("  a red\n\ncircle,  left  ", "a red circle, left"),
        ("a prompt: red", "a prompt: red"),
        ('he said "hi', 'he said "hi'),
    ],
)
def test_parse_reply_rules(reply: str, expected: str) -> None:
    assert parse_reply(reply, PROMPT, FMT) == (expected, False)


def test_parse_reply_caps_at_word_boundary() -> None:
    fmt = ChatFormat(max_refined_chars=20)
    # The cut falls inside "circular": the partial word is dropped.
    assert parse_reply("a bright red circular disc", PROMPT, fmt) == ("a bright red", False)
    # The cut lands exactly before a space: the whole last word is kept.
    assert parse_reply("a bright red circles on the left", PROMPT, fmt) == ("a bright red circles", False)
    # Trailing punctuation left by the cut goes too.
    assert parse_reply("a bright red circle, on the left", PROMPT, fmt) == ("a bright red circle", False)
    # One giant word has no boundary: hard cut.
    assert parse_reply("x" * 30, PROMPT, fmt) == ("x" * 20, False)
    assert len(parse_reply("red " * 200, PROMPT, FMT)[0]) <= FMT.max_refined_chars


@pytest.mark.parametrize(
    "reply",
    [
        "",
        "   \n ",
        "<think>only thinking</think>",
        "<think>never closed",
        '""',
        "...!?",
        "Refined prompt:",
        "<|im_end|>",
    ],
)
def test_parse_reply_falls_back_to_user_prompt(reply: str) -> None:
    assert parse_reply(reply, PROMPT, FMT) == (PROMPT, True)


def test_fallback_fraction() -> None:
    assert fallback_fraction([]) == 0.0
    assert fallback_fraction([True, False, False, True]) == 0.5
    flags = [parse_reply(r, PROMPT, FMT)[1] for r in ["a red circle", "", "?!", "<think>x</think>blue"]]
    assert fallback_fraction(flags) == 0.5


# ---------------------------------------------------------------- PromptRL's reply format

ANSWER = ChatFormat(instruction=GENEVAL_INSTRUCTION, answer_tag="answer")


# Expected values worked out by hand from PromptRL's ``extract_thinking_content`` (G-U-N/UniRL @53c28c9,
# unimodel/qwenklein/qwenklein_inference.py): the last non-greedy <answer>...</answer> across lines, stripped;
# no closed pair: the whole reply stripped; then every stray <answer> and </answer> removed (after the strip).
@pytest.mark.parametrize(
    ("reply", "expected"),
    [
        ("<answer>a red ball</answer>", "a red ball"),
        ("<answer>  a red ball \n</answer>", "a red ball"),
        (
            "Sure!<answer>first try</answer> hmm <answer>\n a red ball, studio light \n</answer> done",
            "a red ball, studio light",
        ),
        ("<answer>line one\n\nline two</answer>", "line one\n\nline two"),  # no whitespace collapsing
        ("  a red ball, no tags  ", "a red ball, no tags"),
        ("<answer> a red ball", " a red ball"),  # unclosed: stripped first, the tag removed after
        ("a red ball</answer>", "a red ball"),
        ("</answer>a red ball<answer>", "a red ball"),
        ("<answer>a <answer>red</answer> ball</answer>", "a red"),  # non-greedy from the first opening
        ("<answer>a red ball <answer></answer>", "a red ball "),  # the match 'a red ball <answer>', stripped, cleaned
        ("<think>red or blue?</think><answer>a blue ball</answer>", "a blue ball"),
        ('Refined prompt: "a red ball"', 'Refined prompt: "a red ball"'),  # no label or quote clean-up
    ],
)
def test_answer_tag_reads_replies_as_promptrl(reply: str, expected: str) -> None:
    assert extract_tagged(reply, "answer") == expected
    assert parse_reply(reply, PROMPT, ANSWER) == (expected, False)


@pytest.mark.parametrize("reply", ["<answer></answer>", "<answer> \n </answer>", "", "<answer>", "<answer>?!</answer>"])
def test_answer_tag_empty_answer_falls_back_to_user_prompt(reply: str) -> None:
    # PromptRL would hand the generator an empty (or punctuation-only) prompt; here the user prompt is used and
    # counted in llm/fallback_frac.
    assert parse_reply(reply, PROMPT, ANSWER) == (PROMPT, True)


def test_answer_tag_keeps_the_cap() -> None:
    fmt = ChatFormat(answer_tag="answer", max_refined_chars=12)
    assert parse_reply("<answer>a bright red circle</answer>", PROMPT, fmt) == ("a bright red", False)


@pytest.mark.parametrize("tag", ["", "<answer>", "an swer", "a>b", 3])
def test_answer_tag_must_be_a_tag_name(tag: object) -> None:
    with pytest.raises(ValueError, match="ChatFormat.answer_tag"):
        ChatFormat(answer_tag=tag)  # type: ignore[arg-type]


# PromptRL's own wording of the instruction (its placeholder ``{Question}``, filled by ``str.format``), kept here
# so the constant is checked against the reference and not against itself.
PROMPTRL_GENEVAL_TEMPLATE = (
    "Please provide an enhanced prompt for the following image generation prompt to "
    "make the image more realistic, detailed, with clear separation and precise alignment "
    "of all entities.\nOriginal prompt: {Question}. "
    "Directly provide the improved prompt in <answer> </answer> tags."
)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_geneval_instruction_renders_as_promptrl(family: str) -> None:
    tok = vlm_tokenizer(QWEN2_5_VL_CHAT_TEMPLATE if family == "qwen2_5_vl" else QWEN3_VL_CHAT_TEMPLATE)
    prompt = "a photo of two cats and a red {brace} bench"
    # PromptRL's request: one user turn whose content is a list of parts, no system turn.
    text = PROMPTRL_GENEVAL_TEMPLATE.format(Question=prompt)
    messages = [{"role": "user", "content": [{"type": "text", "text": text}]}]
    theirs = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ours = format_requests(tok, [prompt], ANSWER)[0]
    assert ours == theirs
    assert user_message(prompt, ANSWER) == text
    user = f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"
    if family == "qwen2_5_vl":  # the template's default system turn, as PromptRL's requests get it
        assert ours == f"<|im_start|>system\n{DEFAULT_SYSTEM}<|im_end|>\n" + user
    else:
        assert ours == user
