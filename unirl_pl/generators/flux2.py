"""FLUX.2 [klein] (base and step-distilled) as a ``FlowGenerator``: Qwen3 hidden states of a few layers
condition a Flux2 DiT on 2x2-patchified, batch-normalised VAE latents."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from diffusers import AutoencoderKLFlux2, Flux2KleinPipeline, Flux2Transformer2DModel
from diffusers.pipelines.flux2.pipeline_flux2_klein import compute_empirical_mu
from transformers import Qwen3ForCausalLM

from unirl_pl.generators.base import Cond
from unirl_pl.generators.folder import read_model_index
from unirl_pl.generators.image import ImageFlowGenerator

# Flow-Factory's FLUX.2 [klein] targets (X-GenGroup/Flow-Factory, src/flow_factory/models/flux/flux2_klein.py,
# ``default_target_modules``, commit a0b2bc5a2b4fbf9125429b3fb70c0c5d7631047c): both streams' attention and
# feed-forward projections of the double blocks, and the single blocks' fused QKV+MLP input projection. Its
# list also names "attn.to_out.0" for the single blocks, but their ``attn.to_out`` is one Linear in diffusers,
# which that suffix does not match: the single blocks' output projection stays frozen there, and here.
FLUX2_KLEIN_LORA_TARGETS: tuple[str, ...] = (
    "attn.to_q",
    "attn.to_k",
    "attn.to_v",
    "attn.to_out.0",
    "attn.add_q_proj",
    "attn.add_k_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
    "ff.linear_in",
    "ff.linear_out",
    "ff_context.linear_in",
    "ff_context.linear_out",
    "attn.to_qkv_mlp_proj",
)


class Flux2KleinGenerator(ImageFlowGenerator):
    """FLUX.2 [klein] from a ``Flux2KleinPipeline`` folder (klein-base-4B/9B, or the step-distilled 4B/9B).

    Latents are the pipeline's own ``(in_channels, H/16, W/16)`` grid: the VAE latents patchified 2x2 and
    normalised by the VAE's batch-norm statistics, where the pipeline draws its noise. ``velocity`` packs them
    into tokens with the pipeline's position ids (``_prepare_latent_ids``, ``_prepare_text_ids``), calls the
    transformer with ``timestep = sigma`` (the pipeline's ``t / 1000``; the model scales by 1000 itself) and
    ``guidance=None``, and scatters the prediction back (``_unpack_latents_with_ids``). ``decode`` undoes the
    batch norm, unpatchifies and runs the VAE, as the pipeline's decode does. Conditioning is
    ``Flux2KleinPipeline._get_qwen3_prompt_embeds``: the chat-templated prompt padded to
    ``max_sequence_length``, the hidden states of ``text_encoder_out_layers`` stacked on the feature dim.

    Classifier-free guidance is the project's (``model.rollout.guidance_scale`` with the empty prompt as the
    unconditional branch, ``v_u + g (v_c - v_u)``), which is the pipeline's own CFG on the base model; a
    step-distilled folder (``is_distilled: true`` in ``model_index.json``) samples without it, and
    :meth:`check_guidance` refuses a guidance scale there.

    Args:
        pipeline_path: Local ``Flux2KleinPipeline`` folder.
        text_encoder_out_layers: Indices into the Qwen3 ``hidden_states`` (0 is the embeddings) whose
            states are stacked into the text features; the pipeline's default is (9, 18, 27). Their count
            times the Qwen3 width must be the transformer's ``joint_attention_dim``.
        **kwargs: The other ``FlowGenerator`` arguments (``max_sequence_length`` defaults to 512).
    """

    family = "flux2_klein"
    pipeline_class = Flux2KleinPipeline
    transformer_class = Flux2Transformer2DModel
    vae_class = AutoencoderKLFlux2
    default_lora_targets = FLUX2_KLEIN_LORA_TARGETS
    default_max_sequence_length = 512

    def __init__(
        self,
        pipeline_path: str | None = None,
        text_encoder_out_layers: tuple[int, ...] = (9, 18, 27),
        **kwargs: Any,
    ) -> None:
        super().__init__(pipeline_path, **kwargs)
        layers = tuple(int(layer) for layer in text_encoder_out_layers)
        if not layers or min(layers) < 0:
            raise ValueError(f"text_encoder_out_layers must be non-negative layer indices, got {list(layers)}")
        self.text_encoder_out_layers = layers

    # ------------------------------------------------------------------ the folder

    @property
    def is_distilled(self) -> bool:
        """Whether the folder is a step-distilled klein (``is_distilled`` in ``model_index.json``), which the
        pipeline samples without classifier-free guidance."""
        return bool(read_model_index(self._folder()).get("is_distilled", False))

    def check_guidance(self, guidance_scale: float, setting: str) -> None:
        """Refuse classifier-free guidance (``guidance_scale != 1``) on a step-distilled folder, whose pipeline
        ignores it: sampling with it would train a policy the checkpoint is never served with. ``setting``
        names the option in the message (``model.rollout.guidance_scale``)."""
        if guidance_scale != 1.0 and self.is_distilled:
            raise ValueError(
                f"{setting}={guidance_scale}: {self.pipeline_path!r} is a step-distilled FLUX.2 [klein] "
                "(is_distilled: true in model_index.json), which samples without classifier-free guidance; "
                f"set {setting}=1.0 (or train the base model)"
            )

    def _check_index(self, index: dict[str, Any]) -> None:
        text = self.read_config("text_encoder")
        available = int(text["num_hidden_layers"])
        if max(self.text_encoder_out_layers) > available:
            raise ValueError(
                f"text_encoder_out_layers={list(self.text_encoder_out_layers)}: the Qwen3 text encoder has "
                f"{available} layers, so its hidden states are indices 0..{available}"
            )
        width = len(self.text_encoder_out_layers) * int(text["hidden_size"])
        expected = int(self.read_config("transformer")["joint_attention_dim"])
        if width != expected:
            raise ValueError(
                f"text_encoder_out_layers={list(self.text_encoder_out_layers)} stacks {width} features "
                f"({len(self.text_encoder_out_layers)} x {text['hidden_size']}), but the transformer's "
                f"joint_attention_dim is {expected}"
            )

    # ------------------------------------------------------------------ geometry and schedule

    def _latent_channels(self, transformer_config: dict[str, Any]) -> int:
        return int(transformer_config["in_channels"]) // 4  # the VAE's channels before the 2x2 patchify

    def _grid_multiple(self, transformer_config: dict[str, Any]) -> int:
        return 2

    def _compute_latent_shape(self) -> tuple[int, ...]:
        # The parent checks the size against the VAE and 2x2 grid and gives the VAE latent shape; the
        # sampler works on the patchified grid the pipeline draws its noise on.
        channels, height, width = super()._compute_latent_shape()
        return (channels * 4, height // 2, width // 2)

    def _schedule_kwargs(self, num_steps: int, scheduler_config: dict[str, Any]) -> dict[str, Any]:
        # Flux2KleinPipeline's own choice: sigmas linspace(1, 1/N, N) (the scheduler's flow sigmas if it has
        # them) and the empirical mu of the image token count and the step count.
        _, height, width = self.latent_shape
        sigmas = None
        if not scheduler_config.get("use_flow_sigmas"):
            sigmas = np.linspace(1.0, 1.0 / num_steps, num_steps).tolist()
        return {"sigmas": sigmas, "mu": compute_empirical_mu(image_seq_len=height * width, num_steps=num_steps)}

    # ------------------------------------------------------------------ components

    def _load_text(self, index: dict[str, Any]) -> None:
        self.tokenizer = self._load_tokenizer("tokenizer")
        self.text_encoder = self._load_frozen(Qwen3ForCausalLM, "text_encoder")

    def _encode(self, texts: list[str]) -> Cond:
        hidden = Flux2KleinPipeline._get_qwen3_prompt_embeds(
            text_encoder=self.text_encoder,
            tokenizer=self.tokenizer,
            prompt=texts,
            max_sequence_length=self.max_sequence_length,
            hidden_states_layers=self.text_encoder_out_layers,
        )
        return {"hidden": hidden}

    def _forward(
        self, transformer: Flux2Transformer2DModel, latents: torch.Tensor, sigma: torch.Tensor, cond: Cond
    ) -> torch.Tensor:
        _, _, height, width = latents.shape
        img_ids = Flux2KleinPipeline._prepare_latent_ids(latents).to(latents.device)
        txt_ids = Flux2KleinPipeline._prepare_text_ids(cond["hidden"]).to(latents.device)
        velocity = transformer(
            hidden_states=Flux2KleinPipeline._pack_latents(latents),
            timestep=sigma,
            guidance=None,
            encoder_hidden_states=cond["hidden"],
            txt_ids=txt_ids,
            img_ids=img_ids,
            return_dict=False,
        )[0]
        return Flux2KleinPipeline._unpack_latents_with_ids(velocity, img_ids, height, width)

    def vae_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """The VAE's own latents (N, C, 2h, 2w) of sampler latents (N, 4C, h, w): the batch norm undone with
        the VAE's running statistics, then unpatchified, as ``Flux2KleinPipeline`` does before decoding (its
        ``output_type="latent"``)."""
        bn = self.vae.bn
        mean = bn.running_mean.view(1, -1, 1, 1).to(latents.device, latents.dtype)
        std = torch.sqrt(bn.running_var.view(1, -1, 1, 1) + self.vae.config.batch_norm_eps)
        latents = latents * std.to(latents.device, latents.dtype) + mean
        return Flux2KleinPipeline._unpatchify_latents(latents)

    def _decode(self, latents: torch.Tensor) -> torch.Tensor:
        return self.vae.decode(self.vae_latents(latents), return_dict=False)[0]
