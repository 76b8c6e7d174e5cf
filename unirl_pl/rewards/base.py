"""A reward as a component: the :class:`Reward` base every built-in scorer derives from, and :class:`RewardTerm`,
one weighted term of a recipe's ``model.rewards``.

A recipe names a term as any other part, by ``class_path`` with typed ``init_args``, so ``--help`` documents a
reward's arguments and a misspelt or mistyped one is refused when the recipe is parsed, before any model loads::

    rewards:
      - reward: {class_path: unirl_pl.rewards.PickScore, init_args: {dtype: float32}}
        weight: 1.0
      - reward: {class_path: unirl_pl.rewards.RefinerFormat, init_args: {max_words: 24}}
        weight: 0.2

The short form ``rewards: {pickscore: 1.0}`` with ``reward_args`` stays as an alias (the registry in
:mod:`unirl_pl.rewards.builtin`). A term's metric name (``reward/<name>``) is its ``name``, else its reward's
:attr:`Reward.name`, the alias the short form uses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from torch import Tensor


def reward_name(reward_class: type, name: str | None = None) -> str:
    """A term's metric name: ``name`` when given, else the class's :attr:`Reward.name`, else its name in lower case."""
    return name or getattr(reward_class, "name", "") or reward_class.__name__.lower()


class Reward:
    """A reward: ``reward(prompts, refined_prompts, images) -> one finite number per sample``.

    Subclass it (or write any callable with that signature and give its dotted path) and set :attr:`name`, the
    term's default metric name. ``images`` are ``(N, 3, H, W)`` in ``[0, 1]`` (videos ``(N, F, 3, H, W)``: a
    reward without ``accepts_video = True`` gets them frame by frame). A ``metadata`` keyword parameter, when
    declared, receives each sample's prompt metadata (:mod:`unirl_pl.rewards.metadata`); a ``replies`` keyword
    parameter each sample's raw refiner reply, None where unrefined (:mod:`unirl_pl.rewards.replies`); a ``sources``
    keyword parameter, in an editing run, each sample's source image (:mod:`unirl_pl.rewards.sources`).
    """

    name: ClassVar[str] = ""

    def __call__(self, prompts: list[str], refined_prompts: list[str], images: Tensor) -> Any:
        raise NotImplementedError(f"{type(self).__name__} must implement __call__(prompts, refined_prompts, images)")


@dataclass
class RewardTerm:
    """One weighted term of the reward.

    Args:
        reward: The reward, by ``class_path`` and ``init_args`` (any subclass of :class:`Reward`).
        weight: Its weight in the sum (a finite number; 0 logs the term without training on it). Negative only
            with ``allow_negative``.
        name: Its metric name, ``reward/<name>`` (default: the reward's ``name``, else its class name in lower case).
        allow_negative: Accept a negative ``weight``. A negative weight trains the run to lower this reward: what a
            penalty term wants (a reward that measures something to avoid, such as a length or an artifact
            score); a sign typed by mistake would do the same silently, so it must be asked for.
    """

    reward: Reward
    weight: float = 1.0
    name: str | None = None
    allow_negative: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.weight, int | float) and self.weight < 0 and not self.allow_negative:
            raise ValueError(
                f"reward term {self.term_name()!r} has weight {self.weight}: a negative weight trains the run to "
                "lower this reward. For a penalty term set allow_negative: true on the term (next to its weight); "
                "else give a weight >= 0"
            )

    def term_name(self) -> str:
        """The name this term is logged and reported under."""
        return reward_name(type(self.reward), self.name)
