"""Wan2.1 / Wan2.2 text-to-video as a ``FlowGenerator``: UMT5 tokens condition a 3D DiT over a causal
3D VAE's latents."""

from __future__ import annotations

from typing import Any

import torch
from diffusers import AutoencoderKLWan, WanPipeline, WanTransformer3DModel
from diffusers.pipelines.wan.pipeline_wan import prompt_clean
from transformers import UMT5EncoderModel

from unirl_pl.generators.base import Cond, FlowGenerator, has_component


class WanGenerator(FlowGenerator):
    """Wan2.1 / Wan2.2 T2V from a ``WanPipeline`` folder with a single transformer.

    Latents are ``(C, F, H, W)`` with ``F = (num_frames - 1) // scale_factor_temporal + 1`` and
    ``H, W = height, width // scale_factor_spatial`` (the VAE config's factors); ``decode`` returns
    ``(N, num_frames, 3, height, width)``, undoing the VAE's ``latents_mean``/``latents_std`` first.
    Conditioning matches ``WanPipeline.encode_prompt``: ``hidden`` (B, max_sequence_length, D) is the
    UMT5 states of the cleaned prompt with the padding positions zeroed. The transformer takes
    ``timestep = sigma * 1000``, per token when the folder sets ``expand_timesteps`` (Wan2.2 TI2V-5B).
    A Wan2.2 A14B folder (a second, low-noise ``transformer_2``) raises ``NotImplementedError`` at
    ``build()``. Constructor arguments are those of ``FlowGenerator`` (defaults 480x832 pixels, 81
    frames, ``max_sequence_length`` 512).
    """

    family = "wan"
    pipeline_class = WanPipeline
    transformer_class = WanTransformer3DModel
    vae_class = AutoencoderKLWan
    # Self- and cross-attention projections of every block.
    default_lora_targets = ("to_q", "to_k", "to_v", "to_out.0")
    default_size = (480, 832, 81)
    default_max_sequence_length = 512
    # Set from model_index.json by ``build()``.
    expand_timesteps: bool = False

    @property
    def is_video(self) -> bool:
        """Always true: samples are videos."""
        return True

    def _check_index(self, index: dict[str, Any]) -> None:
        if has_component(index, "transformer_2"):
            raise NotImplementedError(
                f"{self.pipeline_path!r} is a two-expert Wan2.2 pipeline (model_index.json has transformer_2 "
                "for the low-noise steps); WanGenerator supports single-transformer WanPipeline folders only"
            )
        # Wan2.2 TI2V-5B conditions on one timestep per latent token rather than per sample.
        self.expand_timesteps = bool(index.get("expand_timesteps", False))

    def _compute_latent_shape(self) -> tuple[int, ...]:
        vae, transformer = self.read_config("vae"), self.read_config("transformer")
        temporal, spatial = int(vae["scale_factor_temporal"]), int(vae["scale_factor_spatial"])
        _, patch_h, patch_w = transformer["patch_size"]
        if (self.num_frames - 1) % temporal:
            raise ValueError(f"num_frames - 1 ({self.num_frames - 1}) must be a multiple of {temporal} for this VAE")
        for name, size, patch in (("height", self.height, patch_h), ("width", self.width, patch_w)):
            if size % (spatial * patch):
                raise ValueError(f"{name} ({size}) must be a multiple of {spatial * patch} pixels for this pipeline")
        frames = (self.num_frames - 1) // temporal + 1
        return (int(transformer["in_channels"]), frames, self.height // spatial, self.width // spatial)

    def _load_text(self, index: dict[str, Any]) -> None:
        self.tokenizer = self._load_tokenizer("tokenizer")
        self.text_encoder = self._load_frozen(UMT5EncoderModel, "text_encoder")

    def _encode(self, texts: list[str]) -> Cond:
        cleaned = [prompt_clean(text) for text in texts]
        return {"hidden": self._t5_states(self.tokenizer, self.text_encoder, cleaned, masked=True)}

    def _forward(
        self, transformer: WanTransformer3DModel, latents: torch.Tensor, sigma: torch.Tensor, cond: Cond
    ) -> torch.Tensor:
        timestep = sigma * 1000.0
        if self.expand_timesteps:
            patch_f, patch_h, patch_w = transformer.config.patch_size
            _, _, frames, height, width = latents.shape
            tokens = frames // patch_f * (height // patch_h) * (width // patch_w)
            timestep = timestep[:, None].expand(-1, tokens)
        return transformer(
            hidden_states=latents, timestep=timestep, encoder_hidden_states=cond["hidden"], return_dict=False
        )[0]

    def _decode(self, latents: torch.Tensor) -> torch.Tensor:
        config = self.vae.config
        shape = (1, -1, 1, 1, 1)
        mean = torch.tensor(config.latents_mean, dtype=latents.dtype, device=latents.device).view(shape)
        std = torch.tensor(config.latents_std, dtype=latents.dtype, device=latents.device).view(shape)
        video = self.vae.decode(latents * std + mean, return_dict=False)[0]  # (N, 3, F, H, W)
        return video.permute(0, 2, 1, 3, 4)
