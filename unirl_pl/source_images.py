"""Source images of editing prompts: read once, checked, and kept with their prompt row.

An editing prompt file is JSONL with rows ``{"prompt": "<instruction>", "image": "<path>"}``, the path relative to
the prompt file (or absolute). Every image is opened and checked before training starts, and a bad one is refused
with the prompt file, the line and the reason: a missing file, a file that is not an image, a truncated or corrupt
image, a colour mode the generators cannot read, more pixels than ``max_pixels``, and a decompression bomb (a
small file whose header claims an enormous image, refused before it is decoded). A file several rows name is read
once. The pixels are kept as uint8 and handed out as float32 ``(3, H, W)`` in [0, 1], the form every consumer
(refiner, generator, rewards) takes.
"""

from __future__ import annotations

import hashlib
import io
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from unirl_pl.errors import InputError

# Modes read as RGB without inventing anything: RGB itself, greyscale and palette images. Others are refused:
# RGBA/LA (transparent pixels have no colour to edit), CMYK, 16-bit and float modes (no agreed mapping to RGB).
SUPPORTED_MODES = ("RGB", "L", "P")
# A header may claim at most this many pixels per byte of file before the image counts as a decompression bomb.
# A PNG of one flat colour compresses about 1000:1; bombs reach millions to one.
_BOMB_PIXELS_PER_BYTE = 20_000


@dataclass(frozen=True, eq=False)
class SourceImage:
    """One prompt's source image.

    Args:
        path: The file it was read from.
        digest: SHA-256 of the file's bytes (keys every cache of features computed from the image).
        data: The pixels, uint8 ``(3, H, W)``.
    """

    path: str
    digest: str
    data: torch.Tensor

    @property
    def pixels(self) -> torch.Tensor:
        """The image as float32 ``(3, H, W)`` in [0, 1]."""
        return self.data.float() / 255.0

    @property
    def size(self) -> tuple[int, int]:
        """``(height, width)`` in pixels."""
        return int(self.data.shape[1]), int(self.data.shape[2])


def read_source_image(path: Path, where: str, max_pixels: int) -> SourceImage:
    """Read and check the image at ``path``; every refusal is an :class:`InputError` starting with ``where``."""
    if not path.is_file():
        raise InputError(f"{where}: source image {str(path)!r} does not exist")
    raw = path.read_bytes()

    def refuse(reason: str) -> InputError:
        return InputError(f"{where}: source image {str(path)!r} {reason}")

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(raw))
            width, height = image.size
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise refuse("is a decompression bomb (its header claims more pixels than Pillow will decode)") from None
    except (UnidentifiedImageError, OSError):
        raise refuse("is not an image Pillow can read") from None
    pixels = width * height
    if pixels > _BOMB_PIXELS_PER_BYTE * len(raw):
        raise refuse(f"is a decompression bomb: its {len(raw)}-byte file claims {width}x{height} pixels")
    if pixels > max_pixels:
        raise refuse(f"is {width}x{height} = {pixels} pixels, over data.max_image_pixels={max_pixels}")
    if image.mode not in SUPPORTED_MODES:
        raise refuse(f"has mode {image.mode!r}; convert it to one of {', '.join(SUPPORTED_MODES)}")
    try:
        array = np.asarray(image.convert("RGB"), dtype=np.uint8)
    except (OSError, ValueError, SyntaxError) as err:  # truncated data surfaces only when decoded
        raise refuse(f"is corrupt ({err})") from None
    data = torch.from_numpy(array.copy()).permute(2, 0, 1).contiguous()
    return SourceImage(str(path), hashlib.sha256(raw).hexdigest(), data)


def load_sources(
    source: str | list[str] | None, metadata: list[dict[str, Any] | None] | None, max_pixels: int
) -> list[SourceImage] | None:
    """The source image of every row of the prompt file ``source`` (aligned with its prompts), or None when no row
    names one. A row names one with a string field ``image``; then every row must (an editing run has no rows
    without a source). Files are read once each, however many rows name them."""
    rows = metadata or []
    if not isinstance(source, str) or not any(row is not None and "image" in row for row in rows):
        return None
    path = Path(source)
    lines = _row_lines(path)
    loaded: dict[Path, SourceImage] = {}
    out = []
    for i, row in enumerate(rows):
        where = f"{path}:{lines[i]}"
        name = None if row is None else row.get("image")
        if not isinstance(name, str) or not name.strip():
            raise InputError(
                f"{where}: every row of an editing prompt file needs a string field 'image' (a path relative to "
                f"the file); this row has {'none' if name is None else repr(name)}"
            )
        file = (path.parent / name).resolve()
        if file not in loaded:
            loaded[file] = read_source_image(file, where, max_pixels)
        out.append(loaded[file])
    return out


def _row_lines(path: Path) -> list[int]:
    """The line number of each non-blank line of ``path`` (the rows ``load_prompt_records`` kept, in order)."""
    with path.open("rb") as f:
        return [n for n, raw in enumerate(f, 1) if raw.strip()]


def check_edit_setup(data: Any, generator: Any, refiner: Any = None) -> None:
    """Refuse, before anything runs, an editing prompt file given to a generator that takes no source image: an
    :class:`InputError` naming the settings (one line from the CLI). An editing family given text prompts
    generates from text alone. A VLM refiner that could see the source images but does not load its image
    processor is warned about: it rewrites each instruction blind."""
    if data is None or not hasattr(data, "train_sources"):
        return
    family = type(getattr(generator, "expert", generator)).__name__
    edits = any(getattr(data, name) is not None for name in ("train_sources", "val_sources", "predict_sources"))
    if edits and not getattr(generator, "takes_source_images", False):
        raise InputError(
            f"data.prompts / data.val_prompts hold source images (rows with 'image'), but model.generator ({family}) "
            "generates from text alone: use an editing family (FluxKontextGenerator, QwenImageEditPlusGenerator, "
            "Flux2KleinGenerator, InContextEditGenerator) or prompt rows without 'image'"
        )
    if edits and hasattr(refiner, "sees_images") and not refiner.sees_images:
        warnings.warn(
            f"the prompts hold source images, but model.llm ({type(refiner).__name__}) does not see them: set "
            "model.llm.init_args.load_image_processor: true for a refiner that reads the image it edits",
            stacklevel=2,
        )
