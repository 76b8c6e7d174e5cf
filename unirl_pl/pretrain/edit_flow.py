"""Rectified-flow pretraining of the ShapesWorld-Edit DiT: the scene DiT taught to edit a source in context."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from diffusers import SD3Transformer2DModel
from torch import Tensor

from unirl_pl.experts._common import seeded_cpu_init
from unirl_pl.experts.dit import FlowTransformerExpert
from unirl_pl.experts.text_encoder import TextEncoderExpert
from unirl_pl.generators.in_context import SOURCE_KEY, InContextEditGenerator
from unirl_pl.lazy_defaults import lazy_default
from unirl_pl.loops import DiffusionDenoise, RolloutConfig
from unirl_pl.manifest import verify_assets
from unirl_pl.pretrain.common import build_text_encoder
from unirl_pl.pretrain.flow import FlowMatchingPretrain
from unirl_pl.shapes.edit_verify import edit_breakdown
from unirl_pl.shapes.edits import edit_of


class EditFlowPretrain(FlowMatchingPretrain):
    """``FlowMatchingPretrain`` on (source, canonical instruction, target) triples (``EditDataModule``): the DiT
    reads the clean source beside the noisy target (``FlowTransformerExpert.velocity`` with ``source``) and the
    loss is the target half's. Validation samples held-out edits on the RL serve path with their sources and logs
    the ShapesWorld-Edit verifier's strict and soft scores per kind (``val/strict/<kind>``).

    Everything trains in full, as the scene DiT did. ``init_transformer_path`` warm-starts the DiT from a pretrained
    pixel-space folder (the shipped scene DiT), whose ``pos_embed_max_size`` must cover twice the width; the text
    encoder warm-starts through its own ``pretrained_path`` and gains the instruction words
    (``build_text_encoder(vocabulary="edits")``).

    Args:
        transformer: Describes the DiT built when ``init_transformer_path`` is None (tiny-model fields only).
        text_encoder: The text encoder (a ``pretrained_path`` warm-starts it).
        init_transformer_path: Folder of a pretrained ``SD3Transformer2DModel`` to start the DiT from (None: fresh);
            like every ``*_path`` key of a recipe it resolves from the recipe's folder or the package.
        **kwargs: ``FlowMatchingPretrain``'s other arguments.
    """

    def __init__(
        self,
        transformer: FlowTransformerExpert = lazy_default(FlowTransformerExpert),
        text_encoder: TextEncoderExpert = lazy_default(TextEncoderExpert),
        init_transformer_path: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(transformer, text_encoder, **kwargs)
        self.init_transformer_path = init_transformer_path

    def configure_model(self) -> None:
        if self.transformer.model is not None:
            return
        build_text_encoder(self.text_encoder, vocabulary="edits")
        if self.train_text_encoder:
            self.text_encoder.model.requires_grad_(True)
        if self.init_transformer_path is None:
            with seeded_cpu_init(self.transformer.init_seed):
                self.transformer.model = SD3Transformer2DModel(**self.transformer.tiny_config())
            return
        folder = Path(self.init_transformer_path)
        verify_assets(folder, component=type(self).__name__)  # a shipped folder is checked against its manifest
        model = SD3Transformer2DModel.from_pretrained(str(folder))
        model.requires_grad_(True)
        self.transformer.model = model.float()

    def _generator(self) -> InContextEditGenerator:
        return InContextEditGenerator(self.transformer, self.text_encoder, vae=None)

    @torch.no_grad()
    def sample_edits(self, prompts: list[str], sources: Tensor, seed: int = 0) -> Tensor:
        """Edited images (N, 3, H, W) in [0, 1] of ``sources`` (N, 3, H, W) in [-1, 1] by the RL serve path's ODE."""
        generator = self._generator()
        loop = DiffusionDenoise(generator, RolloutConfig(num_steps=self.val_num_steps, shift=self.shift))
        hidden, pooled = self.encode(prompts)
        n = len(prompts)
        cond = {"hidden": hidden, "pooled": pooled, SOURCE_KEY: sources.to(self.device)}
        x, _ = loop.sample(cond, list(range(n)), [0] * n, "serve", seed=seed)
        return generator.decode(x)

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        with self.averaged_weights():
            images = self.sample_edits(batch["captions"], batch["sources"])
        edits = [edit_of(row) for row in batch["rows"]]
        pixels = images.permute(0, 2, 3, 1).cpu().numpy().astype(np.float32)
        for key, (value, count) in edit_breakdown(edits, pixels).items():
            if count:
                self.log(f"val/{key}", value, batch_size=count)
