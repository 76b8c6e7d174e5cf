"""The reward server's worker (:mod:`unirl_pl.rewards.server` starts it, with LitServe): the reward as LitServe's
API, in the process LitServe spawns for it. LitServe batches the requests that reach it (``max_batch_size``,
``batch_timeout``); :class:`RewardAPI` builds the reward in ``setup``, decodes each request's images and source
images (PNG/JPEG, pixel limits from the header before decoding; a refusal is that request's reply, never an
exception that would fail LitServe's batch), groups a batch by image size into reward calls of at most
``max_samples`` samples, and scores again alone each request of a failed call, so that only the request that
breaks the reward gets its 500.
The HTTP front is :mod:`unirl_pl.rewards.server_front`.
"""

import json
import logging
import math
import signal
from dataclasses import dataclass
from typing import Any

import litserve as ls
import torch
from torch import Tensor

from unirl_pl.rewards.builtin import resolve_reward
from unirl_pl.rewards.http import ImageTooLarge, decode_images, decode_sources
from unirl_pl.rewards.metadata import Metadata, accepts_metadata, accepts_sources
from unirl_pl.rewards.server_front import Refusal, exit_with_parent


class RewardSetupFailed(RuntimeError):
    """The reward could not be built in the worker; its message has already gone to the server's starter."""


def _not_reported(record: logging.LogRecord) -> bool:
    """Drops LitServe's log of a setup failure that the starter reports itself, in one line."""
    return not (record.exc_info and isinstance(record.exc_info[1], RewardSetupFailed))


@dataclass
class _Job:
    """One decoded request."""

    prompts: list[str]
    refined: list[str]
    images: Tensor
    metadata: list[Metadata] | None
    sources: list[Tensor | None] | None = None


class RewardAPI(ls.LitAPI):
    """The reward as LitServe's API: built in the worker, fed batches of requests (see the module doc).

    Args:
        reward_name: Registry name or dotted path, built in the worker with ``reward_args``.
        reward_args: Constructor keyword arguments.
        max_samples: Most samples per reward call (a single larger request is still scored whole).
        batch_wait_s: LitServe's ``batch_timeout``: how long the worker collects requests for a batch.
        max_image_pixels: Most pixels of one image or video frame.
        max_total_pixels: Most pixels of all the images of one request.
        setup_errors: Where ``setup`` sends the one-line message of a reward that cannot be built (a pipe's end).
        parent_pid: The process that started the server: the worker ends when it is gone.
    """

    def __init__(
        self,
        reward_name: str,
        reward_args: dict[str, Any],
        max_samples: int,
        batch_wait_s: float,
        max_image_pixels: int,
        max_total_pixels: int,
        setup_errors: Any,
        parent_pid: int,
    ) -> None:
        # LitServe batches requests; each has one sample or more, so max_samples requests is the most a batch
        # can need. A batch of one request is LitServe's unbatched loop.
        super().__init__(max_batch_size=max_samples, batch_timeout=batch_wait_s)
        self.reward_name, self.reward_args, self.max_samples = reward_name, reward_args, max_samples
        self.max_image_pixels, self.max_total_pixels = max_image_pixels, max_total_pixels
        self.setup_errors, self.parent_pid = setup_errors, parent_pid
        self.reward: Any = None
        self.takes_metadata = self.takes_sources = False

    def setup(self, device: Any) -> None:
        # Ctrl-C reaches every process of the terminal's group: the worker is stopped by LitServe's shutdown (as its
        # queue manager is), not interrupted mid-batch by the signal.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        exit_with_parent(self.parent_pid)
        # The reward chooses its own device (reward_args); LitServe's device is the CPU placeholder it was given.
        try:
            self.reward = resolve_reward(self.reward_name, self.reward_args)
        except (ValueError, TypeError, ImportError, OSError) as err:
            message = f"cannot start reward {self.reward_name!r}: {err}"
            self.setup_errors.send(message)
            for handler in logging.getLogger("litserve").handlers:
                handler.addFilter(_not_reported)
            raise RewardSetupFailed(message) from None
        # Read once: the reward does not change.
        self.takes_metadata, self.takes_sources = accepts_metadata(self.reward), accepts_sources(self.reward)

    # decode_request's parameter and encode_response's return stay unannotated: LitServe reads them as the
    # route's request and response types (a plain JSON body in, a dict or a Response out).
    def decode_request(self, request):
        """The request's images and source images decoded (PNG/JPEG within the pixel limits, the sources' pixels
        counted with the images'), or its refusal (400/413/500)."""
        try:
            images = decode_images(request["images"], self.max_image_pixels, self.max_total_pixels)
            sources = request.get("sources")
            if sources is not None:
                used = images.numel() // 3  # the pixels of every image (and frame) of the request
                sources = decode_sources(sources, len(images), self.max_image_pixels, self.max_total_pixels, used)
            return _Job(request["prompts"], request["refined_prompts"], images, request.get("metadata"), sources)
        except ImageTooLarge as err:
            return 413, f"image too large: {err}"
        except ValueError as err:
            return 400, f"bad request: {err}"
        except Exception as err:  # a bug must fail this request only
            return 500, f"the server failed reading the request: {type(err).__name__}: {err}"

    def predict(self, x: Any) -> Any:
        batched = isinstance(x, list)  # LitServe's batched loop passes a list, its single loop one request
        items = x if batched else [x]
        try:
            out = self._score(items)
        except Exception as err:  # a bug must not fail LitServe's whole batch: each request gets the 500
            out = [(500, f"reward {self.reward_name!r}: the server failed: {type(err).__name__}: {err}")] * len(items)
        return out if batched else out[0]

    def encode_response(self, output):
        if isinstance(output, tuple):  # a Refusal: this request's own reply, which closes its connection
            status, message = output
            return ls.Response(
                content=json.dumps({"error": message}),
                status_code=status,
                media_type="application/json",
                headers={"Connection": "close"},
            )
        return {"scores": output}

    def _score(self, items: list[Any]) -> list[list[float] | Refusal]:
        out: list[Any] = list(items)  # refusals stay; jobs are replaced by their scores or their refusal
        groups: dict[tuple[int, ...], list[int]] = {}  # a reward takes one stacked tensor: one image size per call
        for i, item in enumerate(items):
            if isinstance(item, _Job):
                groups.setdefault(tuple(item.images.shape[1:]), []).append(i)
        for indices in groups.values():
            for chunk in self._chunks(indices, items):
                scores, error = self._call([items[i] for i in chunk])
                if error is None:
                    lo = 0
                    for i in chunk:
                        out[i] = scores[lo : lo + len(items[i].prompts)]
                        lo += len(items[i].prompts)
                elif len(chunk) == 1:
                    out[chunk[0]] = (500, error)
                else:  # which request broke it? Alone, each gets its own outcome.
                    for i in chunk:
                        scores, error = self._call([items[i]])
                        out[i] = scores if error is None else (500, error)
        return out

    def _chunks(self, indices: list[int], items: list[Any]) -> list[list[int]]:
        """Requests in arrival order, cut into reward calls of at most ``max_samples`` samples."""
        chunks: list[list[int]] = []
        size = 0
        for i in indices:
            n = len(items[i].prompts)
            if not chunks or size + n > self.max_samples:
                chunks.append([])
                size = 0
            chunks[-1].append(i)
            size += n
        return chunks

    def _call(self, jobs: list[_Job]) -> tuple[list[float] | None, str | None]:
        """One reward call on the concatenation of ``jobs``: (scores, None) or (None, what went wrong)."""
        n = sum(len(job.prompts) for job in jobs)
        try:
            images = jobs[0].images if len(jobs) == 1 else torch.cat([job.images for job in jobs])
            extra = {}
            if self.takes_metadata and any(job.metadata is not None for job in jobs):
                extra["metadata"] = [m for job in jobs for m in job.metadata or [None] * len(job.prompts)]
            if self.takes_sources and any(job.sources is not None for job in jobs):
                extra["sources"] = [s for job in jobs for s in job.sources or [None] * len(job.prompts)]
            raw = self.reward(
                [p for job in jobs for p in job.prompts], [r for job in jobs for r in job.refined], images, **extra
            )
            scores = [float(s) for s in raw]
        except Exception as err:  # the reward failed; the worker lives on for the next batch
            return None, f"reward {self.reward_name!r} failed: {type(err).__name__}: {err}"
        if len(scores) != n:
            return None, f"reward {self.reward_name!r} returned {len(scores)} scores for {n} samples"
        bad = [i for i, s in enumerate(scores) if not math.isfinite(s)]
        if bad:
            return None, f"reward {self.reward_name!r} returned {scores[bad[0]]} for sample {bad[0]} of {n}"
        return scores, None
