"""Per-sample metadata for rewards: what a prompt file says about a prompt besides its text.

A GenEval prompt file's rows carry the scene a prompt asks for (``{"tag": "counting", "include": [{"class":
"cat", "count": 3}], "prompt": "a photo of three cats"}``); a scorer checks the image against that spec, so
it must not have to parse it back out of the prompt. A reward opts in by declaring a ``metadata`` parameter,
``reward(prompts, refined_prompts, images, metadata=None)``, and then gets one item per sample: the JSONL row
of that sample's prompt (a dict), or None for a prompt without one. Callers pass it only to rewards that
declare it, so every ``reward(prompts, refined_prompts, images)`` still fits.
"""

from __future__ import annotations

import inspect
from typing import Any

# One sample's metadata: its prompt's JSONL row, or None (a .txt prompt, a row holding only "prompt").
Metadata = dict[str, Any] | None

_KEYWORD_KINDS = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


def accepts_keyword(fn: Any, name: str) -> bool:
    """Whether ``fn`` (a function, or an object whose ``__call__`` is read) declares a keyword ``name``.

    Only a parameter of that name counts: a ``**kwargs`` catch-all may forward to code that knows nothing
    of it, and a reward that did not ask for the extra input must be called exactly as before.
    """
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins and C callables have no signature to read
        return False
    param = signature.parameters.get(name)
    return param is not None and param.kind in _KEYWORD_KINDS


def accepts_metadata(fn: Any) -> bool:
    """Whether ``fn`` declares a ``metadata`` keyword (:func:`accepts_keyword`)."""
    return accepts_keyword(fn, "metadata")


def accepts_sources(fn: Any) -> bool:
    """Whether ``fn`` declares a ``sources`` keyword (and so is given each sample's source image when editing:
    :mod:`unirl_pl.rewards.sources`)."""
    return accepts_keyword(fn, "sources")


def check_per_sample(items: Any, n: int, key: str, kind: type, what: str) -> list[Any]:
    """``items`` as the ``key`` of ``n`` samples: a list of ``n`` items, each a ``kind`` (``what``, as a message
    names it) or None, else a ValueError saying what is wrong (the reward server answers it with 400)."""
    if not isinstance(items, list):
        raise ValueError(f"'{key}' must be a list of one {what} (or null) per sample, got {type(items).__name__}")
    if len(items) != n:
        raise ValueError(f"'{key}' has {len(items)} items for {n} samples")
    for i, item in enumerate(items):
        if item is not None and not isinstance(item, kind):
            raise ValueError(f"{key}[{i}] must be a {what} or null, got {type(item).__name__}")
    return items


def check_metadata(items: Any, n: int) -> list[Metadata]:
    """``items`` as the metadata of ``n`` samples: a list of ``n`` dicts or Nones, else a ValueError."""
    return check_per_sample(items, n, "metadata", dict, "JSON object")


class WithMetadata:
    """A weighted reward whose every call carries fixed per-sample metadata and refiner replies (either may be
    None), and, when editing, the samples' source images, for a caller that only knows
    ``reward(prompts, refined_prompts, images)`` (validation and predict score a batch that way).

    ``sources`` goes to the wrapped reward only when it is not None, so a wrapped reward that knows nothing of
    source images is called as before. Everything else (``terms``, ``weights``, ...) is the wrapped reward's.
    """

    def __init__(
        self,
        reward: Any,
        metadata: list[Metadata] | None,
        replies: list[str | None] | None = None,
        sources: list[Any] | None = None,
    ) -> None:
        self.reward, self.metadata, self.replies, self.sources = reward, metadata, replies, sources

    def __getattr__(self, name: str) -> Any:
        # Only called for names not set in __init__: the wrapped reward answers them. Its own fields are
        # refused here, so a half-built copy (copy, pickle) cannot recurse looking for ``reward``.
        if name in ("reward", "metadata", "replies", "sources"):
            raise AttributeError(name)
        return getattr(self.reward, name)

    def __call__(self, prompts: list[str], refined_prompts: list[str], images: Any, **kwargs: Any) -> Any:
        if self.sources is not None:
            kwargs = {"sources": self.sources, **kwargs}
        return self.reward(prompts, refined_prompts, images, metadata=self.metadata, replies=self.replies, **kwargs)
