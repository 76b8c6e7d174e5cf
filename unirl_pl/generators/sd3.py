"""Stable Diffusion 3 / 3.5 as a ``FlowGenerator``: two CLIPs and a T5 condition an MMDiT."""

from __future__ import annotations

from typing import Any

import torch
from diffusers import SD3Transformer2DModel, StableDiffusion3Pipeline
from transformers import CLIPTextModelWithProjection, T5EncoderModel

from unirl_pl.generators.base import Cond
from unirl_pl.generators.folder import has_component
from unirl_pl.generators.image import JOINT_ATTENTION_LORA_TARGETS, ImageFlowGenerator
from unirl_pl.generators.schedule import pipeline_shift


class SD3Generator(ImageFlowGenerator):
    """SD3 / SD3.5 from a ``StableDiffusion3Pipeline`` folder.

    Conditioning matches ``StableDiffusion3Pipeline.encode_prompt``: ``pooled`` (B, P1 + P2) is both
    CLIPs' projected pooled features concatenated; ``hidden`` (B, 77 + max_sequence_length, D_T5) is both
    CLIPs' penultimate hidden states concatenated on the feature dim, zero-padded to the T5 width, then
    followed by the T5 states along the sequence. A folder saved without ``text_encoder_3`` gets zeros
    in place of the T5 states (width ``joint_attention_dim``), as diffusers does. The transformer takes
    ``timestep = sigma * 1000``. Constructor arguments are those of ``FlowGenerator``
    (``max_sequence_length`` defaults to 256).
    """

    family = "sd3"
    pipeline_class = StableDiffusion3Pipeline
    transformer_class = SD3Transformer2DModel
    default_lora_targets = JOINT_ATTENTION_LORA_TARGETS
    default_max_sequence_length = 256

    def _latent_channels(self, transformer_config: dict[str, Any]) -> int:
        return int(transformer_config["in_channels"])

    def _grid_multiple(self, transformer_config: dict[str, Any]) -> int:
        return int(transformer_config["patch_size"])

    def _schedule_kwargs(self, num_steps: int, scheduler_config: dict[str, Any]) -> dict[str, Any]:
        # StableDiffusion3Pipeline passes mu only for a dynamically shifting scheduler (SD3.5 ships a fixed
        # shift of 3.0), from the number of patch tokens of the latent image.
        if not scheduler_config.get("use_dynamic_shifting"):
            return {}
        _, height, width = self.latent_shape
        patch = int(self.read_config("transformer")["patch_size"])
        return {"mu": pipeline_shift(scheduler_config, (height // patch) * (width // patch), 1.16)}

    def _load_text(self, index: dict[str, Any]) -> None:
        self.tokenizer = self._load_tokenizer("tokenizer")
        self.tokenizer_2 = self._load_tokenizer("tokenizer_2")
        self.text_encoder = self._load_frozen(CLIPTextModelWithProjection, "text_encoder")
        self.text_encoder_2 = self._load_frozen(CLIPTextModelWithProjection, "text_encoder_2")
        self.tokenizer_3 = self.text_encoder_3 = None
        if has_component(index, "text_encoder_3"):
            self.tokenizer_3 = self._load_tokenizer("tokenizer_3")
            self.text_encoder_3 = self._load_frozen(T5EncoderModel, "text_encoder_3")

    def _encode(self, texts: list[str]) -> Cond:
        outputs = [
            self._clip_output(self.tokenizer, self.text_encoder, texts),
            self._clip_output(self.tokenizer_2, self.text_encoder_2, texts),
        ]
        clip = torch.cat([output.hidden_states[-2] for output in outputs], dim=-1)
        if self.text_encoder_3 is None:
            width = self.model.config.joint_attention_dim
            t5 = clip.new_zeros(len(texts), self.max_sequence_length, width)
        else:
            t5 = self._t5_states(self.tokenizer_3, self.text_encoder_3, texts).to(clip.dtype)
        clip = torch.nn.functional.pad(clip, (0, t5.shape[-1] - clip.shape[-1]))
        return {
            "hidden": torch.cat([clip, t5], dim=-2),
            "pooled": torch.cat([output.text_embeds for output in outputs], dim=-1),
        }

    def _forward(
        self, transformer: SD3Transformer2DModel, latents: torch.Tensor, sigma: torch.Tensor, cond: Cond
    ) -> torch.Tensor:
        return transformer(
            hidden_states=latents,
            encoder_hidden_states=cond["hidden"],
            pooled_projections=cond["pooled"],
            timestep=sigma * 1000.0,
            return_dict=False,
        )[0]
