"""Refinement statistics: what a prompt refiner that hacks its reward changes in the texts it writes.

Texts are split into lower-case words (``\\w+``). Each function returns plain numbers so the callback can log
them and compare them with their baselines. A refinement is compared with its own original prompt: the pairs
``(prompts[i], refinements[i])`` line up.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence

WORD = re.compile(r"\w+")


def words(text: str) -> list[str]:
    """The lower-case words of ``text``."""
    return WORD.findall(text.lower())


def ngrams(tokens: Sequence[str], n: int) -> list[tuple[str, ...]]:
    """The consecutive ``n``-grams of ``tokens``, in order (none when there are fewer than ``n`` tokens)."""
    return [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]


def _check_pairs(prompts: Sequence[str], refinements: Sequence[str]) -> None:
    if len(prompts) != len(refinements):
        raise ValueError(f"{len(prompts)} prompts for {len(refinements)} refinements")


def mean_length(texts: Sequence[str]) -> float:
    """The mean length in words (0 for no texts): a refiner padding its rewrites makes it grow."""
    return sum(len(words(t)) for t in texts) / len(texts) if texts else 0.0


def distinct_n(texts: Sequence[str], n: int = 2) -> float:
    """The mean over texts of (distinct ``n``-grams / ``n``-grams) in each text; texts shorter than ``n`` words are
    skipped (1.0 when none is long enough). A refiner that loops on a phrase drives it toward 0."""
    shares = []
    for text in texts:
        grams = ngrams(words(text), n)
        if grams:
            shares.append(len(set(grams)) / len(grams))
    return sum(shares) / len(shares) if shares else 1.0


def novel_token_share(prompts: Sequence[str], refinements: Sequence[str]) -> float:
    """The share of the refinements' words (pooled) that are not among their own prompt's words (0 when they have
    none): a refiner drifting away from what was asked, or stuffing words a reward likes, raises it."""
    _check_pairs(prompts, refinements)
    novel = total = 0
    for prompt, refined in zip(prompts, refinements, strict=True):
        known, tokens = set(words(prompt)), words(refined)
        novel += sum(t not in known for t in tokens)
        total += len(tokens)
    return novel / total if total else 0.0


def recurring_phrase(prompts: Sequence[str], refinements: Sequence[str], n: int = 3) -> tuple[float, str]:
    """The ``n``-gram that most prompts' refinements add (it is not in their prompt), and the share of prompts
    whose refinements contain it.

    Counted over distinct prompts, so the several refinements of one prompt agreeing is not a recurrence; what
    this catches is one phrase appended to unrelated prompts ("highly detailed, trending on artstation"). Ties go
    to the phrase seen first. ``(0.0, "")`` with fewer than two distinct prompts or no added ``n``-gram.
    """
    _check_pairs(prompts, refinements)
    added: dict[str, set[tuple[str, ...]]] = {}
    for prompt, refined in zip(prompts, refinements, strict=True):
        own = set(ngrams(words(prompt), n))
        added.setdefault(prompt, set()).update(g for g in ngrams(words(refined), n) if g not in own)
    if len(added) < 2:
        return 0.0, ""
    counts: Counter[tuple[str, ...]] = Counter(g for grams in added.values() for g in sorted(grams))
    if not counts:
        return 0.0, ""
    phrase, count = counts.most_common(1)[0]
    return count / len(added), " ".join(phrase)


def refinement_stats(prompts: Sequence[str], refinements: Sequence[str]) -> dict[str, float]:
    """Every refinement statistic, by its metric name (``length``, ``distinct_2``, ``novel_share``,
    ``recurring_phrase``)."""
    share, _ = recurring_phrase(prompts, refinements)
    return {
        "length": mean_length(refinements),
        "distinct_2": distinct_n(refinements, 2),
        "novel_share": novel_token_share(prompts, refinements),
        "recurring_phrase": share,
    }
