"""Rectified-flow pretraining of the pixel-space DiT on rendered ShapesWorld scenes."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from diffusers import SD3Transformer2DModel
from torch import Tensor

from unirl_pl.experts._common import seeded_cpu_init
from unirl_pl.experts.dit import FlowTransformerExpert
from unirl_pl.experts.text_encoder import TextEncoderExpert
from unirl_pl.generators import ComponentGenerator
from unirl_pl.lazy_defaults import lazy_default
from unirl_pl.loops import DiffusionDenoise, RolloutConfig
from unirl_pl.manifest import write_manifest
from unirl_pl.pretrain.common import build_text_encoder, warmup_cosine, weights_sha256
from unirl_pl.rewards.shapes import ShapesGenEval
from unirl_pl.threads import set_threads


def flow_targets(x0: Tensor, noise: Tensor, sigma: Tensor) -> tuple[Tensor, Tensor]:
    """Noisy input ``x_s = (1 - s) x0 + s eps`` and velocity target ``eps - x0`` for sigmas (B,).

    This is the convention ``ode_step`` integrates: sigma runs 1 -> 0 with ``dt < 0`` and
    ``x + dt * v``, so ``v = dx/ds = eps - x0`` carries noise towards data.
    """
    s = sigma.reshape(-1, *([1] * (x0.ndim - 1)))
    return (1 - s) * x0 + s * noise, noise - x0


class FlowMatchingPretrain(pl.LightningModule):
    """Supervised rectified-flow training of the full DiT in pixel space, conditioned on captions.

    The DiT is the tiny ``SD3Transformer2DModel`` that ``transformer`` describes (``in_channels`` 3:
    pixels in [-1, 1]) with every weight trained, no LoRA; by default the text encoder is frozen and its
    features are cached per caption (``train_text_encoder`` trains it jointly instead). Sigmas are
    drawn logit-normal (SD3), which spends the steps on the middle noise levels where layout and color
    are decided. A fraction of captions is replaced by the empty prompt so classifier-free guidance is
    available later. Validation samples held-out prompts with the RL serve path's deterministic
    ``serve`` profile (the RL serve path) and logs the verifier's strict and soft scores per category.
    At fit end both models are saved with ``save_pretrained`` under ``export_dir`` (``transformer/``
    and ``text_encoder/`` with its tokenizer).

    Args:
        transformer: Describes the DiT (only its tiny-model fields are used; LoRA fields are ignored).
        text_encoder: The frozen text encoder (built over the ShapesWorld vocabulary when no path).
        lr: Peak AdamW learning rate.
        weight_decay: AdamW weight decay.
        warmup_steps: Linear warmup steps before the cosine decay.
        lr_floor: Final lr as a fraction of ``lr`` at ``trainer.max_steps``.
        caption_dropout: Probability of training a sample on the empty prompt.
        grad_clip: Max gradient norm (0 disables).
        val_num_steps: Euler steps of the validation sampler.
        num_threads: Torch intra-op threads for this process (None: torch's default). On a CPU shared
            with other jobs, 1 thread avoids OpenMP spin-waiting and ran 4x faster than 2 here.
        export_dir: Folder to write the pretrained models to at fit end (None: no export).
        train_text_encoder: Also train every weight of the text encoder under the flow-matching loss
            (same optimizer and lr; features are then recomputed each step, not cached). The tokenizer
            is unchanged, so the refiner's vocabulary still matches; the exported encoder is loaded
            frozen by RL runs as before.
        shift: SD3 schedule shift of the noise levels: training sigmas are logit-normal draws mapped
            by ``shift * s / (1 + (shift - 1) * s)`` and the validation sampler uses the same shift.
            Above 1 it spends more of both on high noise, where a 32x32 scene's layout is decided;
            RL recipes should sample with the same ``rollout.shift``.
        fingerprint_every: Every this many optimizer steps, record the SHA-256 of the trained weights
            (not the average); the export writes them to ``fingerprints.json``. The learning rate
            of the first ``warmup_steps`` steps does not depend on ``trainer.max_steps``, so a short
            run can check its early fingerprints against a long run's (0 disables).
        ema_decay: Keep an exponential moving average of every trained weight with this decay per
            optimizer step (0 disables), warmed up as ``min(ema_decay, (1 + n) / (10 + n))`` at step
            ``n``. Validation and the export use the averaged weights.
    """

    def __init__(
        self,
        transformer: FlowTransformerExpert = lazy_default(FlowTransformerExpert),
        text_encoder: TextEncoderExpert = lazy_default(TextEncoderExpert),
        lr: float = 6e-4,
        weight_decay: float = 0.0,
        warmup_steps: int = 100,
        lr_floor: float = 0.05,
        caption_dropout: float = 0.1,
        grad_clip: float = 1.0,
        val_num_steps: int = 10,
        num_threads: int | None = None,
        export_dir: str | None = None,
        train_text_encoder: bool = False,
        ema_decay: float = 0.0,
        shift: float = 1.0,
        fingerprint_every: int = 100,
    ) -> None:
        super().__init__()
        if num_threads is not None:
            set_threads(num_threads)
        if transformer.in_channels != 3 or transformer.pretrained_path is not None:
            raise ValueError(
                f"{type(self).__name__} trains a pixel-space DiT built from its tiny fields: in_channels 3 and no "
                "pretrained_path"
            )
        if shift <= 0:
            raise ValueError(f"shift must be > 0, got {shift}")
        if not 0 <= ema_decay < 1:
            raise ValueError(f"ema_decay must be in [0, 1), got {ema_decay}")
        if not 0 <= caption_dropout < 1:
            raise ValueError(f"caption_dropout must be in [0, 1), got {caption_dropout}")
        self.transformer = transformer
        self.text_encoder = text_encoder
        self.lr, self.weight_decay = lr, weight_decay
        self.warmup_steps, self.lr_floor = warmup_steps, lr_floor
        self.caption_dropout, self.grad_clip = caption_dropout, grad_clip
        self.val_num_steps = val_num_steps
        self.export_dir = export_dir
        self.train_text_encoder = train_text_encoder
        self.ema_decay = ema_decay
        self.shift = shift
        self.fingerprint_every = fingerprint_every
        self.fingerprints: dict[str, str] = {}
        self._ema: list[Tensor] = []
        self._features: dict[str, tuple[Tensor, Tensor]] = {}
        self.scorer = ShapesGenEval()

    def configure_model(self) -> None:
        if self.transformer.model is not None:
            return
        build_text_encoder(self.text_encoder)
        if self.train_text_encoder:
            self.text_encoder.model.requires_grad_(True)
        with seeded_cpu_init(self.transformer.init_seed):
            # Assigned to the expert so ``velocity`` (the RL path) is exactly what is trained here.
            self.transformer.model = SD3Transformer2DModel(**self.transformer.tiny_config())

    def encode(self, texts: list[str]) -> tuple[Tensor, Tensor]:
        """Text features (hidden, pooled) for ``texts``: cached per distinct text when the encoder is
        frozen, recomputed (with gradients when enabled) when ``train_text_encoder``."""
        if self.train_text_encoder:
            # Same tokenization and forward as ``TextEncoderExpert.encode``, minus its ``no_grad``.
            output = self.text_encoder.model(input_ids=self.text_encoder.tokenize(texts).to(self.device))
            return output.last_hidden_state, output.text_embeds
        missing = sorted({t for t in texts if t not in self._features})
        if missing:
            hidden, pooled = self.text_encoder.encode(missing)
            self._features.update({t: (h, p) for t, h, p in zip(missing, hidden, pooled, strict=True)})
        hidden = torch.stack([self._features[t][0] for t in texts]).to(self.device)
        pooled = torch.stack([self._features[t][1] for t in texts]).to(self.device)
        return hidden, pooled

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:
        x0 = batch["images"]
        n = x0.shape[0]
        drop = torch.rand(n) < self.caption_dropout
        hidden, pooled = self.encode(["" if d else c for c, d in zip(batch["captions"], drop.tolist(), strict=True)])
        sigma = torch.sigmoid(torch.randn(n, device=x0.device))
        sigma = self.shift * sigma / (1 + (self.shift - 1) * sigma)
        x_s, target = flow_targets(x0, torch.randn_like(x0), sigma)
        # An edit batch carries each target's clean source image, read in context (FlowTransformerExpert.velocity).
        extra = {"source": batch["sources"]} if "sources" in batch else {}
        pred = self.transformer.velocity(x_s, sigma, hidden, pooled, **extra)
        loss = torch.nn.functional.mse_loss(pred.float(), target)
        self.log("train/loss", loss, prog_bar=True, batch_size=n)
        return loss

    def configure_gradient_clipping(
        self, optimizer: Any, gradient_clip_val: Any = None, gradient_clip_algorithm: Any = None
    ) -> None:
        if self.grad_clip > 0:
            self.clip_gradients(optimizer, gradient_clip_val=self.grad_clip, gradient_clip_algorithm="norm")

    def trained_parameters(self) -> list[torch.nn.Parameter]:
        """Every weight the optimizer updates: the DiT's, plus the text encoder's when it is trained."""
        params = list(self.transformer.parameters())
        if self.train_text_encoder:
            params += list(self.text_encoder.model.parameters())
        return params

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.fingerprint_every and self.global_step % self.fingerprint_every == 0:
            self.fingerprints[str(self.global_step)] = weights_sha256(self.trained_parameters())
        if self.ema_decay == 0:
            return
        params = [p.detach() for p in self.trained_parameters()]
        if not self._ema:
            self._ema = [p.clone() for p in params]
            return
        # Warm-up of the decay (1 + n) / (10 + n): a fixed 0.999 would keep ~half the first step's
        # weights in the average after 700 steps, and mid-run validations would score those.
        n = self.global_step
        decay = min(self.ema_decay, (1 + n) / (10 + n))
        torch._foreach_lerp_(self._ema, params, 1.0 - decay)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["ema"] = self._ema
        checkpoint["fingerprints"] = self.fingerprints

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self._ema = checkpoint.get("ema", [])
        self.fingerprints = checkpoint.get("fingerprints", {})

    @contextmanager
    def averaged_weights(self) -> Iterator[None]:
        """Swap the EMA weights in for the duration of the block (a no-op without an EMA)."""
        if not self._ema:
            yield
            return
        params = self.trained_parameters()
        live = [p.detach().clone() for p in params]
        with torch.no_grad():
            torch._foreach_copy_([p.data for p in params], self._ema)
        try:
            yield
        finally:
            with torch.no_grad():
                torch._foreach_copy_([p.data for p in params], live)

    def configure_optimizers(self) -> dict[str, Any]:
        params = self.trained_parameters()
        opt = torch.optim.AdamW(params, lr=self.lr, weight_decay=self.weight_decay)
        total = self.trainer.max_steps if self.trainer.max_steps > 0 else 10_000
        sched = warmup_cosine(opt, self.warmup_steps, total, self.lr_floor)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    @torch.no_grad()
    def sample(self, prompts: list[str], seed: int = 0, num_steps: int | None = None) -> Tensor:
        """Images (N, 3, H, W) in [0, 1] for ``prompts`` via the RL serve path's deterministic ODE."""
        generator = ComponentGenerator(self.transformer, self.text_encoder, vae=None)
        config = RolloutConfig(num_steps=num_steps or self.val_num_steps, shift=self.shift)
        loop = DiffusionDenoise(generator, config)
        hidden, pooled = self.encode(prompts)
        n = len(prompts)
        x, _ = loop.sample({"hidden": hidden, "pooled": pooled}, list(range(n)), [0] * n, "serve", seed=seed)
        return generator.decode(x)

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        with self.averaged_weights():
            images = self.sample(batch["prompts"])
        n = len(batch["prompts"])
        for key, value in self.scorer.per_category(batch["prompts"], images).items():
            self.log(f"val/{key}", value, batch_size=n)

    def on_fit_end(self) -> None:
        if self.export_dir is not None and self.trainer.is_global_zero:
            self.export(self.export_dir)

    def export(self, export_dir: str | Path) -> None:
        """Save ``transformer/`` (diffusers) and ``text_encoder/`` (transformers + tokenizer) folders, with
        the averaged weights when there is an EMA, each with its ``MANIFEST.sha256``, and ``fingerprints.json``."""
        root = Path(export_dir)
        with self.averaged_weights():
            self.transformer.model.save_pretrained(root / "transformer")
            self.text_encoder.model.save_pretrained(root / "text_encoder")
        self.text_encoder.tokenizer.save_pretrained(root / "text_encoder")
        # Each folder's own manifest: the experts check it when they load (a copy of the shipped assets with the
        # shipped files' names, sizes and headers is otherwise checked against the shipped hashes).
        write_manifest(root / "transformer")
        write_manifest(root / "text_encoder")
        if self.fingerprints:
            text = json.dumps({"trained_weights_sha256_after_step": self.fingerprints}, indent=1)
            (root / "fingerprints.json").write_text(text + "\n")
