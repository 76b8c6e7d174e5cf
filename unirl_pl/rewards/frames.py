"""Frame sampling for image rewards on videos: score every k-th frame and reduce the frames' scores."""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
from torch import Tensor

FrameReduce = Literal["mean", "min"]


def check_frame_args(frame_stride: int, frame_reduce: str) -> None:
    """Refuse a stride below 1 or a reduction other than ``mean``/``min``, naming the bad value."""
    if frame_stride < 1:
        raise ValueError(f"frame_stride must be >= 1, got {frame_stride}")
    if frame_reduce not in ("mean", "min"):
        raise ValueError(f"frame_reduce must be 'mean' or 'min', got {frame_reduce!r}")


def sample_frames(videos: Tensor, stride: int) -> Tensor:
    """Frames ``0, stride, 2*stride, ...`` of videos (N, F, 3, H, W); the first frame is always kept."""
    if videos.ndim != 5:
        raise ValueError(f"expected videos (N, F, 3, H, W), got shape {tuple(videos.shape)}")
    return videos[:, ::stride]


def reduce_frames(values: Tensor, how: FrameReduce) -> Tensor:
    """A video's score from its frames' scores (N, F'): their mean, or the worst frame (``min``).

    ``min`` is the stricter choice for rewards where one bad frame spoils the clip (text that flickers
    out, a face that melts); ``mean`` rewards the clip on average.
    """
    return values.mean(1) if how == "mean" else values.min(1).values


def score_video_frames(
    score_images: Callable[[Tensor, list[str]], Tensor],
    texts: list[str],
    videos: Tensor,
    stride: int,
    how: FrameReduce,
) -> Tensor:
    """Score videos with an image scorer ``score_images(frames (M, 3, H, W), texts (M,)) -> (M,)``.

    Every ``stride``-th frame of each video is scored with its video's text, then reduced per video.
    """
    frames = sample_frames(videos, stride)
    n, f = frames.shape[:2]
    per_frame = score_images(frames.flatten(0, 1), [t for t in texts for _ in range(f)])
    return reduce_frames(torch.as_tensor(per_frame).reshape(n, f), how)
