"""What a VLM judge is asked and how its replies are read: the templates' instructions, the UnifiedReward
presets, and the parsers of a reply's score, yes/no answer and pairwise choice (pure functions, tested on
real reply texts in tests/test_rewards_vlm_judge.py)."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any, Literal

Template = Literal["score", "yes_no", "pairwise"]

SCORE_INSTRUCTION = (
    "You are judging an image generated from a text description. Rate how well the image matches the "
    "description and how good it looks, on a scale from {low} to {high}, where {high} is best. "
    "Reply with the number only.\nDescription: {prompt}"
)
QUESTION_INSTRUCTION = "Answer the question about the image with yes or no only.\nQuestion: {question}"
DEFAULT_QUESTION = "Does the image show {prompt}?"
PAIRWISE_INSTRUCTION = (
    "Two images were generated from the same text description. Which one matches the description better "
    "and looks better? Reply with 1 for the first image or 2 for the second, and nothing else.\n"
    "Description: {prompt}"
)

_NUMBER = r"[-+]?\d+(?:\.\d+)?"
# A stated scale such as "1-10", "(1-5)" or "1 to 10": not a score, and its dash would read as a minus sign.
_SCALE = r"\(?\s*\d+(?:\.\d+)?\s*(?:-|–|to)\s*\d+(?:\.\d+)?\s*\)?"
# "score: 7", "score is 7", "score (1-5): 4", "score of 7/10": the number after a label, with an optional "/ Y".
_LABELED = (
    rf"score\s*(?:{_SCALE})?\s*(?:is|of|[:=])\s*({_NUMBER})(?!\s*(?:-|–|to)\s*\d)"  # not "score of 1-10"
    rf"(?:\s*(?:/|out of)\s*({_NUMBER}))?"
)


def answer_part(text: str) -> str:
    """The part of a reply that holds its verdict: inside the last ``<answer>`` tag, else after the last
    ``</think>``, else the whole reply (reasoning judges such as UnifiedReward-Think write both)."""
    tagged = re.findall(r"<answer>(.*?)(?:</answer>|$)", text, flags=re.IGNORECASE | re.DOTALL)
    if tagged:
        return tagged[-1]
    return re.split(r"</think>", text, flags=re.IGNORECASE)[-1]


def _on_scale(value: str, denominator: str | None, low: float, high: float) -> float | None:
    """``value`` when it lies in ``[low, high]`` and any ``/ Y`` it came with is the scale's top."""
    number = float(value)
    if denominator and float(denominator) != high:  # findall gives "" for an absent "/ Y"
        return None  # "4/5" on a 1-10 scale is not a 4
    return number if low <= number <= high and math.isfinite(number) else None


def parse_score(text: str, low: float, high: float) -> float | None:
    """The judge's score in ``[low, high]`` from its reply, or None when there is no unambiguous one.

    Read from the reply's verdict (:func:`answer_part`), in order: the last ``final score: X``; the mean of
    several labeled dimensions (``Alignment Score (1-5): 4`` / ``Coherence Score (1-5): 5`` ..., as
    UnifiedReward answers); the last ``score: X`` (``score is X``, ``score (1-10): X``); the last ``X/Y`` or
    ``X out of Y``; a reply whose only number is X once stated scales ("1-10") are set aside. A number
    outside the range, an ``X/Y`` whose ``Y`` is not ``high``, or several different bare numbers are None.
    """
    body = answer_part(text).lower().replace("*", "")
    finals = re.findall(rf"final\s+{_LABELED}", body)
    if finals:
        return _on_scale(*finals[-1], low, high)
    dimensions = re.findall(rf"([a-z]+)\s+{_LABELED}", body)
    if len({name for name, _, _ in dimensions}) > 1:
        values = [_on_scale(v, d, low, high) for _, v, d in dimensions]
        return None if any(v is None for v in values) else sum(values) / len(values)  # type: ignore[arg-type]
    labeled = re.findall(_LABELED, body)
    if labeled:
        return _on_scale(*labeled[-1], low, high)
    ratios = re.findall(rf"({_NUMBER})\s*(?:/|out of)\s*({_NUMBER})", body)
    if ratios:
        return _on_scale(*ratios[-1], low, high)
    bare = {float(b) for b in re.findall(_NUMBER, re.sub(_SCALE, " ", body))}
    return _on_scale(str(bare.pop()), None, low, high) if len(bare) == 1 else None


# A word that turns the verdict after it around or leaves it open: "not", "can't", "neither", "nor" ...
_NEGATION = re.compile(
    r"(?:not|never|neither|nor|cannot|cant|dont|doesnt|wont|wouldnt|couldnt|shouldnt|isnt|unable|unsure)$|n't$"
)


def _negated(before: str) -> bool:
    """Whether the last three words of the clause ending ``before`` hold a negation ("I can't say |yes",
    "I would not choose |image 1", "neither image 1 nor image |2 is better")."""
    clause = re.split(r"[.;:!?,\n]", before)[-1]
    return any(_NEGATION.search(word) for word in re.findall(r"[a-z']+", clause)[-3:])


def parse_yes_no(text: str) -> float | None:
    """1.0 for a yes, 0.0 for a no, None when the reply says both, neither, or something else first, or
    negates its answer ("I can't say yes", "not yes"): a negated or undecided reply is no verdict."""
    body = text.lower().replace("\u2019", "'")
    words = re.findall(r"[a-z]+", body)
    first = re.search(r"(?<![a-z])(yes|no)(?![a-z])", body)
    if first is None:
        return None
    word = first.group(1)
    other = "no" if word == "yes" else "yes"
    # "Yes. ... no" is still a yes (the answer comes first); "yes or no?" echoed back is not an answer.
    if f"{word} or {other}" in " ".join(words) or _negated(body[: first.start()]):
        return None
    return 1.0 if word == "yes" else 0.0


_GOOD = ("better", "preferred", "superior", "best")
_PICK = r"(1|2|first|second)"


def _index(word: str) -> int:
    return 0 if word in ("1", "first") else 1


def parse_choice(text: str) -> int | None:
    """0 when the judge prefers the first image, 1 for the second, None when it is not clear which.

    Read from the reply's verdict (:func:`answer_part`): a JSON object's ``winner`` / ``choice`` / ``better``
    / ``answer``; stated verdicts (``Image 2 is better``, ``image 1 is worse``, ``I prefer the second``,
    ``Answer: 1``), which must all agree; a reply that is only the choice (``2``, ``Image 1``, ``The first
    one.``); a leading choice with its reason after it (``1, because ...``). A negated or undecided verdict
    (``Image 1 is not better``, ``I would not choose image 1``, ``Neither image 1 nor image 2 is better``,
    ``I can't pick 1 or 2``) makes the whole reply None: it is no verdict, not its opposite.
    """
    body = answer_part(text).lower().replace("*", "").replace("\u2019", "'").strip()
    try:
        reply = json.loads(body)
    except ValueError:
        reply = None
    if isinstance(reply, dict):
        value = next((reply[k] for k in ("winner", "choice", "better", "answer") if k in reply), None)
        return parse_choice(str(value)) if isinstance(value, int | str) and not isinstance(value, bool) else None
    verdicts = set()
    stated = (
        rf"\b{_PICK}(?:\s+(?:image|one|picture))?\s+(?:is|looks|seems)(n't)?\s+(?:(\w+)\s+)?"
        r"(better|preferred|superior|best|worse|inferior|worst)"
    )
    for match in re.finditer(stated, body):
        pick, nt, adverb, verdict = match.groups()
        # "Image 1 is not better", "is no better than", "isn't preferred", "neither 1 nor 2 is better":
        # a negated verdict is not its opposite (nor, for "no better", a tie); the reply is unreadable.
        if nt or adverb in ("not", "no", "never", "hardly") or _negated(body[: match.start()]):
            return None
        verdicts.add(_index(pick) if verdict in _GOOD else 1 - _index(pick))
    chosen = (
        r"(?:prefer|choose|choice|pick|select|winner|answer)\s*(?:is|:|would be)?\s*(?:the\s+)?(?:image\s*#?\s*)?"
        rf"\b{_PICK}\b"
    )
    for match in re.finditer(chosen, body):
        if _negated(body[: match.start()]):  # "I would not choose image 1", "I can't pick 1 or 2"
            return None
        verdicts.add(_index(match.group(1)))
    if verdicts:
        return verdicts.pop() if len(verdicts) == 1 else None
    only = re.fullmatch(rf"[\W_]*(?:the\s+)?(?:image\s*#?\s*)?{_PICK}(?:\s+(?:one|image))?[\W_]*", body)
    leading = re.match(r"(?:image\s*#?\s*)?(1|2)\s*[,.:;]", body)
    match = only or leading
    return _index(match.group(1)) if match else None


@dataclass(frozen=True)
class ChatReply:
    """A chat completion's text (None: the body was not a chat completion) and its ``finish_reason``."""

    text: str | None
    finish_reason: str | None = None


# UnifiedReward (CodeGoat24/UnifiedReward-qwen-7b and its Think variants) answers in formats it was trained on;
# these instructions ask for them, and the parsers read them (tests/test_rewards_vlm_judge.py has real replies).
UNIFIEDREWARD_INSTRUCTION = (
    "You are given an image generated from a text caption. Judge it on three axes, each from 1 to 5: "
    "Alignment (does the image show what the caption says), Coherence (is it free of glitches and distorted "
    "objects) and Style (how appealing it looks, whatever the caption). Answer in exactly this format:\n"
    "Alignment Score (1-5): X\nCoherence Score (1-5): Y\nStyle Score (1-5): Z\n\nText Caption: [{prompt}]"
)
UNIFIEDREWARD_THINK_INSTRUCTION = (
    "You are given a text caption and two images generated from it. Compare them on semantic consistency with "
    "the caption, aesthetics and authenticity, scoring each image from 1 to 10 on each, and add up the scores. "
    "Write all reasoning inside <think> and </think>. Then give the verdict inside <answer> and </answer>, "
    "exactly one of: Image 1 is better, Image 2 is better.\nCaption: {prompt}"
)
PRESETS: dict[str, dict[str, Any]] = {
    "unifiedreward": {"template": "score", "instruction": UNIFIEDREWARD_INSTRUCTION, "score_range": (1.0, 5.0)},
    "unifiedreward_think": {"template": "pairwise", "instruction": UNIFIEDREWARD_THINK_INSTRUCTION, "max_tokens": 2048},
}


def chat_reply(raw: bytes) -> ChatReply:
    """The text and ``finish_reason`` of an OpenAI chat completion body (text None when it is not one)."""
    try:
        choice = json.loads(raw)["choices"][0]
        content = choice["message"]["content"]
    except (ValueError, KeyError, IndexError, TypeError, RecursionError):
        return ChatReply(None)
    if isinstance(content, list):  # some servers return content parts
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    reason = choice.get("finish_reason") if isinstance(choice, dict) else None
    return ChatReply(content if isinstance(content, str) else None, reason if isinstance(reason, str) else None)
