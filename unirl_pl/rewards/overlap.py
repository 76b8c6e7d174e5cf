"""Scoring remote rewards while the rest of the batch decodes.

A reward that waits on a server (``http``, ``vlm_judge``) spends its time in the network and the
server's GPU, not in this process. When the images decode in micro-batches, the first micro-batch's
request can be in flight while the next one decodes: the rollout then pays for the slower of the two,
not their sum. Only rewards that say so (``remote = True``) are overlapped, and only per-sample ones:
a reward that compares samples within a group (the pairwise judge) needs the whole batch.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch import Tensor

# name -> score(prompts, refined_prompts, images[, metadata, replies, sources]) -> (n,) values, e.g. a bound
# ``WeightedSum.score_term`` (which hands each on only to a term that declares it).
TermScorer = Callable[..., Tensor]


def overlap_chunk(term: Any) -> int | None:
    """Images per overlapped request for a remote reward (its ``overlap_chunk``), or None when it is not
    overlappable (not ``remote``, or it has no chunk size)."""
    if not getattr(term, "remote", False):
        return None
    chunk = getattr(term, "overlap_chunk", None)
    return int(chunk) if chunk else None


def remote_terms(terms: dict[str, Any]) -> tuple[list[str], int | None]:
    """The names of the overlappable terms and the decode micro-batch: the smallest of their chunks."""
    chunks = {name: overlap_chunk(fn) for name, fn in terms.items()}
    names = [name for name, chunk in chunks.items() if chunk is not None]
    return names, min((chunks[n] for n in names), default=None)  # type: ignore[type-var]


def decode_while_scoring(
    decode: Callable[[Tensor], Tensor],
    latents: Tensor,
    chunk: int,
    scorers: dict[str, TermScorer],
    prompts: list[str],
    refined_prompts: list[str],
    max_workers: int = 8,
    metadata: list[Any] | None = None,
    replies: list[Any] | None = None,
    sources: list[Any] | None = None,
) -> tuple[Tensor, dict[str, Callable[[], Tensor]]]:
    """Decode ``latents`` ``chunk`` at a time, submitting each decoded chunk to every scorer in a thread.

    With ``metadata`` (one item per sample), each chunk's scorer call gets its slice as ``metadata=``; the same
    for ``replies`` and ``sources`` (an editing run's source images).

    Returns the images (all chunks concatenated, as one decode would give them) and, per scorer, a
    function that waits for its chunks and returns their values in order; an exception a scorer raised
    is raised there. The pool is shut down when every scorer's results have been collected.
    """
    pool = ThreadPoolExecutor(max_workers=max(1, min(max_workers, len(scorers) * -(-latents.shape[0] // chunk))))
    futures: dict[str, list[Future[Tensor]]] = {name: [] for name in scorers}
    images = []
    try:
        for lo in range(0, latents.shape[0], chunk):
            pixels = decode(latents[lo : lo + chunk])
            hi = lo + pixels.shape[0]
            extra = {} if metadata is None else {"metadata": metadata[lo:hi]}
            if replies is not None:
                extra["replies"] = replies[lo:hi]
            if sources is not None:
                extra["sources"] = sources[lo:hi]
            for name, score in scorers.items():
                futures[name].append(pool.submit(score, prompts[lo:hi], refined_prompts[lo:hi], pixels, **extra))
            images.append(pixels)
    except BaseException:
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    remaining = set(scorers)

    def collector(name: str) -> Callable[[], Tensor]:
        def collect() -> Tensor:
            try:
                return torch.cat([f.result() for f in futures[name]])
            finally:
                remaining.discard(name)
                if not remaining:
                    pool.shutdown(wait=True)

        return collect

    return torch.cat(images), {name: collector(name) for name in scorers}
