"""FLUX.1 Kontext [dev] as an editing ``FlowGenerator``: FLUX.1-dev's DiT reads the source image's packed VAE
latents after the noisy target's tokens, told apart by the first RoPE coordinate (0 target, 1 source).

The source image is resized (see :func:`resized_source`) to one fixed size, ``source_size``, because a training
batch needs one source shape. ``FluxKontextPipeline`` itself sizes a source independently of the output: by
default (``_auto_resize=True``) to the entry of ``PREFERRED_KONTEXT_RESOLUTIONS`` (the ~1 MP sizes Kontext was
trained at) nearest the source's aspect ratio, with ``_auto_resize=False`` at the source's own size. The
default here, the sample's own ``height`` x ``width``, is the pipeline's call with ``_auto_resize=False`` on a
source of the output's size (the target and the source then have the same number of tokens); a ``source_size``
of a preferred resolution (``[1024, 1024]``) is its auto-resize of a square source.
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers import FluxKontextPipeline, FluxTransformer2DModel
from diffusers.image_processor import VaeImageProcessor
from diffusers.pipelines.flux.pipeline_flux_kontext import retrieve_latents

from unirl_pl.experts._common import check_positive
from unirl_pl.generators.base import Cond
from unirl_pl.generators.flux import FluxGenerator

SOURCE_KEY = "source_latents"
"""The ``Cond`` key of an editing family's source latents (unpacked, batch first, in the target latents' space)."""


def resized_source(
    image: torch.Tensor, size: tuple[int, int], processor: VaeImageProcessor, resize_mode: str = "default"
) -> torch.Tensor:
    """One source image (3, H, W) in [0, 1] as the pipelines' VAE input: (1, 3, *size) in [-1, 1].

    At ``size`` already it is only normalised (what the pipelines' ``image_processor.preprocess`` does to a
    tensor or picture of the size it asks for). Otherwise it goes the way the pipelines take a ``PIL.Image``:
    quantised to 8 bits (exact for pixels read from an 8-bit file), resized by the pipeline's
    ``image_processor`` (Lanczos; ``resize_mode="default"`` stretches to ``size``, ``"crop"`` keeps the aspect
    ratio and center-crops) and normalised."""
    height, width = size
    if tuple(image.shape[-2:]) == (height, width):
        return VaeImageProcessor.normalize(image[None])
    picture = VaeImageProcessor.numpy_to_pil(VaeImageProcessor.pt_to_numpy(image[None].clamp(0.0, 1.0)))[0]
    return processor.preprocess(picture, height, width, resize_mode=resize_mode)


def check_source_size(source_size: tuple[int, int], multiple: int, family: str) -> None:
    """``ValueError`` naming ``source_size`` unless both sides are multiples of ``multiple`` pixels."""
    for name, side in zip(("height", "width"), source_size, strict=True):
        if side % multiple:
            raise ValueError(
                f"source_size {name} ({side}) must be a multiple of {multiple} pixels for this {family} pipeline"
            )


class FluxKontextGenerator(FluxGenerator):
    """FLUX.1 Kontext [dev] from a ``FluxKontextPipeline`` folder: FLUX.1-dev that edits a source image.

    Everything text-side is :class:`FluxGenerator`'s (CLIP pooled + T5 tokens, embedded guidance, the schedule's
    ``mu`` from the *target* image's token count, as ``FluxKontextPipeline`` computes it). ``encode_source``
    resizes each source image alone to ``source_size`` (:func:`resized_source`), encodes it with the VAE's mode
    (``retrieve_latents(..., sample_mode="argmax")``) and shifts/scales it as ``FluxKontextPipeline._encode_vae_image``
    does, giving ``source_latents`` (B, C, h, w). ``velocity`` packs target and source 2x2, appends the source
    tokens after the target's with the pipeline's image ids (the source's first coordinate 1), runs the
    transformer and keeps the prediction of the target tokens. Without ``source_latents`` in the conditioning it
    is FLUX.1 text-to-image (the pipeline's ``image=None``).

    Args:
        pipeline_path: Local ``FluxKontextPipeline`` folder.
        guidance_scale: Embedded guidance; 2.5 is the value the Kontext model card and PromptRL's edits use.
        source_size: ``(height, width)`` in pixels every source image is resized to (multiples of the VAE factor
            times 2, 16 for the real VAE); ``None`` means the sample's ``height`` x ``width``. A larger size (e.g.
            ``[1024, 1024]``, a Kontext training resolution) conditions on more detail at the cost of
            ``h/2 * w/2`` more tokens in every DiT forward.
        **kwargs: The other ``FlowGenerator`` arguments (``max_sequence_length`` defaults to 512).
    """

    family = "flux_kontext"
    pipeline_class = FluxKontextPipeline
    takes_source_images = True

    def __init__(
        self,
        pipeline_path: str | None = None,
        guidance_scale: float = 2.5,
        source_size: tuple[int, int] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(pipeline_path, guidance_scale=guidance_scale, **kwargs)
        size = (self.height, self.width) if source_size is None else tuple(int(side) for side in source_size)
        if len(size) != 2:
            raise ValueError(f"source_size must be [height, width], got {list(size)}")
        check_positive(source_height=size[0], source_width=size[1])
        self.source_size: tuple[int, int] = size

    def _compute_latent_shape(self) -> tuple[int, ...]:
        shape = super()._compute_latent_shape()
        check_source_size(self.source_size, 2 * self.vae_scale_factor(), self.family)
        return shape

    def _encode_source(self, images: list[torch.Tensor]) -> Cond:
        processor = VaeImageProcessor(vae_scale_factor=2 * self.vae_scale_factor())
        config = self.vae.config
        latents = []
        for image in images:  # one at a time: a source's latents never depend on its batch
            pixels = resized_source(image, self.source_size, processor).to(self.vae.device, self.vae.dtype)
            latent = retrieve_latents(self.vae.encode(pixels), sample_mode="argmax")
            latents.append((latent - config.shift_factor) * config.scaling_factor)
        return {SOURCE_KEY: torch.cat(latents)}

    def _forward(
        self, transformer: FluxTransformer2DModel, latents: torch.Tensor, sigma: torch.Tensor, cond: Cond
    ) -> torch.Tensor:
        batch, channels, height, width = latents.shape
        tokens = FluxKontextPipeline._pack_latents(latents, batch, channels, height, width)
        target = tokens.shape[1]
        img_ids = FluxKontextPipeline._prepare_latent_image_ids(
            batch, height // 2, width // 2, latents.device, latents.dtype
        )
        source = cond.get(SOURCE_KEY)
        if source is not None:
            _, source_channels, source_height, source_width = source.shape
            packed = FluxKontextPipeline._pack_latents(source, batch, source_channels, source_height, source_width)
            source_ids = FluxKontextPipeline._prepare_latent_image_ids(
                batch, source_height // 2, source_width // 2, latents.device, latents.dtype
            )
            source_ids[..., 0] = 1  # the pipeline's mark of the source tokens
            tokens = torch.cat([tokens, packed], dim=1)
            img_ids = torch.cat([img_ids, source_ids], dim=0)
        guidance = None
        if transformer.config.guidance_embeds:
            guidance = torch.full((batch,), self.guidance_scale, dtype=torch.float32, device=latents.device)
        velocity = transformer(
            hidden_states=tokens,
            timestep=sigma,
            guidance=guidance,
            pooled_projections=cond["pooled"],
            encoder_hidden_states=cond["hidden"],
            txt_ids=latents.new_zeros(cond["hidden"].shape[1], 3),
            img_ids=img_ids,
            return_dict=False,
        )[0]
        # The target's tokens come first; a VAE factor of 1 makes the unpacking take latent sizes.
        return FluxKontextPipeline._unpack_latents(velocity[:, :target], height, width, 1)
