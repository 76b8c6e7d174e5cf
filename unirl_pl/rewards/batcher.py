"""The reward server's batching: concurrent requests scored together, in one reward call on one thread.

:class:`RequestBatcher` is the part of the reference server (:mod:`unirl_pl.rewards.server`) that calls
the reward; the server's handler threads queue their requests on it and wait for their scores.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from dataclasses import dataclass, field

import torch
from torch import Tensor

from unirl_pl.rewards.builtin import RewardFn
from unirl_pl.rewards.metadata import Metadata, accepts_metadata


@dataclass
class _Job:
    """One request waiting for its scores: filled by the batch worker, then ``done`` is set."""

    prompts: list[str]
    refined: list[str]
    images: Tensor
    metadata: list[Metadata] | None = None
    done: threading.Event = field(default_factory=threading.Event)
    scores: list[float] | None = None
    error: str | None = None


class RequestBatcher:
    """Scores requests in batches on one worker thread: the first waiting request opens a batch, which
    takes every request that arrives within ``wait_s`` with the same image shape, up to ``max_size``
    samples, and the reward is called once on their concatenation.

    One thread calls the reward, so models that are not thread-safe (most GPU models) are safe and
    memory is bounded by one batch. When a batched call raises, or returns a non-finite score or the
    wrong count, each request of that batch is scored again alone, so only the request that causes the
    failure gets an error (500) and its batch-mates get their scores.

    Requests' ``metadata`` reaches a reward that declares a ``metadata`` parameter, concatenated like the
    prompts (None for the samples of a request without any); a reward that does not declare it never sees it.

    Args:
        reward: The reward to call.
        reward_name: Its name, for error messages.
        max_size: Most samples per call (a single larger request is still scored whole).
        wait_s: How long a batch waits for more requests after its first one (0: no waiting).
    """

    def __init__(self, reward: RewardFn, reward_name: str, max_size: int = 64, wait_s: float = 0.005) -> None:
        if max_size < 1 or wait_s < 0:
            raise ValueError(f"need max_batch_size >= 1 and batch_wait_s >= 0, got {max_size}, {wait_s}")
        self.reward, self.reward_name, self.max_size, self.wait_s = reward, reward_name, max_size, wait_s
        self.takes_metadata = accepts_metadata(reward)  # read once: the reward does not change
        self.calls: list[int] = []  # samples per reward call, for tests and logs
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._held: _Job | None = None  # a request that did not fit the last batch opens the next
        self._thread = threading.Thread(target=self._work, name=f"reward-batcher-{reward_name}", daemon=True)
        self._thread.start()

    def score(
        self, prompts: list[str], refined: list[str], images: Tensor, metadata: list[Metadata] | None = None
    ) -> tuple[list[float] | None, str | None]:
        """(scores, None) or (None, error) for one request, after its batch has been scored."""
        job = _Job(prompts, refined, images, metadata)
        self._queue.put(job)
        job.done.wait()
        return job.scores, job.error

    def close(self) -> None:
        """Stop the worker after the requests already queued."""
        self._queue.put(None)
        self._thread.join(timeout=5)

    def _next_batch(self) -> list[_Job] | None:
        first = self._held or self._queue.get()
        self._held = None
        if first is None:
            return None
        batch, size = [first], len(first.prompts)
        deadline = time.monotonic() + self.wait_s
        while size < self.max_size:
            try:
                job = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if job is None:
                self._queue.put(None)  # seen again after this batch: stop then
                break
            fits = job.images.shape[1:] == first.images.shape[1:] and size + len(job.prompts) <= self.max_size
            if not fits:
                self._held = job
                break
            batch.append(job)
            size += len(job.prompts)
        return batch

    def _call(self, jobs: list[_Job]) -> tuple[list[float] | None, str | None]:
        """One reward call on the concatenation of ``jobs``: (scores, None) or (None, what went wrong)."""
        n = sum(len(job.prompts) for job in jobs)
        self.calls.append(n)
        try:
            images = jobs[0].images if len(jobs) == 1 else torch.cat([job.images for job in jobs])
            extra = {}
            if self.takes_metadata and any(job.metadata is not None for job in jobs):
                extra["metadata"] = [m for job in jobs for m in job.metadata or [None] * len(job.prompts)]
            raw = self.reward(
                [p for job in jobs for p in job.prompts], [r for job in jobs for r in job.refined], images, **extra
            )
            scores = [float(s) for s in raw]
        except Exception as err:  # the reward failed; the worker must live on for the next batch
            return None, f"reward {self.reward_name!r} failed: {type(err).__name__}: {err}"
        if len(scores) != n:
            return None, f"reward {self.reward_name!r} returned {len(scores)} scores for {n} samples"
        bad = [i for i, s in enumerate(scores) if not math.isfinite(s)]
        if bad:
            return None, f"reward {self.reward_name!r} returned {scores[bad[0]]} for sample {bad[0]} of {n}"
        return scores, None

    def _work(self) -> None:
        while (batch := self._next_batch()) is not None:
            try:
                scores, error = self._call(batch)
                if error is None:
                    lo = 0
                    for job in batch:
                        job.scores = scores[lo : lo + len(job.prompts)]
                        lo += len(job.prompts)
                elif len(batch) == 1:
                    batch[0].error = error
                else:  # which request broke it? Alone, each gets its own outcome.
                    for job in batch:
                        job.scores, job.error = self._call([job])
            finally:  # no handler may wait forever, whatever happened above
                for job in batch:
                    if job.scores is None and job.error is None:
                        job.error = f"reward {self.reward_name!r}: the batch worker failed"
                    job.done.set()
