"""A reward term's values: checked, averaged over video frames, normalized within groups, summarized.

:class:`~unirl_pl.rewards.builtin.WeightedSum` calls a reward and hands its output here: a value that is not
a real number, or the wrong count of them, is an error naming the reward. These functions know nothing of
the registry, so the registry's module imports them and not the other way round.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import Tensor

# Every reward's signature: (prompts, refined prompts, images) -> one number per sample.
RewardFn = Callable[[list[str], list[str], Tensor], list[float]]


class RewardTerms(dict[str, Tensor]):
    """Each term's raw values (N,) by reward name, as :class:`~unirl_pl.rewards.builtin.WeightedSum`
    returns them.

    ``combined`` is what advantages should be computed from: the weighted sum of the raw terms, or with
    ``normalize="group"`` the weighted sum of the group-normalized terms (NaN where the total is NaN).
    """

    combined: Tensor


def group_normalize(values: Tensor, groups: Tensor, scale: Tensor | float | None = None, eps: float = 1e-4) -> Tensor:
    """``(v - mean_g) / (scale + eps)``: each value centred on its group ``g``'s mean, over the finite values,
    and divided by one scale for the whole batch, ``scale`` (the term's std over every rank) or else the
    population std of this batch's finite values. Non-finite values stay NaN.

    The scale is the batch's, not the group's: a nearly solved group (23 samples at 1.0, one at 0.95) divided
    by its own tiny std would turn its one miss into the advantage clip; over the batch it stays a small
    number, as in Flow-GRPO's ``global_std``. A group whose values are all equal becomes 0 whatever their level.
    """
    v = values.double()
    finite = torch.isfinite(v)
    _, inverse = torch.unique(groups, return_inverse=True)
    n = int(inverse.max()) + 1 if len(inverse) else 0
    zeros = torch.zeros(n, dtype=v.dtype)
    count = zeros.index_add(0, inverse, finite.to(v.dtype)).clamp_min(1)
    clean = torch.where(finite, v, torch.zeros_like(v))
    mean = zeros.index_add(0, inverse, clean) / count
    dev = torch.where(finite, v - mean[inverse], torch.zeros_like(v))
    if scale is None:
        scale = v[finite].std(unbiased=False) if bool(finite.any()) else torch.tensor(0.0, dtype=v.dtype)
    scale = torch.as_tensor(scale, dtype=v.dtype)
    # A sample at its group's mean is 0 even where the batch has no spread (0/0 with eps=0).
    out = torch.where(dev == 0, torch.zeros_like(dev), dev / (scale + eps))
    return torch.where(finite, out, torch.nan).to(values.dtype)


def term_stats(parts: dict[str, Tensor], unscored: bool = False) -> dict[str, float]:
    """Each term's raw mean (``<name>``) and population std (``<name>_std``) over its finite values, the
    numbers logged as ``reward/<name>`` and ``reward/<name>_std`` (NaN for a term with no finite value).

    With ``unscored`` (a run that drops non-finite rewards) also ``<name>_unscored``: the fraction of samples
    the term gave no number (a judge's unreadable replies and failed requests), logged every step so a judge
    going bad shows as a curve.
    """
    stats: dict[str, float] = {}
    for name, values in parts.items():
        finite = values[torch.isfinite(values)].double()
        stats[name] = float(finite.mean()) if len(finite) else math.nan
        stats[f"{name}_std"] = float(finite.std(unbiased=False)) if len(finite) else math.nan
        if unscored:
            stats[f"{name}_unscored"] = 1.0 - len(finite) / len(values) if len(values) else 0.0
    return stats


def unique_prompt_groups(prompts: list[str]) -> tuple[list[str], Tensor]:
    """The distinct prompts in first-seen order and each sample's group id (its prompt's index)."""
    order = list(dict.fromkeys(prompts))
    where = {p: i for i, p in enumerate(order)}
    return order, torch.tensor([where[p] for p in prompts], dtype=torch.long)


def is_real(value: Any) -> bool:
    """A real number: Python/numpy ints, floats and bools, or a one-element real tensor."""
    if isinstance(value, Tensor):
        return value.numel() == 1 and not value.dtype.is_complex
    return isinstance(value, int | float | np.integer | np.floating | np.bool_)


def as_values(name: str, values: Any, expected: int, what: str) -> Tensor:
    """A reward's output as a float32 (N,) CPU tensor; wrong counts and non-numbers are errors naming the reward."""
    if isinstance(values, Tensor | np.ndarray):
        if values.ndim != 1:
            raise ValueError(f"reward {name!r} returned an array of shape {tuple(values.shape)}; it must be 1-D")
        if isinstance(values, Tensor):
            real = not values.dtype.is_complex
        else:
            real = values.dtype == np.bool_ or (
                np.issubdtype(values.dtype, np.number) and not np.issubdtype(values.dtype, np.complexfloating)
            )
        if not real:
            raise TypeError(f"reward {name!r} returned an array of {values.dtype}, not real numbers")
        if len(values) != expected:
            raise ValueError(f"reward {name!r} returned {len(values)} values for {expected} {what}")
        tensor = values.detach() if isinstance(values, Tensor) else torch.from_numpy(np.asarray(values))
        return tensor.to(device="cpu", dtype=torch.float32)
    if isinstance(values, str | bytes | dict) or not hasattr(values, "__len__"):
        raise TypeError(f"reward {name!r} returned type {type(values).__name__}, not a list of numbers")
    if len(values) != expected:
        raise ValueError(f"reward {name!r} returned {len(values)} values for {expected} {what}")
    for i, value in enumerate(values):
        if not is_real(value):
            raise TypeError(
                f"reward {name!r} returned {value!r} (type {type(value).__name__}) for sample {i}; "
                "rewards must return real numbers"
            )
    return torch.tensor([float(v) for v in values], dtype=torch.float32)


def frame_mean(name: str, fn: RewardFn, prompts: list[str], refined: list[str], videos: Tensor) -> Tensor:
    """An image reward on videos (N, F, 3, H, W): every frame scored with its video's prompts, then averaged.

    Rewards that score videos themselves set ``accepts_video = True`` and get the 5-D tensor.
    """
    n, f = videos.shape[:2]
    values = fn([p for p in prompts for _ in range(f)], [r for r in refined for _ in range(f)], videos.flatten(0, 1))
    return as_values(name, values, n * f, "frames").view(n, f).mean(1)
