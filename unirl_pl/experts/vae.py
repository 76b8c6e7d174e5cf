"""The frozen image autoencoder: a ``diffusers`` ``AutoencoderKL``."""

from __future__ import annotations

from contextlib import nullcontext

import torch
from diffusers import AutoencoderKL

from unirl_pl.experts._common import check_positive, freeze, seeded_cpu_init
from unirl_pl.experts.base import FrozenExpert


class VAEExpert(FrozenExpert):
    """Frozen VAE mapping between generator latents and images in [0, 1].

    The constructor only records and validates its arguments; ``build()`` creates a tiny
    ``AutoencoderKL`` initialized from ``init_seed`` without touching the global RNG, or loads one with
    ``AutoencoderKL.from_pretrained(path, subfolder=...)`` (``subfolder="vae"`` for a diffusers pipeline
    folder). Latents are in the generator's space: ``encode`` returns ``(mean - shift) * scale`` and
    ``decode`` undoes it, using the checkpoint's ``scaling_factor`` and ``shift_factor``. The model has
    no trainable weights and stays in eval mode even when its parent is put in train mode.

    Args:
        pretrained_path: Local folder or hub id holding the VAE; ``None`` builds the tiny model.
        subfolder: Subfolder of ``pretrained_path`` with the VAE (``"vae"`` in a pipeline folder);
            ``None`` means the path itself.
        latent_channels: Tiny model only: channels of the latent (the DiT's ``in_channels``).
        block_out_channels: Tiny model only: channels per resolution level, default ``[32, 32]``; each
            level after the first halves the resolution.
        layers_per_block: Tiny model only: ResNet layers per level.
        norm_num_groups: Tiny model only: GroupNorm groups; must divide every ``block_out_channels``.
        init_seed: Seed of the tiny model's weights.
        dtype: Dtype of the weights: ``float32``, ``bfloat16`` or ``float16``.
    """

    unbuilt_use = "encoding or decoding"

    def __init__(
        self,
        pretrained_path: str | None = None,
        subfolder: str | None = None,
        latent_channels: int = 4,
        block_out_channels: list[int] | None = None,
        layers_per_block: int = 1,
        norm_num_groups: int = 8,
        init_seed: int = 2,
        dtype: str = "float32",
    ) -> None:
        super().__init__(pretrained_path, dtype, init_seed)
        block_out_channels = list(block_out_channels or [32, 32])
        check_positive(
            latent_channels=latent_channels,
            layers_per_block=layers_per_block,
            norm_num_groups=norm_num_groups,
            **{f"block_out_channels[{i}]": c for i, c in enumerate(block_out_channels)},
        )
        if any(c % norm_num_groups for c in block_out_channels):
            raise ValueError(
                f"norm_num_groups ({norm_num_groups}) must divide every entry of "
                f"block_out_channels {block_out_channels}"
            )
        self.subfolder = subfolder
        self._latent_channels, self.block_out_channels = latent_channels, block_out_channels
        self.layers_per_block, self.norm_num_groups = layers_per_block, norm_num_groups
        self.model: AutoencoderKL | None = None

    def tiny_config(self) -> dict[str, object]:
        """Keyword arguments of the tiny ``AutoencoderKL`` this expert builds without a path."""
        levels = len(self.block_out_channels)
        return {
            "in_channels": 3,
            "out_channels": 3,
            "down_block_types": ["DownEncoderBlock2D"] * levels,
            "up_block_types": ["UpDecoderBlock2D"] * levels,
            "block_out_channels": self.block_out_channels,
            "layers_per_block": self.layers_per_block,
            "latent_channels": self._latent_channels,
            "norm_num_groups": self.norm_num_groups,
            # A random VAE has no calibrated latent scale; 1.0 keeps latents and the flow prior's N(0, 1)
            # noise on the same footing.
            "scaling_factor": 1.0,
        }

    def build(self) -> None:
        """Create the frozen model; a second call is a no-op."""
        if self.is_built:
            return
        # Only the tiny model is built inside ``seeded_cpu_init``; a checkpoint loads as is.
        with seeded_cpu_init(self.init_seed) if self.pretrained_path is None else nullcontext():
            self.model = freeze(self._diffusers_model(AutoencoderKL))

    def _scale_shift(self) -> tuple[float, float]:
        config = self._require_built().config
        return float(config.scaling_factor), float(config.shift_factor or 0.0)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Decode generator latents (B, C, h, w) to float32 images (B, 3, h * f, w * f) in [0, 1], where f
        is ``downsample_factor``."""
        model = self._require_built()
        scale, shift = self._scale_shift()
        images = model.decode(latents.to(model.dtype) / scale + shift, return_dict=False)[0]
        return ((images.float() + 1.0) / 2.0).clamp(0.0, 1.0)

    @torch.no_grad()
    def encode(self, images: torch.Tensor) -> torch.Tensor:
        """Encode images (B, 3, H, W) in [0, 1] to generator latents: the posterior mean, shifted and
        scaled; float32."""
        model = self._require_built()
        scale, shift = self._scale_shift()
        posterior = model.encode(images.to(model.dtype) * 2.0 - 1.0).latent_dist
        return (posterior.mean.float() - shift) * scale

    def _config_value(self, name: str) -> object:
        if self.model is not None:
            return getattr(self.model.config, name)
        if self.pretrained_path is None:
            return self.tiny_config()[name]
        return AutoencoderKL.load_config(self.pretrained_path, subfolder=self.subfolder)[name]

    @property
    def downsample_factor(self) -> int:
        """Image pixels per latent pixel along each side."""
        return 2 ** (len(self._config_value("block_out_channels")) - 1)

    @property
    def latent_channels(self) -> int:
        """Channels of the latent."""
        return int(self._config_value("latent_channels"))
