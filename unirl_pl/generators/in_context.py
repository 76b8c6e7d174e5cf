"""The project's own editing generator: the component generator reading the source image in context.

Kontext-style editing puts the source image's tokens beside the noisy target's in one sequence, so every
attention layer reads the source directly. Here the SD3 MMDiT gets the source latents beside the noisy target
along the width (a diptych: target left, source right); the positional embeddings, cropped from the model's
``pos_embed_max_size`` grid for the doubled width, tell the halves apart, and only the target half's
prediction is kept (:meth:`FlowTransformerExpert.velocity` with ``source``). It is the ShapesWorld-Edit
generator; the families the field trains edit through their own pipelines (FLUX.1 Kontext, FLUX.2 [klein],
Qwen-Image-Edit-Plus).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from unirl_pl.generators.components import ComponentGenerator
from unirl_pl.generators.source import check_images
from unirl_pl.records import Cond

SOURCE_KEY = "source"
"""The ``Cond`` key of the source latents (B, C, H, W), in the target latents' space."""


class InContextEditGenerator(ComponentGenerator):
    """A ``ComponentGenerator`` that edits: each sample's source image is encoded (the VAE's posterior mean, or
    the pixels in [-1, 1] without a VAE) at the target's size and read beside the noisy target.

    A source of another size is resized to the target's pixels first (bilinear, antialiased); without a source
    in the conditioning the transformer generates from text alone. The arguments are ``ComponentGenerator``'s.
    """

    family = "in_context_edit"
    takes_source_images = True
    text_sees_source = False

    def build(self) -> None:
        """Build the parts and check that the transformer's positions cover the doubled width."""
        super().build()
        model = self.transformer.model
        config = model.config if model is not None else None
        if config is not None and config.pos_embed_max_size is not None:
            width = 2 * self.latent_shape[-1] // config.patch_size
            if width > config.pos_embed_max_size:
                raise ValueError(
                    f"the transformer's pos_embed_max_size ({config.pos_embed_max_size} patches) cannot hold a "
                    f"target and its source side by side ({width} patches wide)"
                )

    def _pixel_size(self) -> tuple[int, int]:
        _, height, width = self.latent_shape
        factor = self.vae.downsample_factor if self.vae is not None else 1
        return height * factor, width * factor

    @torch.no_grad()
    def encode_source(self, images: list[Tensor]) -> Cond:
        """``{"source": (B, C, H, W)}``: each float (3, H, W) source image in [0, 1] as target-space latents."""
        size = self._pixel_size()
        pixels = []
        for image in check_images(images, None):
            if tuple(image.shape[-2:]) != size:
                image = F.interpolate(image[None], size=size, mode="bilinear", antialias=True, align_corners=False)[0]
            pixels.append(image.clamp(0.0, 1.0))
        batch = torch.stack(pixels).to(device=next(self.transformer.parameters()).device)
        latents = self.vae.encode(batch) if self.vae is not None else batch * 2.0 - 1.0
        return {SOURCE_KEY: latents.to(self.dtype)}

    def velocity(self, latents: Tensor, sigma: Tensor, cond: Cond) -> Tensor:
        """The flow velocity of the target, the source (when given) read beside it."""
        source = cond.get(SOURCE_KEY)
        return self.transformer.velocity(latents, sigma, cond["hidden"], cond["pooled"], source=source)
