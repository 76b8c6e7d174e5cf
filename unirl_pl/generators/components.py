"""The generator assembled from separately configured parts: the project's own experts.

A ``FlowTransformerExpert`` (SD3 MMDiT + LoRA), one ``TextEncoderExpert`` (CLIP) and an optional
``VAEExpert``; without a VAE the transformer works in pixel space (3 channels in [-1, 1]). Each part
builds a tiny model from its config or loads a local checkpoint: this is the test bed and the
ShapesWorld generator. Pipelines of the families the field trains (SD3.5, FLUX.1, Wan) load through
their own generators in this package.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor

from unirl_pl.experts import FlowTransformerExpert, TextEncoderExpert, VAEExpert
from unirl_pl.lazy_defaults import lazy_default
from unirl_pl.records import Cond


def pixels_to_images(x: Tensor) -> Tensor:
    """Pixel-space samples in [-1, 1] (any float dtype) to float32 images in [0, 1]."""
    return ((x.float().clamp(-1, 1) + 1) / 2).clamp(0, 1)


class ComponentGenerator(torch.nn.Module):
    """A flow generator from three configured parts (the surface every generator family offers).

    Args:
        transformer: The flow DiT expert (its LoRA is what the generator trains).
        text_encoder: Frozen CLIP text encoder: per-token ``hidden`` and ``pooled`` features.
        vae: Frozen VAE decoding latents to images (None: the DiT works in pixel space).
    """

    family = "components"
    is_video = False

    def __init__(
        self,
        transformer: FlowTransformerExpert = lazy_default(FlowTransformerExpert),
        text_encoder: TextEncoderExpert = lazy_default(TextEncoderExpert),
        vae: VAEExpert | None = lazy_default(VAEExpert),
    ) -> None:
        super().__init__()
        self.transformer, self.text_encoder, self.vae = transformer, text_encoder, vae

    def build(self) -> None:
        """Build the parts and check that the DiT's channels match what decodes them."""
        for part in (self.transformer, self.text_encoder, self.vae):
            if part is not None:
                part.build()
        channels = self.transformer.latent_shape[0]
        expected = self.vae.latent_channels if self.vae is not None else 3
        if channels != expected:
            where = "the VAE's latent_channels" if self.vae is not None else "3 (pixel space, no VAE)"
            raise ValueError(f"the transformer has {channels} input channels but {where} is {expected}")

    @property
    def has_vae(self) -> bool:
        """Whether latents decode through a VAE (else the transformer works in pixel space)."""
        return self.vae is not None

    @property
    def expert(self) -> FlowTransformerExpert:
        """The trainable part (card component ``transformer``)."""
        return self.transformer

    @property
    def latent_shape(self) -> tuple[int, ...]:
        """(channels, height, width) of one sample's latent."""
        return self.transformer.latent_shape

    @property
    def dtype(self) -> torch.dtype:
        """Dtype of the transformer's base weights."""
        return self.transformer.dtype

    def encode(self, texts: list[str]) -> Cond:
        """CLIP features: ``hidden`` (B, L, D) and ``pooled`` (B, P)."""
        hidden, pooled = self.text_encoder.encode(texts)
        return {"hidden": hidden, "pooled": pooled}

    def velocity(self, latents: Tensor, sigma: Tensor, cond: Cond) -> Tensor:
        """The flow velocity at noise level ``sigma`` (B,)."""
        return self.transformer.velocity(latents, sigma, cond["hidden"], cond["pooled"])

    @torch.no_grad()
    def decode(self, latents: Tensor) -> Tensor:
        """Images (N, 3, H, W) in [0, 1]."""
        return pixels_to_images(latents) if self.vae is None else self.vae.decode(latents)

    @contextmanager
    def adapter_disabled(self) -> Iterator[None]:
        """The reference policy: the transformer with its LoRA bypassed."""
        with self.transformer.adapter_disabled():
            yield
