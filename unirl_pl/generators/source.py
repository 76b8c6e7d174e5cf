"""What an editing family accepts as source images: a list of float ``(3, H, W)`` tensors in [0, 1], one per text."""

from __future__ import annotations

import torch


def check_images(images: list[torch.Tensor], n: int | None) -> list[torch.Tensor]:
    """``images`` as source images: a non-empty list (of ``n`` when given) of float (3, H, W) tensors in [0, 1]."""
    if not isinstance(images, (list, tuple)) or not images:
        raise ValueError("images must be a non-empty list of (3, H, W) tensors")
    if n is not None and len(images) != n:
        raise ValueError(f"{len(images)} source images for {n} texts: one per text")
    for i, image in enumerate(images):
        if not isinstance(image, torch.Tensor) or image.ndim != 3 or image.shape[0] != 3:
            shape = tuple(image.shape) if isinstance(image, torch.Tensor) else type(image).__name__
            raise ValueError(f"source image {i} must be a (3, H, W) tensor in [0, 1], got {shape}")
    return [image.float() for image in images]
