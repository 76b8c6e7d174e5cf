"""The family-agnostic generator interface: a diffusers flow-matching pipeline folder seen as
``encode`` (texts -> conditioning), ``velocity`` (the trainable LoRA-adapted transformer) and ``decode``
(latents -> pixels), plus the shared loading, LoRA and adapter-export code of every family."""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, ClassVar

import torch
from diffusers import DiffusionPipeline, ModelMixin
from peft import LoraConfig
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from unirl_pl.experts._common import check_positive, freeze, resolve_dtype, seeded_cpu_init
from unirl_pl.experts.base import LORA_INITS, attach_diffusers_lora, check_lora_args
from unirl_pl.experts.finetune import adapt, check_finetune
from unirl_pl.generators.adapter_io import AdapterIO
from unirl_pl.generators.folder import read_model_index
from unirl_pl.generators.schedule import Schedule, pipeline_schedule
from unirl_pl.generators.source import check_images
from unirl_pl.paths import read_json_file
from unirl_pl.records import Cond


class FlowGenerator(AdapterIO, torch.nn.Module, ABC):
    """A flow-matching text-to-image/video generator loaded from a diffusers pipeline folder.

    The constructor only records and validates its arguments; ``build()`` loads the pipeline's
    tokenizers, text encoders and VAE (frozen, always in eval mode) and its transformer as ``model``
    (frozen base plus a trainable float32 LoRA adapter). The sampler and losses see only the
    family-agnostic surface: ``latent_shape`` (per sample, no batch dim), ``encode(texts) -> Cond``,
    ``velocity(latents, sigma, cond)`` predicting ``v = noise - x0`` at noise level ``sigma`` in [0, 1]
    (``x_sigma = (1 - sigma) * x0 + sigma * noise``), ``decode(latents)`` to pixels in [0, 1], and the
    reference policy ``adapter_disabled()``. ``save_adapter`` writes the LoRA in the format the family's
    own diffusers pipeline reads with ``load_lora_weights``.

    Args:
        pipeline_path: Local diffusers pipeline folder (the one holding ``model_index.json``).
        lora_rank: LoRA rank ``r`` (>= 1).
        lora_alpha: LoRA scaling numerator; the adapter output is scaled by ``lora_alpha / lora_rank``.
        lora_target_modules: Module names (suffixes) that get LoRA; ``None`` means the family's
            ``default_lora_targets``.
        dtype: Dtype of the frozen base weights (transformer and text encoders): ``bfloat16`` or
            ``float32`` (``float16`` is accepted too); LoRA weights are always float32.
        gradient_checkpointing: Recompute the transformer blocks' activations in the backward pass.
        height: Sample height in pixels; ``None`` means the family default.
        width: Sample width in pixels; ``None`` means the family default.
        num_frames: Video families only: frames per sample in pixel space; ``None`` means the default.
        max_sequence_length: Tokens of the T5-style text encoder (padded and truncated to exactly this);
            ``None`` means the family's pipeline default.
        lora_init: ``gaussian`` or ``default`` (Kaiming-uniform ``A``); both start with ``B = 0``.
        vae_dtype: Dtype of the VAE; ``None`` means ``dtype``. Flow-GRPO decodes FLUX and Wan in float32.
        init_seed: Seed of the LoRA initialization (drawn without disturbing the global RNG).
        vae_slicing: Decode one sample at a time (diffusers' ``enable_slicing``): the decode's peak memory
            no longer grows with the batch, and a sample's pixels cannot depend on its batch.
        vae_tiling: Decode in overlapping spatial tiles (diffusers' ``enable_tiling``) for large sizes.
        finetune: ``lora`` trains the adapter on the frozen transformer (the reference is the adapter
            bypassed); ``full`` trains every transformer weight in float32 against a frozen copy of the
            initial weights as the KL reference (the LoRA arguments are then unused), as PromptRL trains
            FLUX; ``export`` then writes a whole pipeline folder.
    """

    family: ClassVar[str]
    pipeline_class: ClassVar[type[DiffusionPipeline]]
    transformer_class: ClassVar[type[ModelMixin]]
    vae_class: ClassVar[type[ModelMixin]]
    default_lora_targets: ClassVar[tuple[str, ...]]
    default_size: ClassVar[tuple[int, int, int]]  # (height, width, num_frames) in pixels
    default_max_sequence_length: ClassVar[int]
    # Editing: a family that conditions on a source image per sample sets ``takes_source_images`` and implements
    # ``_encode_source``; one whose text encoder also reads that image (Qwen-Image-Edit's VL encoder) sets
    # ``text_sees_source`` and implements ``_encode_with_images``.
    takes_source_images: ClassVar[bool] = False
    text_sees_source: ClassVar[bool] = False

    def __init__(
        self,
        pipeline_path: str | None = None,
        lora_rank: int = 32,
        lora_alpha: float = 64.0,
        lora_target_modules: list[str] | None = None,
        dtype: str = "bfloat16",
        gradient_checkpointing: bool = False,
        height: int | None = None,
        width: int | None = None,
        num_frames: int | None = None,
        max_sequence_length: int | None = None,
        lora_init: str = "gaussian",
        vae_dtype: str | None = None,
        init_seed: int = 0,
        vae_slicing: bool = False,
        vae_tiling: bool = False,
        finetune: str = "lora",
    ) -> None:
        super().__init__()
        self.finetune = check_finetune(finetune, type(self).__name__)
        check_lora_args(lora_rank, lora_alpha, lora_target_modules)
        if lora_init not in LORA_INITS:
            raise ValueError(f"lora_init must be one of {sorted(LORA_INITS)}, got {lora_init!r}")
        default_height, default_width, default_frames = self.default_size
        # ``is None`` rather than ``or``: an explicit 0 must reach the positivity check, not the default.
        height = default_height if height is None else height
        width = default_width if width is None else width
        num_frames = default_frames if num_frames is None else num_frames
        if not self.is_video and num_frames != 1:
            raise ValueError(f"num_frames must be 1 (or null) for the image family {self.family!r}, got {num_frames}")
        if max_sequence_length is None:
            max_sequence_length = self.default_max_sequence_length
        check_positive(
            height=height,
            width=width,
            num_frames=num_frames,
            max_sequence_length=max_sequence_length,
        )
        # May come later from the trainer's ``model.pipeline_path``; nothing reads it before ``build()``.
        self.pipeline_path = str(pipeline_path) if pipeline_path else None
        self.lora_rank = lora_rank
        self.lora_alpha = lora_alpha
        self.lora_target_modules = list(lora_target_modules or self.default_lora_targets)
        self.dtype = resolve_dtype(dtype)
        self.vae_dtype = resolve_dtype(vae_dtype) if vae_dtype else self.dtype
        self.gradient_checkpointing = gradient_checkpointing
        self.height, self.width, self.num_frames = height, width, num_frames
        self.max_sequence_length = max_sequence_length
        self.lora_init = lora_init
        self.init_seed = init_seed
        self.vae_slicing, self.vae_tiling = vae_slicing, vae_tiling
        self.model: ModelMixin | None = None
        self.vae: ModelMixin | None = None
        self._latent_shape: tuple[int, ...] | None = None
        self._schedules: dict[tuple[int, float | None], Schedule] = {}

    # ------------------------------------------------------------------ family hooks

    @abstractmethod
    def _compute_latent_shape(self) -> tuple[int, ...]:
        """Per-sample latent shape from the folder's configs; raise ``ValueError`` naming the size
        argument that does not fit the VAE/patch grid."""

    @abstractmethod
    def _load_text(self, index: dict[str, Any]) -> None:
        """Load the family's tokenizers and frozen text encoders from the pipeline folder."""

    @abstractmethod
    def _encode(self, texts: list[str]) -> Cond:
        """Encode ``texts`` (called without gradients); any float dtype, ``encode`` casts to float32."""

    @abstractmethod
    def _forward(self, transformer: ModelMixin, latents: torch.Tensor, sigma: torch.Tensor, cond: Cond) -> torch.Tensor:
        """Run ``transformer`` on ``latents`` (already in its dtype) at float32 ``sigma`` (B,) with
        ``cond`` (in its dtype) and return the velocity in the shape of ``latents``."""

    @abstractmethod
    def _decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Decode VAE-dtype latents to pixels in [-1, 1] in the final layout (images (N, 3, H, W),
        videos (N, F, 3, H, W))."""

    def _encode_source(self, images: list[torch.Tensor]) -> Cond:
        """The source images' own conditioning (editing families): named tensors, batch first, whose keys differ
        from ``_encode``'s; each image is float32 (3, H, W) in [0, 1] of any size and is prepared alone."""
        raise NotImplementedError(f"{type(self).__name__} does not take source images")

    def _encode_with_images(self, texts: list[str], images: list[torch.Tensor]) -> Cond:
        """Text features of a family whose text encoder reads the source image too (``text_sees_source``)."""
        raise NotImplementedError(f"{type(self).__name__}'s text encoder does not read source images")

    def _check_index(self, index: dict[str, Any]) -> None:
        """Reject pipeline variants this generator does not support (before anything is loaded)."""

    def _schedule_kwargs(self, num_steps: int, scheduler_config: dict[str, Any]) -> dict[str, Any]:
        """The extra ``set_timesteps`` arguments the family's pipeline passes (``sigmas``, ``mu``) for
        ``num_steps`` at this generator's sample size; none by default."""
        return {}

    # ------------------------------------------------------------------ the schedule

    def schedule(self, num_steps: int, shift: float | None = None) -> Schedule:
        """The ``num_steps`` sigmas the family's diffusers pipeline samples with at this sample size, from
        the folder's own scheduler config (works before ``build()``); see :mod:`unirl_pl.generators.schedule`.
        ``shift`` (a ``rollout.shift`` override): the same scheduler with that shift in place of its own."""
        key = (num_steps, None if shift is None else float(shift))
        cached = self._schedules.get(key)
        if cached is None:
            label = str(self.pipeline_path)
            cached = pipeline_schedule(self._folder(), num_steps, self._schedule_kwargs, label, shift=key[1])
            self._schedules[key] = cached
        return cached

    # ------------------------------------------------------------------ loading

    has_vae = True

    @property
    def expert(self) -> FlowGenerator:
        """The trainable part (card component ``transformer``): the generator itself, whose ``model`` is the
        LoRA-adapted transformer."""
        return self

    def _folder(self) -> str:
        if not self.pipeline_path:
            raise ValueError(
                f"{type(self).__name__} needs a diffusers pipeline folder: set model.pipeline_path=PATH "
                "(or the generator's pipeline_path)"
            )
        return self.pipeline_path

    @property
    def is_video(self) -> bool:
        """Whether samples are videos: latents (C, F, H, W) and decoded (F, 3, H, W)."""
        return False

    @property
    def is_built(self) -> bool:
        """Whether ``build()`` has loaded the components."""
        return self.model is not None

    def read_config(self, subfolder: str) -> dict[str, Any]:
        """The ``config.json`` of one component folder of the pipeline (works before ``build()``)."""
        file = Path(self._folder()) / subfolder / "config.json"
        if not file.is_file():
            raise FileNotFoundError(f"{str(file)!r} is missing: the pipeline folder has no {subfolder!r} component")
        return read_json_file(file)

    @property
    def latent_shape(self) -> tuple[int, ...]:
        """Per-sample latent shape, no batch dim: ``(C, H, W)`` for images, ``(C, F, H, W)`` for video,
        from the sample size in pixels and the folder's VAE and transformer configs."""
        if self._latent_shape is None:
            read_model_index(self._folder())
            self._latent_shape = self._compute_latent_shape()
        return self._latent_shape

    def _load(self, cls: type, subfolder: str, dtype: torch.dtype) -> Any:
        """``cls.from_pretrained`` of one component folder in ``dtype`` (diffusers and transformers
        spell the dtype argument differently); ``torch_dtype`` rather than ``.to`` keeps the modules a
        model pins to float32 in float32."""
        key = "torch_dtype" if issubclass(cls, ModelMixin) else "dtype"
        return cls.from_pretrained(self.pipeline_path, subfolder=subfolder, **{key: dtype})

    def _load_frozen(self, cls: type, subfolder: str, dtype: torch.dtype | None = None) -> torch.nn.Module:
        return freeze(self._load(cls, subfolder, dtype or self.dtype))

    def _load_tokenizer(self, subfolder: str) -> PreTrainedTokenizerBase:
        return AutoTokenizer.from_pretrained(self.pipeline_path, subfolder=subfolder)

    def lora_config(self) -> LoraConfig:
        """The peft ``LoraConfig`` of the transformer's adapter (peft's defaults ``lora_dropout=0`` and
        ``bias="none"`` keep it deterministic and bias-free)."""
        init, targets = LORA_INITS[self.lora_init], self.lora_target_modules
        return LoraConfig(r=self.lora_rank, lora_alpha=self.lora_alpha, target_modules=targets, init_lora_weights=init)

    def build(self) -> None:
        """Load every component from the pipeline folder and attach the LoRA adapter; idempotent.

        Raises ``FileNotFoundError`` for a missing folder or index, ``ValueError`` when the folder holds
        another pipeline class or the sample size does not fit the latent grid, ``NotImplementedError``
        for unsupported variants of the family.
        """
        if self.is_built:
            return
        index = read_model_index(self._folder())
        expected = self.pipeline_class.__name__
        if index.get("_class_name") != expected:
            raise ValueError(
                f"{self.pipeline_path!r} holds a {index.get('_class_name')!r}, but {type(self).__name__} loads "
                f"{expected} folders (use unirl_pl.generators.load_generator to pick the class)"
            )
        self._check_index(index)
        self.latent_shape  # noqa: B018 - validates height/width/num_frames before the slow loading
        # Pinned to CPU and float32 defaults even inside a meta/cuda device context (Lightning's
        # configure_model), and the LoRA init draws from a fixed seed without moving the caller's RNG.
        with seeded_cpu_init(self.init_seed):
            self._load_text(index)
            self.vae = self._load_frozen(self.vae_class, "vae", self.vae_dtype)
            model = self._adapt(self._load(self.transformer_class, "transformer", self.dtype))
        if self.gradient_checkpointing:
            model.enable_gradient_checkpointing()
        if self.vae_slicing:
            self.vae.enable_slicing()
        if self.vae_tiling:
            self.vae.enable_tiling()
        self.model = model

    def _adapt(self, model: ModelMixin) -> ModelMixin:
        """The transformer made trainable as ``finetune`` says (:func:`unirl_pl.experts.finetune.adapt`)."""
        return adapt(self, model, lambda base: attach_diffusers_lora(base, self.lora_config()))

    def _require_built(self) -> ModelMixin:
        if self.model is None:
            raise RuntimeError(f"{type(self).__name__}.build() must be called before using the generator")
        return self.model

    def train(self, mode: bool = True) -> FlowGenerator:
        """Switch the transformer to ``mode`` but keep every frozen component in eval mode."""
        super().train(mode)
        for child in self.children():
            if child is not self.model:
                child.eval()
        return self

    # ------------------------------------------------------------------ the generator surface

    @staticmethod
    def _token_ids(
        tokenizer: PreTrainedTokenizerBase, texts: list[str], max_length: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids and attention mask (B, max_length): truncated and right-padded to exactly
        ``max_length`` as the diffusers pipelines do, so a row never depends on the rest of the batch."""
        batch = tokenizer(texts, padding="max_length", max_length=max_length, truncation=True, return_tensors="pt")
        return batch.input_ids.to(device), batch.attention_mask.to(device)

    def _clip_output(self, tokenizer: PreTrainedTokenizerBase, encoder: torch.nn.Module, texts: list[str]) -> Any:
        """CLIP text model output with all hidden states, on prompts padded to CLIP's context length
        (``tokenizer.model_max_length``, 77 for the real models) and no attention mask, as diffusers does."""
        length = min(tokenizer.model_max_length, encoder.config.max_position_embeddings)
        ids, _ = self._token_ids(tokenizer, texts, length, encoder.device)
        return encoder(ids, output_hidden_states=True)

    def _t5_states(
        self, tokenizer: PreTrainedTokenizerBase, encoder: torch.nn.Module, texts: list[str], masked: bool = False
    ) -> torch.Tensor:
        """Last hidden states (B, max_sequence_length, D) of a T5-style encoder. ``masked`` passes the
        attention mask and zeroes the padding positions (Wan); otherwise the padding is attended to and
        kept (SD3, FLUX), each as the family's pipeline does."""
        ids, mask = self._token_ids(tokenizer, texts, self.max_sequence_length, encoder.device)
        if not masked:
            return encoder(ids).last_hidden_state
        states = encoder(ids, attention_mask=mask).last_hidden_state
        return states * mask.unsqueeze(-1).to(states.dtype)

    def encode(self, texts: list[str], images: list[torch.Tensor] | None = None) -> Cond:
        """Encode ``texts`` through the pipeline's own tokenizers and text encoders, without gradients,
        to float32 tensors of fixed shapes (padded to the maximum lengths), so a text's row is the same
        whatever else is in the batch. ``images`` (one source image per text) only for a family whose text
        encoder reads the source image (``text_sees_source``); the image latents come from ``encode_source``."""
        self._require_built()
        if isinstance(texts, str) or not texts:
            raise ValueError("texts must be a non-empty list of strings")
        if images is not None and not self.text_sees_source:
            raise ValueError(f"{type(self).__name__}'s text encoder does not read source images")
        with torch.no_grad():
            if images is None:
                cond = self._encode(list(texts))
            else:
                cond = self._encode_with_images(list(texts), check_images(images, len(texts)))
        return {key: value.float() for key, value in cond.items()}

    def encode_source(self, images: list[torch.Tensor]) -> Cond:
        """The conditioning an editing family takes from each sample's source image (float32 (3, H, W) in [0, 1],
        any size: the family resizes each alone), without gradients, as float32 tensors merged into the text
        features' ``Cond``. ``ValueError`` for a family that does not edit."""
        self._require_built()
        if not self.takes_source_images:
            raise ValueError(
                f"{type(self).__name__} ({self.family}) generates from text alone and takes no source image; "
                "an editing run needs an editing family (FLUX.1 Kontext, Qwen-Image-Edit-Plus, FLUX.2 [klein])"
            )
        with torch.no_grad():
            cond = self._encode_source(check_images(images, None))
        return {key: value.float() for key, value in cond.items()}

    def velocity(self, latents: torch.Tensor, sigma: torch.Tensor | float, cond: Cond) -> torch.Tensor:
        """Flow velocity ``v = noise - x0`` (float32, shape of ``latents``) of the LoRA-adapted model for
        ``latents`` (B, *latent_shape) at noise level ``sigma`` (B,) or a scalar in [0, 1], given
        ``cond`` from ``encode``. Inputs are cast to the model dtype; no operation mixes samples."""
        return self.velocity_of(self._require_built(), latents, sigma, cond)

    def velocity_of(
        self, transformer: ModelMixin, latents: torch.Tensor, sigma: torch.Tensor | float, cond: Cond
    ) -> torch.Tensor:
        """``velocity`` through another transformer of the same family (e.g. the one of a diffusers
        pipeline that loaded the exported adapter), with exactly the same input conventions."""
        batch = latents.shape[0]
        if tuple(latents.shape[1:]) != self.latent_shape:
            raise ValueError(f"latents must be (B, *{self.latent_shape}), got {tuple(latents.shape)}")
        sigma = torch.as_tensor(sigma, dtype=torch.float32, device=latents.device)
        if sigma.numel() == 1:
            sigma = sigma.reshape(1).expand(batch)
        if tuple(sigma.shape) != (batch,):
            raise ValueError(f"sigma must be a scalar or of shape ({batch},), got {tuple(sigma.shape)}")
        dtype = transformer.dtype
        cond = {key: value.to(dtype) for key, value in cond.items()}
        return self._forward(transformer, latents.to(dtype), sigma, cond).float()

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Decode latents (N, *latent_shape) to float32 pixels in [0, 1], without gradients: images
        (N, 3, H, W), videos (N, F, 3, H, W), undoing the family's latent scaling first."""
        self._require_built()
        with torch.no_grad():
            pixels = self._decode(latents.to(self.vae.dtype))
        return ((pixels.float() + 1.0) / 2.0).clamp(0.0, 1.0)
