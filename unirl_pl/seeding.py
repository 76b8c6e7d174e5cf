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


_MASK32 = 0xFFFFFFFF
_GOLDEN32 = 0x9E3779B9


def sample_keys(
    seed: int,
    request_ids: Sequence[int],
    sample_indices: Sequence[int],
    stream: int,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """(N,) int64: each sample's 63-bit key, :func:`sample_seed` of what identifies it."""
    pairs = zip(request_ids, sample_indices, strict=True)
    return torch.tensor([sample_seed(seed, r, k, stream) for r, k in pairs], dtype=torch.int64, device=device)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finalizer (xor-shift-multiply), in place on int64 tensors holding values below 2**32.

    The multipliers are below 2**31, so every product stays below 2**63: no int64 overflow on any device.
    """
    x ^= x >> 16
    x *= 0x21F0AAAD
    x &= _MASK32
    x ^= x >> 15
    x *= 0x735A2D97
    x &= _MASK32
    x ^= x >> 15
    return x


def counter_uniform(keys: torch.Tensor, position: int, size: int) -> torch.Tensor:
    """(N, size) float32 uniforms in (0, 1) with 24 random bits, a pure function of (key, position, column).

    Counter-based: row i's numbers depend on nothing but its key and the counters, so one batched call
    draws exactly what N separate calls would, in any batch composition, order or rank.
    """
    lo, hi = keys & _MASK32, (keys >> 32) & _MASK32
    row = _mix32(lo ^ _mix32(hi ^ _mix32(torch.full_like(lo, position & _MASK32))))
    column = torch.arange(size, device=keys.device, dtype=torch.int64) * _GOLDEN32
    x = _mix32((row[:, None] + column[None, :]) & _MASK32)
    return (x >> 8).float().add_(0.5).mul_(2.0**-24)


def gumbel_argmax(logits: torch.Tensor, keys: torch.Tensor, position: int) -> torch.Tensor:
    """(N,) a draw from ``softmax(logits)`` per row by the Gumbel-max trick on counter-based noise.

    Entries with ``-inf`` logits (top-k) are never drawn. Batch-invariant by construction (see
    :func:`counter_uniform`) at the cost of one batched call.
    """
    gumbel = counter_uniform(keys, position, logits.shape[-1]).log_().neg_().log_().neg_()
    return (logits.float() + gumbel).argmax(-1)
