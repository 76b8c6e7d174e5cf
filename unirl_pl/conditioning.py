"""What the generator is conditioned on and what it produces: text features through the versioned
cache, the unconditional branch of classifier-free guidance, and decoding latents to pixels."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from unirl_pl import timing
from unirl_pl.records import Cond
from unirl_pl.versioning import FeatureCache, VersionLedger


class Conditioner:
    """Encodes texts for a generator through a cache keyed by (component, version, text), and decodes.

    Args:
        generator: Anything with ``encode(texts) -> Cond`` and ``decode(latents) -> pixels in [0, 1]``.
        ledger: Weight versions; a cached feature is valid for its text encoder's version only.
        component: The card component whose version keys the cache.
        cache_size: Texts the cache keeps (``rollout.feature_cache_size``).
        offload: Keep cached features in host memory (``rollout.feature_cache_offload``).
    """

    def __init__(
        self,
        generator: Any,
        ledger: VersionLedger,
        component: str = "text_encoder",
        cache_size: int = 4096,
        offload: bool = False,
    ) -> None:
        self.generator, self.component = generator, component
        self.cache = FeatureCache(ledger, max_entries=cache_size, offload=offload)

    @timing.timed("text_encode")
    def encode(self, texts: list[str]) -> Cond:
        """Features of ``texts``: each distinct text is encoded once per text-encoder version."""
        return self.cache.get_or_compute(self.component, texts, self.generator.encode)

    def uncond(self, guided: bool) -> Cond | None:
        """The empty prompt's features (one row) when guidance is on, else None."""
        return self.encode([""]) if guided else None

    @timing.timed("image_decode")
    def decode(self, latents: Tensor) -> Tensor:
        """Pixels in [0, 1]: images (N, 3, H, W) or videos (N, F, 3, H, W)."""
        return self.generator.decode(latents)

    def hit_rate(self) -> float:
        """Cache hits / lookups since the last call."""
        return self.cache.hit_rate()
