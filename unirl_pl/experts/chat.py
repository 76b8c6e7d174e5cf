"""Chat formatting for an instruct prompt-refiner: the text the LM is asked, and the prompt parsed back.

An instruct LM (Qwen2.5-Instruct, as in PromptRL) is only on-distribution when its input goes through
its own chat template with an instruction; its reply then has to be cleaned into a bare prompt for the
diffusion model. Both directions are pure functions of strings (plus the tokenizer's template), so the
decode loop can own tokenization and scoring while this module owns the wording.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

DEFAULT_INSTRUCTION: str = (
    "Rewrite the image prompt below into one more detailed prompt for a text-to-image model. "
    "Keep every object, count, color, attribute and spatial relation exactly as given; do not add, "
    "remove or change any of them. You may add details of style, lighting and composition that do not "
    "contradict the prompt. Reply with the rewritten prompt only, with no explanation."
)

# PromptRL's GenEval instruction (G-U-N/UniRL @53c28c9, unirl/train_geneval.py), its placeholder renamed to
# ``{prompt}``: with ``answer_tag: answer`` and no system prompt it reproduces PromptRL's user turn exactly.
GENEVAL_INSTRUCTION: str = (
    "Please provide an enhanced prompt for the following image generation prompt to "
    "make the image more realistic, detailed, with clear separation and precise alignment "
    "of all entities.\nOriginal prompt: {prompt}. "
    "Directly provide the improved prompt in <answer> </answer> tags."
)

# Where the user prompt goes inside the instruction; without it the prompt is appended after a label.
PROMPT_PLACEHOLDER = "{prompt}"
# A tag name usable as ``<name>...</name>``: no spaces or angle brackets.
_TAG_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*")
_PROMPT_LABEL = "Prompt: "

# A closed think block, and an opened one the LM never closed (ran out of tokens): both are reasoning,
# never part of the prompt.
_THINK_BLOCK = re.compile(r"<think>.*?</think>", re.DOTALL | re.IGNORECASE)
_THINK_OPEN = re.compile(r"<think>.*\Z", re.DOTALL | re.IGNORECASE)
# A close without an open: templates that pre-fill ``<think>`` in the generation prompt (R1-style).
_THINK_CLOSE = re.compile(r"\A.*</think>", re.DOTALL | re.IGNORECASE)
# Everything after an end-of-turn marker is the LM hallucinating the next turn, not its reply.
_END_OF_TURN = re.compile(r"<\|(?:im_end|endoftext|eot_id|end_of_text|end|eos)\|>", re.IGNORECASE)
# Any other leftover special-token-looking marker (``<|im_start|>``, ``<|assistant|>``, ...).
_SPECIAL_MARKER = re.compile(r"<\|[^|<>\s]{0,40}\|>")
# A leading label such as ``Refined prompt:`` or ``**Prompt:**`` (markdown bold either side of the colon).
_LEADING_LABEL = re.compile(
    r"\A(?:\*\*)?(?:(?:refined|rewritten|improved|enhanced|expanded|detailed|revised|final|new|output)\s+)?"
    r"prompt\s*(?:\*\*)?\s*:\s*(?:\*\*)?\s*",
    re.IGNORECASE,
)
_QUOTE_PAIRS: tuple[tuple[str, str], ...] = (
    ('"', '"'),
    ("'", "'"),
    ("`", "`"),
    ("\u201c", "\u201d"),
    ("\u2018", "\u2019"),
    ("\u00ab", "\u00bb"),
)


@dataclass(frozen=True)
class ChatFormat:
    """How the refiner is asked and how its reply is read back.

    With ``use_chat_template`` every prompt is wrapped in the tokenizer's chat template as one user turn
    (``instruction`` plus the prompt, after an optional ``system_prompt`` turn) ending in the assistant
    generation prompt; without it the bare prompt is fed to the LM (a base LM, the original behaviour).
    ``instruction`` may hold ``{prompt}`` to place the prompt itself; otherwise the prompt follows it
    after ``Prompt: ``. ``system_prompt=None`` sends no system turn, which lets templates that insert a
    default system message (Qwen2.5) do so. ``max_refined_chars`` caps the parsed reply, cut at a word
    boundary, so a rambling reply cannot overflow the text encoder. ``enable_thinking`` is passed to the
    template as a variable: Qwen3 templates pre-fill an empty think block when it is false, templates
    that do not use it ignore it.

    ``answer_tag`` reads the reply the way PromptRL does (its ``extract_thinking_content``): with
    ``answer``, the refinement is the text of the last ``<answer>...</answer>`` (stripped), and a reply with
    no closed pair is used whole (stripped) with stray ``<answer>``/``</answer>`` removed; none of the other
    clean-ups apply (think blocks, labels, quotes), only the cap and the fallback to the user prompt when
    nothing alphanumeric is left. None (the default) keeps the free-form parsing of :func:`parse_reply`.
    """

    use_chat_template: bool = True
    instruction: str = DEFAULT_INSTRUCTION
    system_prompt: str | None = None
    max_refined_chars: int = 400
    enable_thinking: bool = False
    answer_tag: str | None = None

    def __post_init__(self) -> None:
        if self.answer_tag is not None and (
            not isinstance(self.answer_tag, str) or _TAG_NAME.fullmatch(self.answer_tag) is None
        ):
            raise ValueError(
                "ChatFormat.answer_tag must be a tag name such as 'answer' (letters, digits, _ . -; no brackets) "
                f"or null, got {self.answer_tag!r}"
            )
        for name in ("use_chat_template", "enable_thinking"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"ChatFormat.{name} must be true or false, got {getattr(self, name)!r}")
        if not isinstance(self.instruction, str):
            raise ValueError(f"ChatFormat.instruction must be a string, got {type(self.instruction).__name__}")
        if self.use_chat_template and not self.instruction.strip():
            raise ValueError("ChatFormat.instruction must be non-empty when use_chat_template is true")
        if self.system_prompt is not None and (
            not isinstance(self.system_prompt, str) or not self.system_prompt.strip()
        ):
            raise ValueError(
                "ChatFormat.system_prompt must be a non-empty string or null (no system turn), "
                f"got {self.system_prompt!r}"
            )
        # bool is an int subclass; ``max_refined_chars: true`` in a recipe is a mistake, not 1.
        if (
            isinstance(self.max_refined_chars, bool)
            or not isinstance(self.max_refined_chars, int)
            or self.max_refined_chars < 1
        ):
            raise ValueError(f"ChatFormat.max_refined_chars must be an integer >= 1, got {self.max_refined_chars!r}")


def user_message(prompt: str, fmt: ChatFormat) -> str:
    """The content of the user turn for ``prompt``: the instruction with ``{prompt}`` filled in, or the
    instruction followed by a blank line and ``Prompt: <prompt>``. Plain replacement, not
    ``str.format``, so braces elsewhere in an instruction are kept literally."""
    if PROMPT_PLACEHOLDER in fmt.instruction:
        return fmt.instruction.replace(PROMPT_PLACEHOLDER, prompt)
    return f"{fmt.instruction.rstrip()}\n\n{_PROMPT_LABEL}{prompt}"


def format_requests(tokenizer: Any, prompts: list[str], fmt: ChatFormat) -> list[str]:
    """The text to tokenize for each prompt, in order.

    With ``fmt.use_chat_template`` each prompt becomes ``[system?, user]`` messages rendered by
    ``tokenizer.apply_chat_template(..., tokenize=False, add_generation_prompt=True,
    enable_thinking=fmt.enable_thinking)``, so the text ends with the assistant generation prompt and
    every token of it is prompt (never scored). The rendered text already holds any BOS the template
    writes, so it should be tokenized with ``add_special_tokens=False``. Without the chat template the
    prompts are returned unchanged. Raises ``ValueError`` when a template is asked for but the tokenizer
    has none.
    """
    prompts = list(prompts)
    if not fmt.use_chat_template:
        return prompts
    if getattr(tokenizer, "chat_template", None) is None:
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise ValueError(
            f"ChatFormat.use_chat_template is true but the tokenizer {name!r} has no chat_template: "
            "point the refiner at an instruct checkpoint (one with a chat template), or set "
            "use_chat_template: false to feed the bare prompt to a base LM"
        )
    texts = []
    for prompt in prompts:
        messages = [] if fmt.system_prompt is None else [{"role": "system", "content": fmt.system_prompt}]
        messages.append({"role": "user", "content": user_message(prompt, fmt)})
        text = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, enable_thinking=fmt.enable_thinking
        )
        texts.append(text)
    return texts


def _strip_quotes(text: str) -> str:
    # Repeat so nested wrappers (``"'a red ball'"``) all go; a lone quote at one end is content.
    changed = True
    while changed and len(text) >= 2:
        changed = False
        for left, right in _QUOTE_PAIRS:
            if text.startswith(left) and text.endswith(right):
                text = text[len(left) : len(text) - len(right)].strip()
                changed = True
                break
    return text


def _cap(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    head = text[:limit]
    # A cut that lands exactly on a space keeps the whole last word; otherwise drop the partial word,
    # unless the head is one giant word (then a hard cut is all there is).
    if not text[limit].isspace():
        boundary = head.rfind(" ")
        if boundary > 0:
            head = head[:boundary]
    return head.rstrip(" ,;:-")


def extract_tagged(reply: str, tag: str) -> str:
    """PromptRL's reading of a tagged reply: the last ``<tag>...</tag>`` (non-greedy, across lines), stripped;
    without one, the whole reply stripped. Stray ``<tag>``/``</tag>`` are removed after the strip, in that
    order, as PromptRL does (so ``<tag>a <tag></tag>`` gives ``"a "``)."""
    opening, closing = f"<{tag}>", f"</{tag}>"
    matches = re.findall(re.escape(opening) + "(.*?)" + re.escape(closing), reply, re.DOTALL)
    text = matches[-1].strip() if matches else reply.strip()
    return text.replace(opening, "").replace(closing, "")


def parse_reply(reply: str, prompt: str, fmt: ChatFormat) -> tuple[str, bool]:
    """The refined prompt in an LM reply, and whether the user ``prompt`` was used instead.

    In order: drop ``<think>...</think>`` blocks (an unclosed ``<think>`` runs to the end; a ``</think>``
    with no opener drops everything up to it), cut at the first end-of-turn marker (``<|im_end|>``,
    ``<|endoftext|>``, ...) and remove other ``<|...|>`` markers, collapse whitespace to single spaces,
    strip a leading ``Prompt:``/``Refined prompt:``-style label (case-insensitive) and wrapping quotes,
    then cap at ``fmt.max_refined_chars`` on a word boundary. When nothing alphanumeric is left the
    result is ``(prompt, True)`` so the generator always gets a usable prompt; otherwise
    ``(refined, False)``. With ``fmt.answer_tag`` the reply is read by :func:`extract_tagged` instead of
    these clean-ups; the cap and the fallback still apply.
    """
    if fmt.answer_tag is not None:
        tagged = _cap(extract_tagged(reply, fmt.answer_tag), fmt.max_refined_chars)
        return (tagged, False) if any(ch.isalnum() for ch in tagged) else (prompt, True)
    text = _THINK_BLOCK.sub(" ", reply)
    text = _THINK_OPEN.sub(" ", text)
    text = _THINK_CLOSE.sub(" ", text)
    end = _END_OF_TURN.search(text)
    if end is not None:
        text = text[: end.start()]
    text = _SPECIAL_MARKER.sub(" ", text)
    # One line of single spaces: the text encoder does not need layout, and the cap counts content.
    text = " ".join(text.split())
    for _ in range(2):  # a label inside quotes, or quotes after a label
        text = _strip_quotes(_LEADING_LABEL.sub("", text).strip())
    text = _cap(text, fmt.max_refined_chars)
    if not any(ch.isalnum() for ch in text):
        return prompt, True
    return text, False


def is_end_of_turn(token: str) -> bool:
    """Whether ``token`` (a tokenizer's added token) is a marker that ends a reply's turn."""
    return _END_OF_TURN.fullmatch(token) is not None


def fallback_fraction(flags: list[bool]) -> float:
    """Fraction of replies that fell back to the user prompt (0.0 for no replies), a health metric:
    a rising value means the refiner stopped producing parseable prompts."""
    flags = list(flags)
    return sum(bool(f) for f in flags) / len(flags) if flags else 0.0
