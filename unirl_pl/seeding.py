"""Per-sample randomness: every sample draws from its own generator, seeded by what identifies it.

A sample's seed is a pure function of (run seed, request id, sample index, stream), so its tokens and
noise do not depend on batch size, its position in the batch, the rank count or the Python process.
That is what lets the interleave-parity gate compare a request run alone with the same request batched.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

STREAM_LM = 0
STREAM_NOISE = 1


def sample_seed(seed: int, request_id: int, sample_index: int, stream: int) -> int:
    """A 63-bit seed that is a pure function of its arguments (stable across processes and Pythons)."""
    digest = hashlib.blake2b(f"{seed}/{request_id}/{sample_index}/{stream}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def sample_generators(
    seed: int, request_ids: Sequence[int], sample_indices: Sequence[int], stream: int
) -> list[torch.Generator]:
    """One CPU generator per sample, seeded by :func:`sample_seed`."""
    pairs = zip(request_ids, sample_indices, strict=True)
    return [torch.Generator().manual_seed(sample_seed(seed, r, k, stream)) for r, k in pairs]
