"""The part the image families (SD3, FLUX) share on top of :class:`FlowGenerator`: the VAE's latent geometry
and decode, and the joint-attention LoRA targets."""

from __future__ import annotations

from abc import abstractmethod
from typing import Any

import torch
from diffusers import AutoencoderKL

from unirl_pl.generators.base import FlowGenerator

# The q/k/v/out projections of both streams of an MMDiT joint attention (SD3, FLUX). Flow-GRPO's SD3.5
# targets; the ``attn.`` prefix leaves the extra ``attn2`` of SD3.5's dual-attention blocks alone, and
# FLUX's single blocks match on their q/k/v.
JOINT_ATTENTION_LORA_TARGETS: tuple[str, ...] = (
    "attn.add_k_proj",
    "attn.add_q_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
    "attn.to_k",
    "attn.to_out.0",
    "attn.to_q",
    "attn.to_v",
)


class ImageFlowGenerator(FlowGenerator):
    """Shared part of the image families (SD3, FLUX): an ``AutoencoderKL`` with ``scaling_factor`` and
    ``shift_factor`` and latents ``(C, height / f, width / f)`` with ``f = 2 ** (levels - 1)``."""

    vae_class = AutoencoderKL
    default_size = (1024, 1024, 1)

    @abstractmethod
    def _latent_channels(self, transformer_config: dict[str, Any]) -> int:
        """Latent channels of the VAE latents (before any packing) from the transformer config."""

    @abstractmethod
    def _grid_multiple(self, transformer_config: dict[str, Any]) -> int:
        """Latent pixels the transformer groups into one token along each side (patch or 2x2 pack)."""

    def vae_scale_factor(self) -> int:
        """Image pixels per latent pixel along each side, as the diffusers image pipelines compute it."""
        return 2 ** (len(self.read_config("vae")["block_out_channels"]) - 1)

    def _compute_latent_shape(self) -> tuple[int, ...]:
        transformer_config = self.read_config("transformer")
        factor = self.vae_scale_factor()
        multiple = factor * self._grid_multiple(transformer_config)
        for name, size in (("height", self.height), ("width", self.width)):
            if size % multiple:
                raise ValueError(
                    f"{name} ({size}) must be a multiple of {multiple} pixels for this {self.family} pipeline"
                )
        return (self._latent_channels(transformer_config), self.height // factor, self.width // factor)

    def _decode(self, latents: torch.Tensor) -> torch.Tensor:
        config = self.vae.config
        latents = latents / config.scaling_factor + (config.shift_factor or 0.0)
        return self.vae.decode(latents, return_dict=False)[0]
