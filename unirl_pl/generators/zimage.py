"""Z-Image and Z-Image-Turbo as a ``FlowGenerator``: the second-to-last Qwen3 hidden states of the chat-templated
prompt, each prompt at its own length, join the VAE latent tokens in one single-stream DiT."""

from __future__ import annotations

from typing import Any

import torch
from diffusers import ZImagePipeline, ZImageTransformer2DModel
from diffusers.pipelines.z_image.pipeline_z_image import calculate_shift, get_default_z_image_sigmas
from transformers import Qwen3Model

from unirl_pl.generators.base import Cond
from unirl_pl.generators.image import ImageFlowGenerator
from unirl_pl.generators.schedule import read_scheduler_config

# Flow-Factory's Z-Image targets (X-GenGroup/Flow-Factory, src/flow_factory/models/z_image/z_image.py,
# ``default_target_modules``, commit a0b2bc5a2b4fbf9125429b3fb70c0c5d7631047c): the attention projections and
# the SwiGLU feed-forward of every ZImageTransformerBlock (the 30 main layers and both 2-layer refiners).
ZIMAGE_LORA_TARGETS: tuple[str, ...] = (
    "attention.to_k",
    "attention.to_q",
    "attention.to_v",
    "attention.to_out.0",
    "feed_forward.w1",
    "feed_forward.w2",
    "feed_forward.w3",
)

TURBO_SHIFT = 3.0
"""The scheduler shift Z-Image-Turbo's ``scheduler_config.json`` ships (the base model's is 6.0): with the
architecture and every other config the same, it is what tells the two published folders apart."""


class ZImageGenerator(ImageFlowGenerator):
    """Z-Image (base) or Z-Image-Turbo (step-distilled) from a ``ZImagePipeline`` folder.

    Latents are the pipeline's VAE latents ``(in_channels, H/8, W/8)``; the transformer patchifies them itself.
    ``velocity`` calls it as ``ZImagePipeline.__call__`` does: a list of ``(C, 1, h, w)`` latents, the timestep
    ``(1000 - t) / 1000`` of the scheduler's ``t = 1000 sigma`` (so 1 is clean, 0 pure noise), and one caption
    tensor per sample at its own length; the model predicts ``x0 - noise``, which the pipeline negates before
    its scheduler's Euler step, so the velocity here is its negation too. ``decode`` is the pipeline's
    (``latents / scaling_factor + shift_factor``, then the VAE). Conditioning is
    ``ZImagePipeline._encode_prompt``: the prompt as one user turn through the tokenizer's chat template
    (``enable_thinking=True``), padded to ``max_sequence_length``, the Qwen3 ``hidden_states[-2]``; ``hidden``
    holds them with the padding zeroed and ``mask`` which tokens are real, and ``velocity`` hands each sample's
    real tokens only, as the pipeline's per-prompt lists do, so a sample's output does not depend on its batch.

    Classifier-free guidance is the project's ``model.rollout.guidance_scale`` ``g`` (``v_u + g (v_c - v_u)``,
    the empty prompt as the unconditional branch). The pipeline's ``guidance_scale`` ``w`` guides as
    ``v_c + w (v_c - v_u)``, which is ``g = w + 1``: its ``guidance_scale=4.0`` is ``g = 5.0`` here, its 0.0
    (no CFG) is 1.0. Its ``cfg_normalization`` and ``cfg_truncation`` are not supported (off by default there).
    A step-distilled folder (Turbo) samples without guidance, and :meth:`check_guidance` refuses one.

    Args:
        pipeline_path: Local ``ZImagePipeline`` folder.
        distilled: Whether the folder is the step-distilled Z-Image-Turbo; None reads it from the folder: its
            scheduler's shift is Turbo's 3.0 (the base model ships 6.0; nothing else in the folders differs).
        **kwargs: The other ``FlowGenerator`` arguments (``max_sequence_length`` defaults to 512, the pipeline's).
    """

    family = "zimage"
    pipeline_class = ZImagePipeline
    transformer_class = ZImageTransformer2DModel
    default_lora_targets = ZIMAGE_LORA_TARGETS
    default_max_sequence_length = 512

    def __init__(self, pipeline_path: str | None = None, distilled: bool | None = None, **kwargs: Any) -> None:
        super().__init__(pipeline_path, **kwargs)
        self.distilled = None if distilled is None else bool(distilled)

    # ------------------------------------------------------------------ the folder

    @property
    def is_distilled(self) -> bool:
        """Whether the folder is Z-Image-Turbo (``distilled``, else its scheduler's shift is Turbo's 3.0), which
        the pipeline samples without classifier-free guidance."""
        if self.distilled is not None:
            return self.distilled
        return float(read_scheduler_config(self._folder()).get("shift", 1.0)) == TURBO_SHIFT

    def check_guidance(self, guidance_scale: float, setting: str) -> None:
        """Refuse classifier-free guidance (``guidance_scale != 1``) on Z-Image-Turbo, which is sampled without it
        (``guidance_scale=0.0`` in its pipeline): sampling with it would train a policy the checkpoint is never
        served with. ``setting`` names the option in the message."""
        if guidance_scale != 1.0 and self.is_distilled:
            why = "distilled: true" if self.distilled else f"its scheduler's shift is Turbo's {TURBO_SHIFT}"
            raise ValueError(
                f"{setting}={guidance_scale}: {self.pipeline_path!r} is the step-distilled Z-Image-Turbo ({why}), "
                f"which samples without classifier-free guidance; set {setting}=1.0 (the pipeline's "
                "guidance_scale=0.0), or model.generator.init_args.distilled=false if the folder is the base model"
            )

    def _check_index(self, index: dict[str, Any]) -> None:
        width = int(self.read_config("text_encoder")["hidden_size"])
        transformer = self.read_config("transformer")
        if width != int(transformer["cap_feat_dim"]):
            raise ValueError(
                f"{self.pipeline_path!r}: the Qwen3 text encoder is {width} wide, but the transformer reads "
                f"captions of cap_feat_dim {transformer['cap_feat_dim']}"
            )
        if 2 not in list(transformer.get("all_patch_size", [2])):
            raise ValueError(f"{self.pipeline_path!r}: the transformer has no patch size 2, which the pipeline runs")

    # ------------------------------------------------------------------ geometry and schedule

    def _latent_channels(self, transformer_config: dict[str, Any]) -> int:
        return int(transformer_config["in_channels"])

    def _grid_multiple(self, transformer_config: dict[str, Any]) -> int:
        return 2  # the pipeline's patch size (its sizes must be multiples of 2 x the VAE factor)

    def _schedule_kwargs(self, num_steps: int, scheduler_config: dict[str, Any]) -> dict[str, Any]:
        # ZImagePipeline's own choice: its default sigmas linspace(1, 1/N, N) in float32, and mu from the patch
        # token count, which the scheduler reads only when it shifts dynamically (the published Z-Image and
        # Turbo schedulers shift by a fixed 6.0 and 3.0, so mu is left out there).
        sigmas = get_default_z_image_sigmas(num_steps)
        if not scheduler_config.get("use_dynamic_shifting"):
            return {"sigmas": sigmas}
        _, height, width = self.latent_shape
        mu = calculate_shift(
            (height // 2) * (width // 2),
            scheduler_config.get("base_image_seq_len", 256),
            scheduler_config.get("max_image_seq_len", 4096),
            scheduler_config.get("base_shift", 0.5),
            scheduler_config.get("max_shift", 1.15),
        )
        return {"sigmas": sigmas, "mu": float(mu)}

    # ------------------------------------------------------------------ components

    def _load_text(self, index: dict[str, Any]) -> None:
        self.tokenizer = self._load_tokenizer("tokenizer")
        self.text_encoder = self._load_frozen(Qwen3Model, "text_encoder")

    def _encode(self, texts: list[str]) -> Cond:
        prompts = [
            self.tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True, enable_thinking=True
            )
            for text in texts
        ]
        ids, mask = self._token_ids(self.tokenizer, prompts, self.max_sequence_length, self.text_encoder.device)
        out = self.text_encoder(input_ids=ids, attention_mask=mask.bool(), output_hidden_states=True)
        hidden = out.hidden_states[-2]
        mask = mask.to(hidden.dtype)
        return {"hidden": hidden * mask.unsqueeze(-1), "mask": mask}

    def _forward(
        self, transformer: ZImageTransformer2DModel, latents: torch.Tensor, sigma: torch.Tensor, cond: Cond
    ) -> torch.Tensor:
        # The pipeline's arithmetic on the scheduler's float32 timestep t = 1000 sigma, bit for bit.
        timestep = (1000.0 - sigma * 1000.0) / 1000.0
        captions = [hidden[mask.bool()] for hidden, mask in zip(cond["hidden"], cond["mask"], strict=True)]
        out = transformer(list(latents.unsqueeze(2).unbind(0)), timestep, captions, return_dict=False)[0]
        return -torch.stack(out).squeeze(2)
