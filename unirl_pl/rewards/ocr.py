"""OCR reward: how well an image renders the quoted text its prompt asks for (Flow-GRPO's text metric)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from unirl_pl.rewards.base import Reward

# The first "..." span of a prompt is the text to render; typographic quotes count too, since prompt
# sets written by hand or by an LM often use them.
_QUOTED = re.compile(r'["\u201c\u201d]([^"\u201c\u201d]*)["\u201c\u201d]')
_SPACE = re.compile(r"\s+")


def quoted_text(prompt: str) -> str | None:
    """The text inside the first pair of double quotes of ``prompt``, or None if there is none."""
    match = _QUOTED.search(prompt)
    return match.group(1) if match else None


def normalize_text(text: str) -> str:
    """Lowercase and drop all whitespace, so that case and word spacing are not scored."""
    return _SPACE.sub("", text).lower()


def edit_distance(a: str, b: str) -> int:
    """Levenshtein distance (unit-cost insertions, deletions, substitutions) between ``a`` and ``b``."""
    if len(a) < len(b):
        a, b = b, a
    # One row of the dynamic-programming table over the shorter string keeps memory O(min(len)).
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, start=1):
        cur = [i]
        for j, cb in enumerate(b, start=1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


def ocr_score(recognized: str, target: str) -> float:
    """Flow-GRPO's text score in [0, 1]: ``1 - min(1, distance / len(target))`` on normalized strings.

    The target appearing anywhere in the recognized text scores 1 (extra text around it, like other
    signage in the scene, is not penalized), and the distance is capped at ``len(target)`` so that a
    lot of unrelated text cannot drive the score below 0. An empty target scores 0.
    """
    recognized, target = normalize_text(recognized), normalize_text(target)
    if not target:
        return 0.0
    dist = 0 if target in recognized else min(edit_distance(recognized, target), len(target))
    return 1.0 - dist / len(target)


class OCRReward(Reward):
    """Score how exactly each image renders the text quoted in its original prompt, via RapidOCR.

    Follows Flow-GRPO's OCR reward: the target is the text inside the first pair of double quotes of
    the *original* prompt (``a sign that says "HELLO"`` -> ``HELLO``), the recognized text is every
    OCR line above ``min_confidence`` joined, both are lowercased with whitespace removed, and the
    score is ``1 - min(1, edit_distance / len(target))`` (1 if the target occurs verbatim). A prompt
    with no quoted text (or only ``""``) scores 0 rather than raising, so a data set that mixes text
    and non-text prompts can still train with this reward next to others; give such prompts weight
    through other rewards. Videos (N, F, 3, H, W) score each of ``video_frames`` evenly spaced frames
    (all if None) and average. Needs the optional extra: ``pip install -e .[ocr]``
    (``rapidocr-onnxruntime``, whose ONNX models ship in the wheel, so it runs offline on CPU).

    Args:
        min_confidence: Recognized lines scoring below this are dropped (RapidOCR's ``text_score``;
            0.5 matches PaddleOCR's default ``drop_score`` that Flow-GRPO runs with).
        num_threads: ONNX Runtime intra-op threads per model; None keeps ONNX Runtime's default.
        use_angle_cls: Run the 180-degree text-direction classifier (Flow-GRPO leaves it off).
        video_frames: How many evenly spaced frames of a video to read; None reads all.
        rec_model_path: A recognition model (ONNX) to use instead of the wheel's Chinese+English PP-OCRv4 one,
            e.g. PaddleOCR's English ``en_PP-OCRv4_rec`` exported to ONNX (Flow-GRPO reads with PaddleOCR's
            ``lang="en"``); needs ``rec_keys_path``.
        rec_keys_path: That model's character dictionary (``en_dict.txt`` for the English model).
    """

    name = "ocr"

    accepts_video = True  # reads (N, F, 3, H, W) itself

    def __init__(
        self,
        min_confidence: float = 0.5,
        num_threads: int | None = None,
        use_angle_cls: bool = False,
        video_frames: int | None = 4,
        rec_model_path: str | None = None,
        rec_keys_path: str | None = None,
    ) -> None:
        if (rec_model_path is None) != (rec_keys_path is None):
            raise ValueError("reward 'ocr': rec_model_path and rec_keys_path go together (a model and its characters)")
        for key, path in (("rec_model_path", rec_model_path), ("rec_keys_path", rec_keys_path)):
            if path is not None and not Path(path).is_file():
                raise ValueError(f"reward 'ocr': {key} {path!r} is not a file")
        if not 0.0 <= min_confidence <= 1.0:
            raise ValueError(f"min_confidence must be in [0, 1], got {min_confidence}")
        if video_frames is not None and video_frames < 1:
            raise ValueError(f"video_frames must be >= 1 or None, got {video_frames}")
        try:
            import rapidocr_onnxruntime  # noqa: F401
        except ImportError as err:
            raise ImportError(
                "the 'ocr' reward needs rapidocr-onnxruntime: install the extra with `pip install -e .[ocr]` "
                "(or `pip install rapidocr-onnxruntime`)"
            ) from err
        self.min_confidence = min_confidence
        self.num_threads = num_threads
        self.use_angle_cls = use_angle_cls
        self.rec_model_path, self.rec_keys_path = rec_model_path, rec_keys_path
        self.video_frames = video_frames
        # Built on first use: ONNX Runtime sessions cannot be pickled, and a reward may be
        # constructed in one process and sent to others before it scores anything.
        self._engine: Any = None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_engine"] = None
        return state

    @property
    def engine(self) -> Any:
        """The RapidOCR engine, created on first access."""
        if self._engine is None:
            from rapidocr_onnxruntime import RapidOCR

            kwargs: dict[str, Any] = {"text_score": self.min_confidence, "print_verbose": False}
            if self.num_threads is not None:
                kwargs["intra_op_num_threads"] = self.num_threads
            if self.rec_model_path is not None:
                kwargs |= {"rec_model_path": self.rec_model_path, "rec_keys_path": self.rec_keys_path}
            self._engine = RapidOCR(**kwargs)
        return self._engine

    def recognize(self, image: np.ndarray) -> str:
        """All text RapidOCR reads in one RGB uint8 (H, W, 3) image, lines joined in reading order."""
        # RapidOCR treats a numpy array as OpenCV BGR.
        result, _ = self.engine(np.ascontiguousarray(image[..., ::-1]), use_cls=self.use_angle_cls)
        if not result:
            return ""
        return "".join(line[1] for line in result if float(line[2]) >= self.min_confidence)

    def _frames(self, images: Tensor) -> Tensor:
        """(N, K, 3, H, W) uint8 frames to read: K = 1 for images, up to ``video_frames`` for videos."""
        if images.dim() == 4:
            images = images.unsqueeze(1)
        elif images.dim() != 5:
            raise ValueError(f"expected images (N, 3, H, W) or videos (N, F, 3, H, W), got shape {tuple(images.shape)}")
        if self.video_frames is not None and images.shape[1] > self.video_frames:
            idx = torch.linspace(0, images.shape[1] - 1, self.video_frames).round().long()
            images = images[:, idx]
        return (images.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).cpu()

    @torch.no_grad()
    def __call__(self, prompts: list[str], refined_prompts: list[str], images: Tensor) -> list[float]:
        frames = self._frames(images)
        if len(prompts) != frames.shape[0]:
            raise ValueError(f"{len(prompts)} prompts for {frames.shape[0]} images")
        scores = []
        for prompt, clip in zip(prompts, frames, strict=True):
            target = quoted_text(prompt)
            if target is None or not normalize_text(target):
                scores.append(0.0)  # nothing to render: documented as 0, no OCR run
                continue
            per_frame = [ocr_score(self.recognize(f.permute(1, 2, 0).numpy()), target) for f in clip]
            scores.append(float(np.mean(per_frame)))
        return scores
