"""FLUX.1 (dev and schnell) as a ``FlowGenerator``: CLIP pooled + T5 tokens condition a 2x2-packed DiT."""

from __future__ import annotations

from typing import Any

import torch
from diffusers import FluxPipeline, FluxTransformer2DModel
from transformers import CLIPTextModel, T5EncoderModel

from unirl_pl.generators.base import Cond
from unirl_pl.generators.image import JOINT_ATTENTION_LORA_TARGETS, ImageFlowGenerator
from unirl_pl.generators.schedule import pipeline_shift


class FluxGenerator(ImageFlowGenerator):
    """FLUX.1-dev / FLUX.1-schnell from a ``FluxPipeline`` folder.

    Latents stay the unpacked VAE latents ``(C, H/8, W/8)`` everywhere outside ``velocity``, which packs
    them into 2x2 patches (``FluxPipeline._pack_latents``), builds ``img_ids``/``txt_ids`` and unpacks the
    prediction, so the sampler and records are family-agnostic. Conditioning matches
    ``FluxPipeline.encode_prompt``: ``pooled`` (B, P) is the CLIP ``pooler_output``, ``hidden``
    (B, max_sequence_length, D) the T5 states. The transformer takes ``timestep = sigma`` (it multiplies
    by 1000 itself) and, for guidance-distilled checkpoints (``guidance_embeds``, i.e. dev), a
    ``guidance`` tensor of ``guidance_scale``.

    Args:
        pipeline_path: Local ``FluxPipeline`` folder.
        guidance_scale: Embedded guidance of dev checkpoints (ignored by schnell, which has none).
        **kwargs: The other ``FlowGenerator`` arguments (``max_sequence_length`` defaults to 512).
    """

    family = "flux"
    pipeline_class = FluxPipeline
    transformer_class = FluxTransformer2DModel
    # Flow-GRPO's FLUX targets: the joint attention plus both streams' feed-forward projections of the
    # double blocks ("ff." does not match the single blocks' proj_mlp/proj_out).
    default_lora_targets = (
        *JOINT_ATTENTION_LORA_TARGETS,
        "ff.net.0.proj",
        "ff.net.2",
        "ff_context.net.0.proj",
        "ff_context.net.2",
    )
    default_max_sequence_length = 512

    def __init__(self, pipeline_path: str | None, guidance_scale: float = 3.5, **kwargs: Any) -> None:
        super().__init__(pipeline_path, **kwargs)
        if guidance_scale < 0:
            raise ValueError(f"guidance_scale must be >= 0, got {guidance_scale}")
        self.guidance_scale = guidance_scale

    def _latent_channels(self, transformer_config: dict[str, Any]) -> int:
        return int(transformer_config["in_channels"]) // 4  # the transformer sees 2x2-packed latents

    def _grid_multiple(self, transformer_config: dict[str, Any]) -> int:
        return 2

    def _schedule_kwargs(self, num_steps: int, scheduler_config: dict[str, Any]) -> dict[str, Any]:
        # FluxPipeline's own choice: sigmas linspace(1, 1/N, N) (the scheduler's flow sigmas if it has
        # them) and mu from the packed image sequence length; schnell's scheduler ignores mu (no dynamic shift).
        _, height, width = self.latent_shape
        sigmas = None
        if not scheduler_config.get("use_flow_sigmas"):
            sigmas = torch.linspace(1.0, 1.0 / num_steps, num_steps, dtype=torch.float64).tolist()
        mu = pipeline_shift(scheduler_config, (height // 2) * (width // 2), 1.15)
        return {"sigmas": sigmas, "mu": mu if scheduler_config.get("use_dynamic_shifting") else None}

    def _load_text(self, index: dict[str, Any]) -> None:
        self.tokenizer = self._load_tokenizer("tokenizer")
        self.tokenizer_2 = self._load_tokenizer("tokenizer_2")
        self.text_encoder = self._load_frozen(CLIPTextModel, "text_encoder")
        self.text_encoder_2 = self._load_frozen(T5EncoderModel, "text_encoder_2")

    def _encode(self, texts: list[str]) -> Cond:
        pooled = self._clip_output(self.tokenizer, self.text_encoder, texts).pooler_output
        return {"hidden": self._t5_states(self.tokenizer_2, self.text_encoder_2, texts), "pooled": pooled}

    def _forward(
        self, transformer: FluxTransformer2DModel, latents: torch.Tensor, sigma: torch.Tensor, cond: Cond
    ) -> torch.Tensor:
        batch, channels, height, width = latents.shape
        packed = FluxPipeline._pack_latents(latents, batch, channels, height, width)
        img_ids = FluxPipeline._prepare_latent_image_ids(batch, height // 2, width // 2, latents.device, latents.dtype)
        txt_ids = latents.new_zeros(cond["hidden"].shape[1], 3)
        guidance = None
        if transformer.config.guidance_embeds:
            guidance = torch.full((batch,), self.guidance_scale, dtype=torch.float32, device=latents.device)
        velocity = transformer(
            hidden_states=packed,
            timestep=sigma,
            guidance=guidance,
            pooled_projections=cond["pooled"],
            encoder_hidden_states=cond["hidden"],
            txt_ids=txt_ids,
            img_ids=img_ids,
            return_dict=False,
        )[0]
        # A VAE factor of 1 makes the pipeline's unpacking take latent (not pixel) sizes.
        return FluxPipeline._unpack_latents(velocity, height, width, 1)
