"""Wan2.1 / Wan2.2 text-to-video as a ``FlowGenerator``: UMT5 tokens condition a 3D DiT over a causal
3D VAE's latents. A Wan2.2 A14B folder holds two such DiTs, a high-noise ``transformer`` and a
low-noise ``transformer_2``, switched at ``boundary_ratio`` as ``WanPipeline`` does; both are trained,
each with its own LoRA, as the one trainable component ``transformer``."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import torch
from diffusers import AutoencoderKLWan, ModelMixin, WanPipeline, WanTransformer3DModel
from diffusers.pipelines.wan.pipeline_wan import prompt_clean
from peft.utils import get_peft_model_state_dict
from transformers import UMT5EncoderModel

from unirl_pl.experts._common import seeded_cpu_init
from unirl_pl.experts.base import adapter_bypassed, attach_diffusers_lora
from unirl_pl.generators.base import Cond, FlowGenerator
from unirl_pl.generators.folder import has_component, read_model_index
from unirl_pl.lora import LORA_WEIGHTS_FILE, load_lora_file
from unirl_pl.paths import read_json_file
from unirl_pl.records import cond_rows

LOW_NOISE_SUBFOLDER = "transformer_2"
"""Where ``save_adapter`` puts the low-noise expert's LoRA, inside the component's adapter folder."""
HIGH_NOISE, LOW_NOISE = 0, 1
"""``expert_index`` values: the high-noise ``transformer`` and the low-noise ``transformer_2``."""


def expert_for_sigma(sigma: torch.Tensor, boundary_ratio: float | None, num_train_timesteps: int) -> torch.Tensor:
    """Which Wan2.2 expert denoises at each noise level ``sigma`` (any shape): ``0`` (``HIGH_NOISE``,
    ``transformer``) where the timestep ``sigma * num_train_timesteps`` is at or above
    ``boundary_ratio * num_train_timesteps``, ``1`` (``LOW_NOISE``, ``transformer_2``) below, as
    ``WanPipeline.__call__`` compares them; all zeros for a one-transformer folder (``boundary_ratio`` None).
    The comparison runs in float64 on the continuous timestep; UniPC floors its timesteps to integers,
    which selects the same expert whenever the boundary timestep is an integer (875 for T2V-A14B)."""
    sigma = torch.as_tensor(sigma)
    if boundary_ratio is None:
        return torch.zeros(sigma.shape, dtype=torch.long, device=sigma.device)
    timestep = sigma.to(torch.float64) * num_train_timesteps
    return (timestep < boundary_ratio * num_train_timesteps).long()


class WanGenerator(FlowGenerator):
    """Wan2.1 / Wan2.2 T2V from a ``WanPipeline`` folder, with one transformer or Wan2.2 A14B's two.

    Latents are ``(C, F, H, W)`` with ``F = (num_frames - 1) // scale_factor_temporal + 1`` and
    ``H, W = height, width // scale_factor_spatial`` (the VAE config's factors); ``decode`` returns
    ``(N, num_frames, 3, height, width)``, undoing the VAE's ``latents_mean``/``latents_std`` first.
    Conditioning matches ``WanPipeline.encode_prompt``: ``hidden`` (B, max_sequence_length, D) is the
    UMT5 states of the cleaned prompt with the padding positions zeroed. The transformer takes
    ``timestep = sigma * 1000``, per token when the folder sets ``expand_timesteps`` (Wan2.2 TI2V-5B).

    A Wan2.2 A14B folder (``transformer_2`` and ``boundary_ratio`` in ``model_index.json``) loads both
    experts, each with its own LoRA of the same settings: ``model`` (high noise) and ``model_2`` (low
    noise). ``velocity`` sends every row to the expert its sigma selects (``expert_index``), so a record's
    sigmas say which expert produced each step, and the training recompute of a step runs the same rows
    through the same expert as rollout. Both adapters are this generator's parameters (one optimizer, one
    weight version: the card's component ``transformer``); ``adapter_disabled`` bypasses both.
    Constructor arguments are those of ``FlowGenerator`` (defaults 480x832 pixels, 81 frames,
    ``max_sequence_length`` 512).
    """

    family = "wan"
    pipeline_class = WanPipeline
    transformer_class = WanTransformer3DModel
    vae_class = AutoencoderKLWan
    # Self- and cross-attention projections of every block.
    default_lora_targets = ("to_q", "to_k", "to_v", "to_out.0")
    default_size = (480, 832, 81)
    default_max_sequence_length = 512

    @property
    def is_video(self) -> bool:
        """Always true: samples are videos."""
        return True

    # ------------------------------------------------------------------ the two experts

    def _experts_config(self) -> tuple[float | None, int, bool]:
        """``(boundary_ratio, num_train_timesteps, expand_timesteps)`` of the folder, read once (works before
        ``build()``, and on ``plan``'s fake generator, which never builds); a two-expert folder must name both its
        transformer_2 and its boundary_ratio."""
        cached = self.__dict__.get("_experts_cache")
        if cached is None:
            index = read_model_index(self._folder())
            ratio, second = index.get("boundary_ratio"), has_component(index, LOW_NOISE_SUBFOLDER)
            if not has_component(index, "transformer"):
                raise NotImplementedError(
                    f"{self.pipeline_path!r} has no high-noise transformer; WanGenerator needs model_index.json "
                    "to name transformer (and, for Wan2.2 A14B, transformer_2 with boundary_ratio)"
                )
            if second != (ratio is not None):
                found = (
                    "transformer_2 but no boundary_ratio" if second else f"boundary_ratio {ratio} but no transformer_2"
                )
                raise ValueError(
                    f"{self.pipeline_path!r}: model_index.json has {found}; WanPipeline needs both to switch "
                    "experts (transformer at and above the boundary, transformer_2 below)"
                )
            if ratio is not None and not 0.0 < float(ratio) < 1.0:
                raise ValueError(f"{self.pipeline_path!r}: boundary_ratio must be in (0, 1), got {ratio}")
            file = Path(self._folder()) / "scheduler" / "scheduler_config.json"
            config = read_json_file(file) if file.is_file() else {}
            expand = bool(index.get("expand_timesteps", False))
            cached = (None if ratio is None else float(ratio), int(config.get("num_train_timesteps", 1000)), expand)
            self.__dict__["_experts_cache"] = cached
        return cached

    @property
    def boundary_ratio(self) -> float | None:
        """The folder's ``boundary_ratio`` (Wan2.2 A14B: 0.875 for T2V), ``None`` for one transformer."""
        return self._experts_config()[0]

    @property
    def num_experts(self) -> int:
        """2 for a Wan2.2 A14B folder (``transformer`` + ``transformer_2``), else 1."""
        return 1 if self.boundary_ratio is None else 2

    def expert_index(self, sigma: torch.Tensor | float) -> torch.Tensor:
        """Which expert ``velocity`` runs at each noise level in ``sigma`` (any shape, e.g. a record's
        ``sigma`` (S,) or (N, S)): ``HIGH_NOISE`` (0, ``transformer``) or ``LOW_NOISE`` (1,
        ``transformer_2``); all zeros for a one-transformer folder."""
        ratio, timesteps, _ = self._experts_config()
        return expert_for_sigma(torch.as_tensor(sigma), ratio, timesteps)

    @property
    def model_2(self) -> ModelMixin | None:
        """The low-noise expert ``transformer_2`` with its LoRA (Wan2.2 A14B), ``None`` otherwise or
        before ``build()``."""
        return self._modules.get("model_2")

    @property
    def transformers(self) -> list[ModelMixin]:
        """The built transformers, high-noise first: what FSDP shards and the adapter export writes."""
        return [m for m in (self.model, self.model_2) if m is not None]

    @property
    def expand_timesteps(self) -> bool:
        """The folder's ``expand_timesteps`` (Wan2.2 TI2V-5B): the transformer then takes one timestep per latent
        token, shape (N, tokens), as ``WanPipeline.__call__`` builds it, rather than one per sample."""
        return self._experts_config()[2]

    def _check_index(self, index: dict[str, Any]) -> None:
        self._experts_config()

    def build(self) -> None:
        """Load the components as ``FlowGenerator.build`` does; a two-expert folder also loads
        ``transformer_2`` with its own LoRA (same settings, its init drawn from ``init_seed + 1``)."""
        if self.is_built:
            return
        if self.num_experts > 1 and self.finetune == "full":
            # Two 14B experts fully trained, each with a frozen copy, is not a setting any reference runs.
            raise ValueError(
                f"{type(self).__name__}.finetune 'full' is not supported for two-expert Wan2.2 folders; use 'lora'"
            )
        super().build()
        if self.num_experts == 1:
            return
        with seeded_cpu_init(self.init_seed + 1):
            model_2 = attach_diffusers_lora(
                self._load(self.transformer_class, LOW_NOISE_SUBFOLDER, self.dtype), self.lora_config()
            )
        if self.gradient_checkpointing:
            model_2.enable_gradient_checkpointing()
        model_2.train(self.model.training)
        # Registered as a child (parameters, state_dict, FSDP) behind the read-only ``model_2`` property.
        self._modules["model_2"] = model_2

    def train(self, mode: bool = True) -> WanGenerator:
        """Switch both transformers to ``mode``; every frozen component stays in eval mode."""
        super().train(mode)
        if self.model_2 is not None:
            self.model_2.train(mode)
        return self

    def velocity(self, latents: torch.Tensor, sigma: torch.Tensor | float, cond: Cond) -> torch.Tensor:
        """``FlowGenerator.velocity`` with each row run by the expert its sigma selects: a batch on one
        side of the boundary goes through that expert whole; a mixed batch (per-sample sigmas) is split,
        each expert runs its rows in their original order, and the outputs are put back in place."""
        model = self._require_built()
        if self.model_2 is None:
            return self.velocity_of(model, latents, sigma, cond)
        sigma = torch.as_tensor(sigma, dtype=torch.float32, device=latents.device)
        if sigma.numel() == 1:
            sigma = sigma.reshape(1).expand(latents.shape[0])
        low = self.expert_index(sigma).bool()
        if not bool(low.any()):
            return self.velocity_of(model, latents, sigma, cond)
        if bool(low.all()):
            return self.velocity_of(self.model_2, latents, sigma, cond)
        out = torch.zeros(latents.shape, dtype=torch.float32, device=latents.device)
        for expert, rows in ((model, (~low).nonzero().squeeze(1)), (self.model_2, low.nonzero().squeeze(1))):
            part = self.velocity_of(expert, latents.index_select(0, rows), sigma[rows], cond_rows(cond, rows))
            out = out.index_copy(0, rows, part)  # out of place: the gradient flows to each expert's rows
        return out

    @contextmanager
    def adapter_disabled(self) -> Iterator[None]:
        """Context in which ``velocity`` is the frozen reference policy: both experts' LoRA bypassed."""
        with ExitStack() as stack:
            stack.enter_context(super().adapter_disabled())
            if self.model_2 is not None:
                stack.enter_context(adapter_bypassed(self.model_2))
            yield

    def save_adapter(self, path: str) -> None:
        """Write the high-noise adapter as ``path/pytorch_lora_weights.safetensors`` and, for two
        experts, the low-noise one as ``path/transformer_2/pytorch_lora_weights.safetensors``, both in
        ``WanPipeline.save_lora_weights``' format: ``pipe.load_lora_weights(path)`` and
        ``pipe.load_lora_weights(path + "/transformer_2", load_into_transformer_2=True)`` read them."""
        super().save_adapter(path)
        if self.model_2 is not None:
            self.pipeline_class.save_lora_weights(
                str(Path(path) / LOW_NOISE_SUBFOLDER),
                transformer_lora_layers=get_peft_model_state_dict(self.model_2),
                transformer_lora_adapter_metadata=self.model_2.peft_config["default"].to_dict(),
            )

    def load_adapter(self, path: str) -> None:
        """Load adapters written by ``save_adapter`` (the folder) into both experts in place, raising
        ``ValueError`` when they do not match (a one-expert adapter folder for a two-expert model too)."""
        super().load_adapter(path)
        if self.model_2 is not None:
            folder = Path(path) if Path(path).is_dir() else Path(path).parent
            file = folder / LOW_NOISE_SUBFOLDER / LORA_WEIGHTS_FILE
            if not file.is_file():
                raise ValueError(
                    f"{str(file)!r} is missing: the adapter folder has no low-noise expert (transformer_2)"
                )
            load_lora_file(self.model_2, file, WanPipeline.transformer_name)

    # ------------------------------------------------------------------ family hooks

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
