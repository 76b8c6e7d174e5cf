"""What the generator is conditioned on and what it produces: text features through the versioned
cache, the unconditional branch of classifier-free guidance, and decoding latents to pixels."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from unirl_pl import timing
from unirl_pl.records import Cond
from unirl_pl.source_images import SourceImage
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
    def encode(self, texts: list[str], sources: list[SourceImage] | None = None) -> Cond:
        """Features of ``texts``: each distinct text is encoded once per text-encoder version. With ``sources``
        (one source image per text, an edit) the generator's source features join them, computed once per
        distinct image; a family whose text encoder reads the image encodes each (text, image) pair once."""
        if sources is None:
            return self.cache.get_or_compute(self.component, texts, self.generator.encode)
        if len(sources) != len(texts):
            raise ValueError(f"{len(sources)} source images for {len(texts)} texts: one per text")
        by_digest = {source.digest: source for source in sources}
        if getattr(self.generator, "text_sees_source", False):
            keys = [f"{text}\0{source.digest}" for text, source in zip(texts, sources, strict=True)]
            pairs = dict(zip(keys, zip(texts, sources, strict=True), strict=True))

            def encode_pairs(chunk: list[str]) -> Cond:
                return self.generator.encode([pairs[k][0] for k in chunk], [pairs[k][1].pixels for k in chunk])

            text = self.cache.get_or_compute(self.component, keys, encode_pairs)
        else:
            text = self.cache.get_or_compute(self.component, texts, self.generator.encode)

        # Source features never change (the VAE is frozen); a NUL-prefixed key cannot collide with a prompt's.
        def encode_images(keys: list[str]) -> Cond:
            return self.generator.encode_source([by_digest[k[1:]].pixels for k in keys])

        images = self.cache.get_or_compute(self.component, ["\0" + s.digest for s in sources], encode_images)
        return {**text, **images}

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
