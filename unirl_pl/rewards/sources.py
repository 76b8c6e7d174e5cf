"""Source images for rewards: what an editing sample started from, beside the image it became.

An editing prompt file pairs each instruction with a source image (``{"prompt": "make the sky red", "image":
"beach.png"}``); a reward on an edit compares the edited image with that source (CLIP's edit direction, an
EditReward-style judge). A reward opts in by declaring a ``sources`` parameter,
``reward(prompts, refined_prompts, images, sources=None)``, and then gets one item per sample: the source image
as a float32 ``(3, H, W)`` tensor in [0, 1] (each its own size: a source is never resized to its batch), or None
for a sample without one. Callers pass it only to rewards that declare it (:func:`accepts_sources`), so every
``reward(prompts, refined_prompts, images)`` still fits; a text-to-image run passes none.

The helpers here check the list a reward was given, and key a source by its pixels: the K samples of one prompt
share a source, which a reward then encodes (or embeds) once.
"""

from __future__ import annotations

import hashlib

import torch
from torch import Tensor

from unirl_pl.rewards.metadata import accepts_sources

__all__ = ["Source", "accepts_sources", "check_sources", "require_sources", "source_digest", "unique_sources"]

# One sample's source image: float32 (3, H, W) in [0, 1], or None (a sample without one).
Source = Tensor | None


def check_sources(items: object, n: int, reward: str = "reward") -> list[Source]:
    """``items`` as the source images of ``n`` samples: a list of ``n`` items, each a ``(3, H, W)`` floating
    tensor or None, else a ValueError naming ``reward`` and what is wrong."""
    if not isinstance(items, list | tuple):
        raise ValueError(f"{reward}: 'sources' must be a list of one source image (or None) per sample")
    if len(items) != n:
        raise ValueError(f"{reward}: {len(items)} source images for {n} samples")
    for i, item in enumerate(items):
        if item is None:
            continue
        if not isinstance(item, Tensor) or item.ndim != 3 or item.shape[0] != 3 or not item.is_floating_point():
            what = tuple(item.shape) if isinstance(item, Tensor) else type(item).__name__
            raise ValueError(f"{reward}: sources[{i}] must be a float (3, H, W) image in [0, 1] or None, got {what}")
    return list(items)


def require_sources(items: object, n: int, reward: str) -> list[Tensor]:
    """``items`` checked (:func:`check_sources`) with every sample holding a source: a reward that compares an
    edit with its source cannot score a sample without one, and says so instead of returning a number."""
    if items is None:
        raise ValueError(
            f"{reward}: this reward scores edits against their source images and was called without any "
            "(sources=None): train it on an editing prompt file (rows with an 'image'), or leave it out"
        )
    checked = check_sources(items, n, reward)
    missing = [i for i, s in enumerate(checked) if s is None]
    if missing:
        raise ValueError(f"{reward}: sample {missing[0]} has no source image ({len(missing)} of {n} samples)")
    return checked  # type: ignore[return-value]


def source_digest(image: Tensor) -> str:
    """A key of ``image``'s 8-bit pixels and size: the same for two tensors holding the same picture (the K copies
    of one prompt's source), whatever object or device they are."""
    pixels = (image.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).cpu().contiguous()
    digest = hashlib.blake2b(pixels.numpy().tobytes(), digest_size=16)
    digest.update(repr(tuple(pixels.shape)).encode("ascii"))
    return digest.hexdigest()


def unique_sources(items: list[Tensor]) -> tuple[list[Tensor], list[int]]:
    """The distinct source images in first-seen order and each item's index into them."""
    order: dict[str, int] = {}
    firsts: list[Tensor] = []
    index = []
    seen: dict[int, int] = {}  # id of a tensor already keyed: the same object is not hashed again
    for item in items:
        at = seen.get(id(item))
        if at is None:
            key = source_digest(item)
            if key not in order:
                order[key] = len(firsts)
                firsts.append(item)
            at = seen[id(item)] = order[key]
        index.append(at)
    return firsts, index
