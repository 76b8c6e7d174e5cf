"""The generator expert: a ``diffusers`` flow-matching transformer (SD3 MMDiT) with a LoRA adapter."""

from __future__ import annotations

from typing import Any

import torch
from diffusers import SD3Transformer2DModel
from diffusers.loaders import SD3LoraLoaderMixin
from peft.utils import get_peft_model_state_dict

from unirl_pl.experts._common import check_positive, seeded_cpu_init
from unirl_pl.experts.base import LoRAExpert
from unirl_pl.lora import load_lora_file

DEFAULT_DIT_LORA_TARGETS: tuple[str, ...] = ("to_q", "to_k", "to_v", "to_out.0")
# Prefix the SD3 pipeline's ``save_lora_weights`` puts on transformer keys; loaders filter on it.
_PIPELINE_PREFIX = "transformer"


class FlowTransformerExpert(LoRAExpert):
    """Generator expert: a flow-matching diffusion transformer whose only trainable weights are LoRA.

    The constructor only records and validates its arguments; ``build()`` (called from the
    LightningModule's ``configure_model``) creates the model. With no ``pretrained_path`` it builds a
    tiny ``SD3Transformer2DModel`` initialized from ``init_seed`` without touching the global RNG; with
    a path it loads ``SD3Transformer2DModel.from_pretrained(path, subfolder=...)``, e.g. a diffusers
    pipeline folder with ``subfolder="transformer"``. The model predicts the flow velocity
    ``v = noise - x0`` at noise level ``sigma`` in [0, 1]. The reference policy is the same model with
    the adapter disabled (``adapter_disabled()``).

    Args:
        pretrained_path: Local folder or hub id holding the transformer; ``None`` builds the tiny model.
        subfolder: Subfolder of ``pretrained_path`` with the transformer (``"transformer"`` for a
            pipeline folder); ``None`` means the path itself.
        sample_size: Tiny model only: latent height and width.
        patch_size: Tiny model only: side of the square latent patches; must divide ``sample_size``.
        in_channels: Tiny model only: latent channels (also the output channels).
        num_layers: Tiny model only: number of joint transformer blocks.
        attention_head_dim: Tiny model only: width of one attention head.
        num_attention_heads: Tiny model only: heads; ``num_attention_heads * attention_head_dim`` is the
            model width and must equal ``caption_projection_dim``.
        joint_attention_dim: Tiny model only: width of the text hidden states it attends to (the text
            encoder's hidden size).
        caption_projection_dim: Tiny model only: width the text states are projected to.
        pooled_projection_dim: Tiny model only: width of the pooled text embedding (the text encoder's
            projection size).
        qk_norm: Tiny model only: normalization of attention queries and keys (``rms_norm`` as in
            SD3.5, or None as in SD3). RMS-normalized queries and keys let a small model learn sharp,
            local attention quickly; without it a tiny pixel DiT's attention stays near uniform.
        lora_rank: LoRA rank ``r`` (>= 1).
        lora_alpha: LoRA scaling numerator; the adapter output is scaled by ``lora_alpha / lora_rank``.
        lora_target_modules: Module names that get LoRA; default ``to_q to_k to_v to_out.0``.
        lora_init: LoRA init: ``gaussian`` (A ~ N(0, 1/r)) or ``default`` (Kaiming-uniform A); both set
            B = 0 so the policy equals the reference at step 0.
        dtype: Dtype of the base weights: ``float32``, ``bfloat16`` or ``float16`` (LoRA weights are
            kept in float32).
        init_seed: Seed of the tiny model's weights and of the LoRA init.
        finetune: ``lora`` trains the adapter on frozen base weights; ``full`` trains every weight in float32
            against a frozen copy of the initial weights as the KL reference (the LoRA arguments unused).
    """

    def __init__(
        self,
        pretrained_path: str | None = None,
        subfolder: str | None = None,
        sample_size: int = 16,
        patch_size: int = 2,
        in_channels: int = 4,
        num_layers: int = 2,
        attention_head_dim: int = 16,
        num_attention_heads: int = 2,
        joint_attention_dim: int = 32,
        caption_projection_dim: int = 32,
        pooled_projection_dim: int = 32,
        qk_norm: str | None = None,
        lora_rank: int = 8,
        lora_alpha: float = 16.0,
        lora_target_modules: list[str] | None = None,
        lora_init: str = "gaussian",
        dtype: str = "float32",
        init_seed: int = 0,
        finetune: str = "lora",
    ) -> None:
        super().__init__(pretrained_path, dtype, init_seed)
        check_positive(
            sample_size=sample_size,
            patch_size=patch_size,
            in_channels=in_channels,
            num_layers=num_layers,
            attention_head_dim=attention_head_dim,
            num_attention_heads=num_attention_heads,
            joint_attention_dim=joint_attention_dim,
            caption_projection_dim=caption_projection_dim,
            pooled_projection_dim=pooled_projection_dim,
        )
        self._init_lora(lora_rank, lora_alpha, lora_target_modules, DEFAULT_DIT_LORA_TARGETS, lora_init, finetune)
        if sample_size % patch_size:
            raise ValueError(f"patch_size ({patch_size}) must divide sample_size ({sample_size})")
        if num_attention_heads * attention_head_dim != caption_projection_dim:
            # The projected caption tokens join the image tokens in one attention, so widths must match.
            raise ValueError(
                f"caption_projection_dim ({caption_projection_dim}) must equal num_attention_heads * "
                f"attention_head_dim ({num_attention_heads * attention_head_dim})"
            )
        self.subfolder = subfolder
        self.sample_size, self.patch_size, self.in_channels = sample_size, patch_size, in_channels
        self.num_layers, self.attention_head_dim = num_layers, attention_head_dim
        self.num_attention_heads, self.joint_attention_dim = num_attention_heads, joint_attention_dim
        self.caption_projection_dim, self.pooled_projection_dim = caption_projection_dim, pooled_projection_dim
        if qk_norm not in (None, "rms_norm", "layer_norm"):
            raise ValueError(f"qk_norm must be rms_norm, layer_norm or None, got {qk_norm!r}")
        self.qk_norm = qk_norm
        self.model: SD3Transformer2DModel | None = None

    def tiny_config(self) -> dict[str, Any]:
        """Keyword arguments of the tiny ``SD3Transformer2DModel`` this expert builds without a path."""
        return {
            "sample_size": self.sample_size,
            "patch_size": self.patch_size,
            "in_channels": self.in_channels,
            "out_channels": self.in_channels,
            "num_layers": self.num_layers,
            "attention_head_dim": self.attention_head_dim,
            "num_attention_heads": self.num_attention_heads,
            "joint_attention_dim": self.joint_attention_dim,
            "caption_projection_dim": self.caption_projection_dim,
            "pooled_projection_dim": self.pooled_projection_dim,
            "qk_norm": self.qk_norm,
            # Positional embeddings are cropped from this grid, so leave room for 2x larger latents.
            "pos_embed_max_size": 2 * self.sample_size // self.patch_size,
        }

    def build(self) -> None:
        """Create the model and make it trainable (LoRA attached, or every weight: ``finetune``); a second call
        is a no-op."""
        if self.is_built:
            return
        with seeded_cpu_init(self.init_seed):
            self.model = self._adapt(self._diffusers_model(SD3Transformer2DModel))

    @property
    def latent_shape(self) -> tuple[int, int, int]:
        """(channels, height, width) of the latents the model was configured for."""
        if self.model is not None:
            config = self.model.config
            return (config.in_channels, config.sample_size, config.sample_size)
        if self.pretrained_path is None:
            return (self.in_channels, self.sample_size, self.sample_size)
        config = SD3Transformer2DModel.load_config(self.pretrained_path, subfolder=self.subfolder)
        return (config["in_channels"], config["sample_size"], config["sample_size"])

    def velocity(
        self,
        latents: torch.Tensor,
        sigma: torch.Tensor | float,
        hidden: torch.Tensor,
        pooled: torch.Tensor,
        source: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Predict the flow velocity for ``latents`` (B, C, H, W) at noise level ``sigma`` (B,) or a
        scalar, given text hidden states ``hidden`` (B, L, D) and pooled text ``pooled`` (B, P).

        With ``source`` (B, C, H, W), the clean latents of an image to edit, the model reads it in context:
        the source is placed beside the noisy target (concatenated along the width), so its tokens join the
        target's in every attention and are told apart by their positional embeddings, and the prediction
        of the target's half is returned. The model's ``pos_embed_max_size`` must cover twice the width.

        Diffusers flow transformers take the timestep as ``sigma * 1000``. Inputs are cast to the
        model dtype; the result comes back in the dtype of ``latents``.
        """
        model = self._require_built()
        dtype = model.dtype
        batch, width = latents.shape[0], latents.shape[-1]
        sigma = torch.as_tensor(sigma, device=latents.device, dtype=torch.float32)
        timestep = (sigma * 1000.0).reshape(-1).expand(batch)
        inputs = latents
        if source is not None:
            if source.shape != latents.shape:
                raise ValueError(
                    f"source latents {tuple(source.shape)} must have the shape of the target {tuple(latents.shape)}"
                )
            inputs = torch.cat([latents, source.to(latents.dtype)], dim=-1)
        (velocity,) = model(
            hidden_states=inputs.to(dtype),
            encoder_hidden_states=hidden.to(dtype),
            pooled_projections=pooled.to(dtype),
            timestep=timestep,
            return_dict=False,
        )
        return velocity[..., :width].to(latents.dtype)

    def save_adapter(self, path: str) -> None:
        """Save the LoRA adapter in the diffusers SD3 LoRA format.

        Writes ``pytorch_lora_weights.safetensors`` with ``transformer.``-prefixed keys plus the LoRA
        config as metadata: ``StableDiffusion3Pipeline.load_lora_weights(path)`` reads it as is, and a
        bare model reads it with ``load_lora_adapter(path, use_safetensors=True)`` (without that flag
        the model-level loader looks for a ``.bin`` file).
        """
        self._require_lora("save_adapter")
        model = self._require_built()
        SD3LoraLoaderMixin.save_lora_weights(
            path,
            transformer_lora_layers=get_peft_model_state_dict(model),
            transformer_lora_adapter_metadata=model.peft_config["default"].to_dict(),
        )

    def load_adapter(self, path: str) -> None:
        """Load LoRA weights written by ``save_adapter`` (a folder or the file) into this expert's adapter, in
        place, raising ``ValueError`` when they do not match it."""
        self._require_lora("load_adapter")
        load_lora_file(self._require_built(), path, _PIPELINE_PREFIX)
