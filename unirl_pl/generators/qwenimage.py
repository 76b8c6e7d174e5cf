"""Qwen-Image as a ``FlowGenerator``: Qwen2.5-VL's last hidden states of the templated prompt condition a
dual-stream MMDiT on 2x2-packed latents of a Wan-style VAE; true CFG with the pipeline's norm rescale.

A sample's output never depends on the other prompts of its batch. ``QwenImagePipeline`` pads a batch's
prompts to the longest one, in the text encoder and in the DiT, so a prompt's features and the DiT's
text sequence (its width, the text RoPE table) change with whatever it is batched with (diffusers issue
#12075); with the padding attended (diffusers before the joint attention mask) the image moves with it.
Here each distinct prompt is encoded alone, at its own length, and its features are right-padded with
zeros to the fixed ``max_sequence_length`` with a mask: the DiT always sees the same width, the padding
masked out of the joint attention, and the real text tokens keep their RoPE positions (those of the
prompt alone: the table starts after the image's and counts the padded width, never the mask, so the
rollout and the training recompute build the same table, unlike vllm-omni issue #4443's mask count).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from diffusers import AutoencoderKLQwenImage, QwenImagePipeline, QwenImageTransformer2DModel
from torch import Tensor
from transformers import Qwen2_5_VLForConditionalGeneration

from unirl_pl.generators.base import Cond
from unirl_pl.generators.image import ImageFlowGenerator
from unirl_pl.generators.schedule import pipeline_shift

# Flow-GRPO's Qwen-Image targets (yifan123/flow_grpo scripts/train_qwenimage.py @9745241, lines 410-428, with
# LoraConfig(r=64, lora_alpha=128, init_lora_weights="gaussian")): both streams' attention projections and
# both streams' MLPs (``img_mlp``, ``txt_mlp``) of every block.
QWENIMAGE_LORA_TARGETS: tuple[str, ...] = (
    "attn.to_k",
    "attn.to_q",
    "attn.to_v",
    "attn.to_out.0",
    "attn.add_k_proj",
    "attn.add_q_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
    "img_mlp.net.0.proj",
    "img_mlp.net.2",
    "txt_mlp.net.0.proj",
    "txt_mlp.net.2",
)


def _pipeline_constants() -> tuple[str, int, int]:
    """``QwenImagePipeline``'s prompt template, the count of its leading tokens the pipeline drops
    (``prompt_template_encode_start_idx``) and its tokenizer length past them (``tokenizer_max_length``),
    read off an empty pipeline so they follow diffusers."""
    empty = QwenImagePipeline(scheduler=None, vae=None, text_encoder=None, tokenizer=None, transformer=None)
    return empty.prompt_template_encode, empty.prompt_template_encode_start_idx, empty.tokenizer_max_length


PROMPT_TEMPLATE, TEMPLATE_TOKENS, TOKENIZER_MAX_LENGTH = _pipeline_constants()


def _pack(latents: Tensor) -> Tensor:
    """(B, C, H, W) -> the pipeline's tokens (B, H/2 * W/2, 4C)."""
    batch, channels, height, width = latents.shape
    return QwenImagePipeline._pack_latents(latents, batch, channels, height, width)


def _unpack(tokens: Tensor, height: int, width: int) -> Tensor:
    """The pipeline's tokens back to (B, C, height, width) latents (a VAE factor of 1: latent sizes)."""
    return QwenImagePipeline._unpack_latents(tokens, height, width, 1).squeeze(2)


class QwenImageGenerator(ImageFlowGenerator):
    """Qwen-Image from a ``QwenImagePipeline`` folder (``Qwen/Qwen-Image`` and its fine-tunes).

    Latents are the VAE's ``(16, H/8, W/8)`` normalised latents (the pipeline's noise space, its
    ``(B, 1, C, H, W)`` draw without the frame axis). ``velocity`` packs them 2x2 into tokens
    (``QwenImagePipeline._pack_latents``), calls the transformer with ``timestep = sigma`` (the pipeline's
    ``t / 1000``), ``img_shapes`` of the packed grid and the text ``mask``, and unpacks the prediction.
    ``decode`` undoes ``latents_mean``/``latents_std`` as the pipeline does and decodes the one frame.

    Conditioning: ``hidden`` (B, max_sequence_length, 3584) is ``QwenImagePipeline._get_qwen_prompt_embeds``
    of each prompt alone (the last hidden state of the templated prompt, the template's leading tokens
    dropped, truncated to ``max_sequence_length`` as ``encode_prompt`` does), zero-padded to the fixed width;
    ``mask`` (B, max_sequence_length) marks its real tokens. See the module docstring for why.

    Guidance is the pipeline's true CFG: with ``model.rollout.guidance_scale`` != 1 the empty prompt is the
    negative branch and :meth:`guide` combines the two velocities with the pipeline's norm rescale.

    Args:
        pipeline_path: Local ``QwenImagePipeline`` folder.
        **kwargs: The other ``FlowGenerator`` arguments (``max_sequence_length`` defaults to the pipeline's
            512, at most its 1024).
    """

    family = "qwenimage"
    pipeline_class = QwenImagePipeline
    transformer_class = QwenImageTransformer2DModel
    vae_class = AutoencoderKLQwenImage
    default_lora_targets = QWENIMAGE_LORA_TARGETS
    default_max_sequence_length = 512

    def __init__(self, pipeline_path: str | None = None, **kwargs: Any) -> None:
        super().__init__(pipeline_path, **kwargs)
        if self.max_sequence_length > TOKENIZER_MAX_LENGTH:
            raise ValueError(
                f"max_sequence_length must be at most {TOKENIZER_MAX_LENGTH} for Qwen-Image (QwenImagePipeline's "
                f"limit), got {self.max_sequence_length}"
            )

    def _check_index(self, index: dict[str, Any]) -> None:
        if self.read_config("transformer").get("guidance_embeds"):
            raise NotImplementedError(
                f"{self.pipeline_path!r}: a guidance-distilled Qwen-Image transformer (guidance_embeds: true) is not "
                "supported; QwenImageGenerator trains the base model with true CFG"
            )

    # ------------------------------------------------------------------ geometry and schedule

    def vae_scale_factor(self) -> int:
        """``QwenImagePipeline.vae_scale_factor``: 2 per entry of the VAE's ``temperal_downsample``."""
        return 2 ** len(self.read_config("vae")["temperal_downsample"])

    def _latent_channels(self, transformer_config: dict[str, Any]) -> int:
        return int(transformer_config["in_channels"]) // 4  # the transformer sees 2x2-packed latents

    def _grid_multiple(self, transformer_config: dict[str, Any]) -> int:
        return 2

    def _schedule_kwargs(self, num_steps: int, scheduler_config: dict[str, Any]) -> dict[str, Any]:
        # QwenImagePipeline's own choice: sigmas np.linspace(1, 1/N, N) and mu = calculate_shift of the packed
        # image token count with the scheduler config's values (its fallback max_shift 1.15), always passed;
        # the scheduler applies it (exponential time shift, then shift_terminal) when it shifts dynamically.
        _, height, width = self.latent_shape
        sigmas = np.linspace(1.0, 1 / num_steps, num_steps).tolist()
        return {"sigmas": sigmas, "mu": pipeline_shift(scheduler_config, (height // 2) * (width // 2), 1.15)}

    # ------------------------------------------------------------------ components

    def _load_text(self, index: dict[str, Any]) -> None:
        self.tokenizer = self._load_tokenizer("tokenizer")
        self.text_encoder = self._load_frozen(Qwen2_5_VLForConditionalGeneration, "text_encoder")

    def prompt_features(self, text: str) -> Tensor:
        """``QwenImagePipeline._get_qwen_prompt_embeds`` of ``text`` alone, truncated to ``max_sequence_length``
        as ``encode_prompt`` does: (tokens, D) in the text encoder's dtype. Alone, no padding enters the
        encoder, so the features are the same whatever else is encoded."""
        tokens = self.tokenizer(
            [PROMPT_TEMPLATE.format(text)],
            max_length=TOKENIZER_MAX_LENGTH + TEMPLATE_TOKENS,
            truncation=True,
            return_tensors="pt",
        ).to(self.text_encoder.device)
        out = self.text_encoder(
            input_ids=tokens.input_ids, attention_mask=tokens.attention_mask, output_hidden_states=True
        )
        return out.hidden_states[-1][0, TEMPLATE_TOKENS:][: self.max_sequence_length]

    def _encode(self, texts: list[str]) -> Cond:
        width = self.max_sequence_length
        rows: dict[str, tuple[Tensor, Tensor]] = {}
        for text in dict.fromkeys(texts):
            states = self.prompt_features(text)
            pad = width - states.shape[0]
            mask = torch.cat([states.new_ones(states.shape[0]), states.new_zeros(pad)])
            rows[text] = (torch.cat([states, states.new_zeros(pad, states.shape[1])]), mask)
        return {
            "hidden": torch.stack([rows[text][0] for text in texts]),
            "mask": torch.stack([rows[text][1] for text in texts]),
        }

    def _forward(self, transformer: QwenImageTransformer2DModel, latents: Tensor, sigma: Tensor, cond: Cond) -> Tensor:
        batch, _, height, width = latents.shape
        velocity = transformer(
            hidden_states=_pack(latents),
            timestep=sigma,
            guidance=None,
            encoder_hidden_states=cond["hidden"],
            encoder_hidden_states_mask=cond["mask"],
            img_shapes=[[(1, height // 2, width // 2)]] * batch,
            return_dict=False,
        )[0]
        return _unpack(velocity, height, width)

    def guide(self, v_cond: Tensor, v_uncond: Tensor, scale: float | Tensor) -> Tensor:
        """The pipeline's true CFG: ``comb = v_u + g (v_c - v_u)`` rescaled per packed token (a 2x2 patch of
        every channel) to the conditional velocity's norm, ``comb * |v_c| / |comb|`` (``QwenImagePipeline``'s
        denoising loop; Flow-GRPO's ``compute_log_prob`` the same). ``DiffusionDenoise.velocity`` calls it."""
        _, _, height, width = v_cond.shape
        comb = v_uncond + scale * (v_cond - v_uncond)
        packed, cond = _pack(comb), _pack(v_cond)
        rescaled = packed * (torch.norm(cond, dim=-1, keepdim=True) / torch.norm(packed, dim=-1, keepdim=True))
        return _unpack(rescaled, height, width)

    def vae_latents(self, latents: Tensor) -> Tensor:
        """The VAE's own latents (N, C, 1, H, W) of sampler latents (N, C, H, W), as ``QwenImagePipeline``
        computes them before decoding: ``latents / (1 / latents_std) + latents_mean``."""
        config = self.vae.config
        shape = (1, config.z_dim, 1, 1, 1)
        latents = latents.unsqueeze(2)
        mean = torch.tensor(config.latents_mean).view(shape).to(latents.device, latents.dtype)
        inverse_std = 1.0 / torch.tensor(config.latents_std).view(shape).to(latents.device, latents.dtype)
        return latents / inverse_std + mean

    def _decode(self, latents: Tensor) -> Tensor:
        return self.vae.decode(self.vae_latents(latents), return_dict=False)[0][:, :, 0]
