"""A reward served over HTTP: the client half of the protocol, plus the image codec both halves share.

Large reward models (PickScore, HPSv2, ImageReward, GenEval's detector, ...) often pin dependencies
that clash with the trainer's, so they run as a separate process, possibly on another machine, and
the trainer POSTs its samples to them. Only the standard library is used, so the client adds no
dependency. Protocol (see docs/rewards.md): POST ``{"prompts": [...], "refined_prompts": [...],
"images": [...]}`` where each image is a base64-encoded PNG (or JPEG) string and each video a list
of such strings, one per frame; the reply is ``{"scores": [float, ...]}``, one finite number per
sample. When the prompts carry metadata (a JSONL prompt file's other fields, such as GenEval's ``include``),
the request also holds ``"metadata": [...]``, one JSON object (or null) per sample; when they carry source
images (an editing run), ``"sources": [...]``, one base64 image (or null) per sample, encoded as the images are
(each at its own size).
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import math
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from unirl_pl.rewards.base import Reward
from unirl_pl.rewards.metadata import Metadata, check_metadata, check_per_sample
from unirl_pl.rewards.sources import Source, check_sources, unique_sources
from unirl_pl.rewards.transport import MAX_REPLY_BYTES, RewardServerError, post

IMAGE_FORMATS = {"png": "PNG", "jpeg": "JPEG", "jpg": "JPEG"}
# The only formats decode_images opens: PIL would otherwise try every plugin it has, and some (EPS)
# hand the payload to external programs such as Ghostscript.
DECODE_FORMATS = ("PNG", "JPEG")
MAX_IMAGE_PIXELS = 4096 * 4096  # per image or video frame
MAX_TOTAL_PIXELS = 2**28  # per request: 256 images of 1024x1024, about 3 GiB as float32 RGB


class ImageTooLarge(ValueError):
    """An image whose declared size is over the decoder's pixel limit (the server answers 413)."""


def encode_images(images: Tensor, image_format: str = "png") -> list[str] | list[list[str]]:
    """Base64 strings for (N, 3, H, W) images, or lists of them (one per frame) for (N, F, 3, H, W) videos.

    Pixels are quantized to 8 bits, so a server sees ``round(x * 255) / 255`` of each value; PNG
    is lossless beyond that, JPEG (quality 95) is smaller but lossy.
    """
    fmt = IMAGE_FORMATS.get(image_format.lower())
    if fmt is None:
        raise ValueError(f"image_format must be one of {sorted(IMAGE_FORMATS)}, got {image_format!r}")
    if images.dim() not in (4, 5):
        raise ValueError(f"expected images (N, 3, H, W) or videos (N, F, 3, H, W), got shape {tuple(images.shape)}")
    arr = (images.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).cpu()
    arr = arr.movedim(-3, -1).numpy()  # channels last, as PIL wants

    def one(img: np.ndarray) -> str:
        buf = io.BytesIO()
        extra = {"quality": 95} if fmt == "JPEG" else {"compress_level": 1}  # PNG: favour speed over size
        Image.fromarray(img).save(buf, format=fmt, **extra)
        return base64.b64encode(buf.getvalue()).decode("ascii")

    if arr.ndim == 4:
        return [one(img) for img in arr]
    return [[one(frame) for frame in clip] for clip in arr]


class _Pixels:
    """Decodes base64 PNG/JPEG images one at a time, counting their pixels against a per-image and a running
    per-request limit, both read from each image's header before any pixel is decompressed."""

    def __init__(self, max_image_pixels: int, max_total_pixels: int, used: int = 0) -> None:
        self.max_image_pixels, self.max_total_pixels, self.total = max_image_pixels, max_total_pixels, used

    def decode(self, text: Any, where: str) -> np.ndarray:
        """The RGB pixels (H, W, 3) uint8 of one image; ValueError (ImageTooLarge) naming ``where`` otherwise."""
        if not isinstance(text, str):
            raise ValueError(f"{where}: expected a base64 string, got {type(text).__name__}")
        if text.startswith("data:"):
            text = text.partition(",")[2]
        try:
            data = base64.b64decode(text, validate=True)
        except (binascii.Error, ValueError) as err:
            raise ValueError(f"{where}: not a base64-encoded image ({err})") from None
        try:
            with Image.open(io.BytesIO(data), formats=DECODE_FORMATS) as img:
                # Image.open reads the header only: refuse a decompression bomb before decoding it.
                width, height = img.size
                self.total += width * height
                if width * height > self.max_image_pixels:
                    raise ImageTooLarge(
                        f"{where}: {width}x{height} is over the limit of {self.max_image_pixels} pixels per image"
                    )
                if self.total > self.max_total_pixels:
                    raise ImageTooLarge(f"{where}: the images declare over {self.max_total_pixels} pixels in all")
                return np.array(img.convert("RGB"))
        except ImageTooLarge:
            raise
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as err:
            # PIL's own limit, checked inside Image.open (the warning is raised where warnings are errors).
            raise ImageTooLarge(f"{where}: {err}") from None
        except Image.UnidentifiedImageError:
            raise ValueError(f"{where}: not a {' or '.join(DECODE_FORMATS)} image (the formats accepted)") from None
        except Exception as err:  # truncated or corrupt data raises many types inside PIL: all the sender's fault
            raise ValueError(f"{where}: cannot decode the image ({type(err).__name__}: {err})") from None


def decode_images(
    items: list[Any], max_image_pixels: int = MAX_IMAGE_PIXELS, max_total_pixels: int = MAX_TOTAL_PIXELS
) -> Tensor:
    """The inverse of :func:`encode_images`: float (N, 3, H, W) or (N, F, 3, H, W) in [0, 1].

    Accepts plain base64 or ``data:image/...;base64,`` URIs of PNG or JPEG images only. All images (and
    all frames) must share one size, since rewards take a single stacked tensor; a ``ValueError`` says
    what is wrong. An image declaring more than ``max_image_pixels`` pixels, or a list declaring more
    than ``max_total_pixels`` in all, raises :class:`ImageTooLarge` before any pixel is decompressed.
    """
    if not isinstance(items, list) or not items:
        raise ValueError("'images' must be a non-empty list")
    budget = _Pixels(max_image_pixels, max_total_pixels)
    one = budget.decode

    is_video = isinstance(items[0], list)
    if any(isinstance(item, list) != is_video for item in items):
        raise ValueError("'images' mixes images (strings) and videos (lists of frames)")
    if is_video:
        if not all(items):
            raise ValueError("'images' has a video without frames")
        arrays = [np.stack([one(f, f"images[{i}][{j}]") for j, f in enumerate(clip)]) for i, clip in enumerate(items)]
    else:
        arrays = [one(item, f"images[{i}]") for i, item in enumerate(items)]
    shapes = {a.shape for a in arrays}
    if len(shapes) > 1:
        raise ValueError(f"images differ in shape {sorted(shapes)}; send one size per request")
    return torch.from_numpy(np.stack(arrays)).movedim(-1, -3).float() / 255


def decode_sources(
    items: Any,
    n: int,
    max_image_pixels: int = MAX_IMAGE_PIXELS,
    max_total_pixels: int = MAX_TOTAL_PIXELS,
    used_pixels: int = 0,
) -> list[Tensor | None]:
    """A request's ``"sources"``: one base64 PNG/JPEG (or null) per sample, each decoded to float ``(3, H, W)`` in
    [0, 1] at its own size. The checks are :func:`decode_images`' (the formats, corrupt data, ``max_image_pixels``
    per image from its header), and the sources' pixels count with the ``used_pixels`` of the request's images
    against ``max_total_pixels``; a list that is not ``n`` strings or nulls is a ``ValueError``."""
    check_per_sample(items, n, "sources", str, "base64 image string")
    budget = _Pixels(max_image_pixels, max_total_pixels, used_pixels)
    decoded: dict[str, Tensor] = {}  # a group's K samples share one source: decoded once
    out: list[Tensor | None] = []
    for i, item in enumerate(items):
        if item is None:
            out.append(None)
            continue
        if item not in decoded:
            decoded[item] = torch.from_numpy(budget.decode(item, f"sources[{i}]")).movedim(-1, 0).float() / 255
        out.append(decoded[item])
    return out


def encode_sources(sources: list[Source], image_format: str = "png") -> list[str | None]:
    """Base64 strings of per-sample source images (each ``(3, H, W)`` at its own size), None kept; a source
    repeated across samples is encoded once."""
    present = [s for s in sources if s is not None]
    firsts, index = unique_sources(present)
    encoded = [encode_images(s[None], image_format)[0] for s in firsts]
    where = iter(index)
    return [None if s is None else encoded[next(where)] for s in sources]  # type: ignore[misc]


class HTTPReward(Reward):
    """A reward computed by a remote server: POSTs the samples as JSON and returns the scores it sends back.

    Samples go in batches of ``batch_size`` as ``{"prompts", "refined_prompts", "images"}`` (images
    base64-encoded, videos as per-frame lists; see :func:`encode_images`) and each reply must be
    ``{"scores": [...]}`` with one finite number per sample. Given per-sample ``metadata`` (each prompt's
    JSONL row: a GenEval server scores against its ``include`` spec), a request also holds ``"metadata"``,
    that batch's slice, one object or null per sample; without it the request is as before. Given source images
    (``sources``, an editing run: :mod:`unirl_pl.rewards.sources`) and ``send_sources``, a request also holds
    ``"sources"``, one base64 image (or null) per sample in ``image_format``, each at its own size. Each request
    must be answered in full within ``timeout_s``; a timeout, a refused or dropped connection, a 5xx, a 408 or a
    429 is retried ``max_retries`` times with exponential backoff (``backoff_s``, then twice that, ...; a 429/503's
    ``Retry-After`` replaces the wait, and fails the request at once if it reaches past the budget), so one request
    takes at most ``timeout_s * (max_retries + 1) + backoff_s * (2 ** max_retries - 1)`` seconds. Then,
    or at once on another 4xx, a redirect (never followed), a reply over ``max_reply_bytes`` or a
    malformed reply, a :class:`RewardServerError` names the URL and what went wrong. Serve any
    registered reward with ``python -m unirl_pl serve-reward``, or speak the protocol from your own
    server (docs/rewards.md).

    Args:
        url: Endpoint to POST to, e.g. ``http://127.0.0.1:8000/``.
        timeout_s: Deadline of each request in seconds: connecting, sending, and receiving the whole
            reply must all be done by then (a server trickling its reply cannot stretch it).
        max_retries: Further attempts after a failed one (0: try once).
        backoff_s: Wait before the first retry; doubles for each one after.
        batch_size: Samples per request, bounding request size and server memory.
        image_format: ``"png"`` (lossless after 8-bit quantization) or ``"jpeg"`` (smaller, lossy).
        headers: Extra HTTP headers, e.g. ``{"Authorization": "Bearer ..."}``; sent to ``url`` only.
        overlap: Let the trainer send a micro-batch's request while the next micro-batch decodes
            (decoding then goes ``batch_size`` images at a time; see :mod:`unirl_pl.rewards.overlap`).
        max_reply_bytes: Largest reply accepted, so a misbehaving peer cannot exhaust memory.
        send_sources: Send each sample's source image when the run has them (editing). Turn it off for a served
            reward that does not read them: a source image can weigh as much as the edited one.
    """

    name = "http"

    accepts_video = True  # reads (N, F, 3, H, W) itself

    def __init__(
        self,
        url: str,
        timeout_s: float = 30.0,
        max_retries: int = 3,
        backoff_s: float = 0.5,
        batch_size: int = 16,
        image_format: str = "png",
        headers: dict[str, str] | None = None,
        overlap: bool = True,
        max_reply_bytes: int = MAX_REPLY_BYTES,
        send_sources: bool = True,
    ) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"url must start with http:// or https://, got {url!r}")
        if timeout_s <= 0 or max_retries < 0 or backoff_s < 0 or batch_size < 1 or max_reply_bytes < 1:
            raise ValueError(
                f"need timeout_s > 0, max_retries >= 0, backoff_s >= 0, batch_size >= 1, max_reply_bytes >= 1; "
                f"got {timeout_s}, {max_retries}, {backoff_s}, {batch_size}, {max_reply_bytes}"
            )
        if image_format.lower() not in IMAGE_FORMATS:
            raise ValueError(f"image_format must be one of {sorted(IMAGE_FORMATS)}, got {image_format!r}")
        self.url, self.timeout_s, self.max_retries, self.backoff_s = url, timeout_s, max_retries, backoff_s
        self.batch_size, self.image_format, self.max_reply_bytes = batch_size, image_format.lower(), max_reply_bytes
        # Per-sample scores from a server: safe to request chunk by chunk while the rest decodes.
        self.remote, self.overlap_chunk = overlap, batch_size
        self.headers = {"Content-Type": "application/json", **(headers or {})}
        self.send_sources = send_sources

    def _post(self, payload: bytes) -> bytes:
        # transport.post keeps no connection between calls, so the reward stays picklable for spawned workers.
        return post(
            self.url,
            payload,
            self.headers,
            deadline_s=self.timeout_s,
            max_retries=self.max_retries,
            backoff_s=self.backoff_s,
            max_reply_bytes=self.max_reply_bytes,
            label="reward server",
        )

    def _parse(self, body: bytes, n: int) -> list[float]:
        where = f"reward server {self.url}"
        try:
            reply = json.loads(body)
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise RewardServerError(f"{where} returned non-JSON ({err}): {body[:200]!r}") from None
        if not isinstance(reply, dict) or "scores" not in reply:
            got = sorted(reply) if isinstance(reply, dict) else type(reply).__name__
            raise RewardServerError(f"{where} reply has no 'scores' key (got {got})")
        scores = reply["scores"]
        if not isinstance(scores, list):
            raise RewardServerError(f"{where} returned 'scores' as {type(scores).__name__}, not a list")
        if len(scores) != n:
            raise RewardServerError(f"{where} returned {len(scores)} scores for {n} images")
        for i, s in enumerate(scores):
            # bool is an int subclass, and json.loads accepts NaN/Infinity: neither is a valid score.
            if isinstance(s, bool) or not isinstance(s, int | float) or not math.isfinite(s):
                raise RewardServerError(f"{where} returned an invalid score at index {i}: {s!r}")
        return [float(s) for s in scores]

    def __call__(
        self,
        prompts: list[str],
        refined_prompts: list[str],
        images: Tensor,
        metadata: list[Metadata] | None = None,
        sources: list[Source] | None = None,
    ) -> list[float]:
        n = images.shape[0]
        if len(prompts) != n or len(refined_prompts) != n:
            raise ValueError(f"{len(prompts)} prompts and {len(refined_prompts)} refined prompts for {n} images")
        if metadata is not None:
            check_metadata(metadata, n)  # the server would refuse it (400) after the images were encoded
        if not self.send_sources:
            sources = None
        if sources is not None:
            check_sources(sources, n, f"reward {self.name!r}")
        scores: list[float] = []
        for lo in range(0, n, self.batch_size):
            hi = min(lo + self.batch_size, n)
            payload: dict[str, Any] = {
                "prompts": list(prompts[lo:hi]),
                "refined_prompts": list(refined_prompts[lo:hi]),
                "images": encode_images(images[lo:hi], self.image_format),
            }
            if metadata is not None:
                payload["metadata"] = list(metadata[lo:hi])
            if sources is not None:
                payload["sources"] = encode_sources(list(sources[lo:hi]), self.image_format)
            scores.extend(self._parse(self._post(json.dumps(payload).encode("utf-8")), hi - lo))
        return scores
