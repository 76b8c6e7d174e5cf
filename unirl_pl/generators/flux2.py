"""FLUX.2 [klein] (base and step-distilled) as a ``FlowGenerator``: Qwen3 hidden states of a few layers
condition a Flux2 DiT on 2x2-patchified, batch-normalised VAE latents; with a reference (source) image, its
latents follow the target's tokens as ``Flux2KleinPipeline``'s ``image`` argument puts them."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from diffusers import AutoencoderKLFlux2, Flux2KleinPipeline, Flux2Transformer2DModel
from diffusers.image_processor import VaeImageProcessor
from diffusers.pipelines.flux2.pipeline_flux2_klein import compute_empirical_mu, retrieve_latents
from transformers import Qwen3ForCausalLM

from unirl_pl.experts._common import check_positive
from unirl_pl.generators.base import Cond
from unirl_pl.generators.flux_kontext import SOURCE_KEY, check_source_size, resized_source
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

    Editing (a reference image, the pipeline's ``image``): ``encode_source`` resizes each source alone to
    ``source_size`` and encodes it as ``Flux2KleinPipeline._encode_vae_image`` does (the VAE's mode, 2x2
    patchify, the batch-norm statistics) into ``source_latents`` (B, in_channels, h/16, w/16 for the real VAE).
    ``velocity`` appends their tokens after the target's with the pipeline's reference ids
    (``_prepare_image_ids``: time coordinate 10, the reference's own rows and columns) and keeps the prediction
    of the target tokens; the schedule's ``mu`` counts the target tokens only, as the pipeline's does. The
    unconditional branch of classifier-free guidance sees the same reference (the pipeline passes it to both).
    Without ``source_latents`` in the conditioning everything is text-to-image exactly as before.

    Args:
        pipeline_path: Local ``Flux2KleinPipeline`` folder.
        text_encoder_out_layers: Indices into the Qwen3 ``hidden_states`` (0 is the embeddings) whose
            states are stacked into the text features; the pipeline's default is (9, 18, 27). Their count
            times the Qwen3 width must be the transformer's ``joint_attention_dim``.
        source_size: ``(height, width)`` in pixels every reference image is brought to (multiples of 16 for the
            real VAE); ``None`` means the sample's ``height`` x ``width``. The pipeline keeps a reference at its
            own size (at most 1 MP, center-cropped to a multiple of 16) and makes the output that size when none
            is given; a training batch needs one size, so a reference of another size is resized keeping its
            aspect ratio and center-cropped (the pipeline never stretches a reference). A reference already at
            ``source_size`` is used as the pipeline uses it.
        **kwargs: The other ``FlowGenerator`` arguments (``max_sequence_length`` defaults to 512).
    """

    family = "flux2_klein"
    pipeline_class = Flux2KleinPipeline
    transformer_class = Flux2Transformer2DModel
    vae_class = AutoencoderKLFlux2
    default_lora_targets = FLUX2_KLEIN_LORA_TARGETS
    default_max_sequence_length = 512
    takes_source_images = True

    def __init__(
        self,
        pipeline_path: str | None = None,
        text_encoder_out_layers: tuple[int, ...] = (9, 18, 27),
        source_size: tuple[int, int] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(pipeline_path, **kwargs)
        layers = tuple(int(layer) for layer in text_encoder_out_layers)
        if not layers or min(layers) < 0:
            raise ValueError(f"text_encoder_out_layers must be non-negative layer indices, got {list(layers)}")
        self.text_encoder_out_layers = layers
        size = (self.height, self.width) if source_size is None else tuple(int(side) for side in source_size)
        if len(size) != 2:
            raise ValueError(f"source_size must be [height, width], got {list(size)}")
        check_positive(source_height=size[0], source_width=size[1])
        self.source_size: tuple[int, int] = size

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
        check_source_size(self.source_size, 2 * self.vae_scale_factor(), self.family)
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

    def _encode_source(self, images: list[torch.Tensor]) -> Cond:
        # The base processor's "crop" resizes keeping the aspect ratio, then center-crops (Flux2ImageProcessor's
        # own "crop" only crops: the pipeline keeps a reference at its own size).
        processor = VaeImageProcessor(vae_scale_factor=2 * self.vae_scale_factor())
        bn = self.vae.bn
        latents = []
        for image in images:  # one at a time: a source's latents never depend on its batch
            pixels = resized_source(image, self.source_size, processor, resize_mode="crop")
            pixels = pixels.to(self.vae.device, self.vae.dtype)
            latent = retrieve_latents(self.vae.encode(pixels), sample_mode="argmax")
            latent = Flux2KleinPipeline._patchify_latents(latent)
            mean = bn.running_mean.view(1, -1, 1, 1).to(latent.device, latent.dtype)
            std = torch.sqrt(bn.running_var.view(1, -1, 1, 1) + self.vae.config.batch_norm_eps)
            latents.append((latent - mean) / std.to(latent.device, latent.dtype))
        return {SOURCE_KEY: torch.cat(latents)}

    def _forward(
        self, transformer: Flux2Transformer2DModel, latents: torch.Tensor, sigma: torch.Tensor, cond: Cond
    ) -> torch.Tensor:
        _, _, height, width = latents.shape
        img_ids = Flux2KleinPipeline._prepare_latent_ids(latents).to(latents.device)
        txt_ids = Flux2KleinPipeline._prepare_text_ids(cond["hidden"]).to(latents.device)
        tokens, ids = Flux2KleinPipeline._pack_latents(latents), img_ids
        source = cond.get(SOURCE_KEY)
        if source is not None:
            # Flux2KleinPipeline.prepare_image_latents with one reference per sample: its tokens after the
            # target's, its ids those of the first reference (time coordinate 10) for every row.
            source_ids = Flux2KleinPipeline._prepare_image_ids([source[:1]]).to(latents.device)
            tokens = torch.cat([tokens, Flux2KleinPipeline._pack_latents(source)], dim=1)
            ids = torch.cat([img_ids, source_ids.expand(latents.shape[0], -1, -1)], dim=1)
        velocity = transformer(
            hidden_states=tokens,
            timestep=sigma,
            guidance=None,
            encoder_hidden_states=cond["hidden"],
            txt_ids=txt_ids,
            img_ids=ids,
            return_dict=False,
        )[0]
        if source is not None:
            velocity = velocity[:, : height * width]  # the target's tokens
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
