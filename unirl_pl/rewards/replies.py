"""The refiner's raw replies for rewards: what the refiner wrote, before its reply was parsed into a prompt.

A reward on the refined prompt sees only what the generator was given; one on the refiner's manners (PromptRL's
format reward: was the prompt inside ``<answer>...</answer>``?) needs the reply itself, which parsing has
already taken apart. A reward opts in by declaring a ``replies`` parameter,
``reward(prompts, refined_prompts, images, replies=None)``, and then gets one item per sample: the decoded
reply of that sample's refinement (special tokens dropped, cut at its end token), or None for a sample that
kept the original prompt (``num_skip_refinement``, or a run without a refiner). Training, validation and
``predict`` pass it to the rewards that declare it; a caller of its own may not, so a reward must accept
``replies=None``.
"""

from __future__ import annotations

from typing import Any

from unirl_pl.rewards.metadata import accepts_keyword, check_per_sample

# One sample's reply: the refiner's decoded text, or None for a sample that was not refined.
Reply = str | None


def accepts_replies(fn: Any) -> bool:
    """Whether ``fn`` declares a ``replies`` keyword (and so is given each sample's raw reply)."""
    return accepts_keyword(fn, "replies")


def check_replies(items: Any, n: int) -> list[Reply]:
    """``items`` as the replies of ``n`` samples: a list of ``n`` strings or Nones, else a ValueError."""
    return check_per_sample(items, n, "replies", str, "string")
