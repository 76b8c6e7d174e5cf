"""Image statistics of a batch of images in ``[0, 1]``: what a generator that hacks a pixel-level reward changes.

Images are ``(N, C, H, W)`` (videos ``(N, F, C, H, W)`` are taken frame by frame, each frame an image of its
sample). Every function returns a plain float so the callback can log it and compare it with its baseline.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def _frames(images: Tensor) -> Tensor:
    """``(N, C, H, W)`` float64 images; a video's frames become images of their own."""
    if images.ndim == 5:
        images = images.flatten(0, 1)
    if images.ndim != 4:
        raise ValueError(f"images must be (N, C, H, W) or (N, F, C, H, W), got shape {tuple(images.shape)}")
    return images.detach().double().cpu()


def _luma(images: Tensor) -> Tensor:
    """``(N, H, W)`` luminance (Rec. 601 weights for RGB, the mean of the channels otherwise)."""
    x = _frames(images)
    if x.shape[1] == 3:
        weights = torch.tensor([0.299, 0.587, 0.114], dtype=x.dtype).view(1, 3, 1, 1)
        return (x * weights).sum(1)
    return x.mean(1)


def dark_fraction(images: Tensor, level: float = 0.05) -> float:
    """The share of pixels whose luminance is below ``level``: a generator darkening its images raises it."""
    return float((_luma(images) < level).double().mean())


def mean_luminance(images: Tensor) -> float:
    """The mean luminance in ``[0, 1]``: a generator brightening or washing out its images raises it (darkening is
    ``dark_fraction``'s)."""
    return float(_luma(images).mean())


def saturated_fraction(images: Tensor, level: float = 0.98) -> float:
    """The share of channel values at or above ``level`` or at or below ``1 - level``: clipped, burnt-out colour."""
    x = _frames(images)
    return float(((x >= level) | (x <= 1.0 - level)).double().mean())


def blank_fraction(images: Tensor, std: float = 0.02) -> float:
    """The share of images whose luminance varies less than ``std`` (standard deviation): blank or near-uniform."""
    luma = _luma(images)
    return float((luma.flatten(1).std(dim=1, unbiased=False) < std).double().mean())


def high_frequency_share(images: Tensor, radius: float = 0.25) -> float:
    """The share of the luminance's spectral energy (mean removed) at normalised frequency radius above ``radius``.

    The radius is ``sqrt(fy^2 + fx^2)`` in cycles per pixel (Nyquist is 0.5 on each axis). A checkerboard or a
    grid laid over the images moves energy to the highest frequencies and raises the share; a smooth image keeps
    it low. A batch with no energy at all (every image flat) has share 0.
    """
    luma = _luma(images)
    luma = luma - luma.mean(dim=(1, 2), keepdim=True)
    power = torch.fft.fft2(luma).abs().pow(2)
    h, w = luma.shape[-2:]
    fy, fx = torch.fft.fftfreq(h, dtype=luma.dtype), torch.fft.fftfreq(w, dtype=luma.dtype)
    high = (fy.view(-1, 1).pow(2) + fx.view(1, -1).pow(2)).sqrt() > radius
    total = float(power.sum())
    return float(power[:, high].sum()) / total if total > 0 else 0.0


def colourfulness(images: Tensor) -> float:
    """Hasler and Süsstrunk's colourfulness (2003), the batch mean, on the 0-255 scale they define it on.

    ``rg = R - G``, ``yb = (R + G) / 2 - B``; ``sqrt(std_rg^2 + std_yb^2) + 0.3 * sqrt(mean_rg^2 + mean_yb^2)``
    per image. Grey images score 0; oversaturated ones score high. Images without three channels score 0.
    """
    x = _frames(images) * 255.0
    if x.shape[1] != 3:
        return 0.0
    r, g, b = x[:, 0].flatten(1), x[:, 1].flatten(1), x[:, 2].flatten(1)
    rg, yb = r - g, 0.5 * (r + g) - b
    spread = (rg.std(dim=1, unbiased=False).pow(2) + yb.std(dim=1, unbiased=False).pow(2)).sqrt()
    centre = (rg.mean(dim=1).pow(2) + yb.mean(dim=1).pow(2)).sqrt()
    return float((spread + 0.3 * centre).mean())


def group_diversity(images: Tensor, groups: Sequence[object]) -> float:
    """The mean pairwise distance between the images of one group (one prompt), averaged over groups.

    The distance is the root-mean-square pixel difference. ``groups`` labels each image (its prompt, or its
    group id); groups of one image are skipped. A group that collapsed to one image scores 0. A video's frames
    stay with their sample. NaN when no group has two images.
    """
    x = images.detach().double().cpu().flatten(1)
    if len(groups) != x.shape[0]:
        raise ValueError(f"{len(groups)} group labels for {x.shape[0]} images")
    members: dict[object, list[int]] = {}
    for i, label in enumerate(groups):
        members.setdefault(label, []).append(i)
    means = []
    for rows in members.values():
        if len(rows) < 2:
            continue
        g = x[rows]
        d = torch.cdist(g, g) / g.shape[1] ** 0.5
        n = len(rows)
        means.append(float(d.sum()) / (n * (n - 1)))
    return sum(means) / len(means) if means else float("nan")


def image_stats(images: Tensor, groups: Sequence[object] | None = None) -> dict[str, float]:
    """Every image statistic of a batch, by its metric name (``dark_frac``, ``luminance``, ``blank_frac``,
    ``saturated_frac``, ``high_freq``, ``colourfulness`` and, with ``groups``, ``diversity``)."""
    stats = {
        "dark_frac": dark_fraction(images),
        "luminance": mean_luminance(images),
        "blank_frac": blank_fraction(images),
        "saturated_frac": saturated_fraction(images),
        "high_freq": high_frequency_share(images),
        "colourfulness": colourfulness(images),
    }
    if groups is not None:
        stats["diversity"] = group_diversity(images, groups)
    return stats
