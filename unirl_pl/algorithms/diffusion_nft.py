"""DiffusionNFT (Zheng et al., 2025): negative-aware fine-tuning on the forward process, without log-probs.

The rollout samples with the *old* policy, an exponential moving average of the adapter, by the ODE and
without guidance, and keeps the clean samples. For each sample it draws ``J`` noise levels from its own
schedule and a noise per level (from a generator keyed by the sample's seed) and records the forward-process
points ``xt = (1 - t) x0 + t eps`` with the old policy's velocity there. Training fits the current policy at
those points with :func:`unirl_pl.losses.nft_loss`: the implicit positive policy ``beta v + (1 - beta) v_old``
is pulled towards the sample in proportion to its optimality probability ``r`` (the clipped advantage mapped
to [0, 1]), the implicit negative one ``(1 + beta) v_old - beta v`` in proportion to ``1 - r``. After each
training step the old policy moves towards the current one, ``old <- d old + (1 - d) current``, with the
reference's decay schedule ``d = min(max(step - flat, 0) * rate, max)`` (decay type 1: 0, 0.001, 0.5).

There is no likelihood to check, so the C2 gate checks the identity the method does have: the old policy's
velocity recomputed at the recorded points, under the weights the rollout used, equals the recorded one bit
for bit (the loss uses the recorded one).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor, distribute_tensor

from unirl_pl.algorithms.base import Backward, GateValues, GeneratorAlgorithm, LossInputs
from unirl_pl.algorithms.drivers import add_part, weighted_loss
from unirl_pl.loops.config import RolloutConfig, SampleRequest, StepPlan, chunk_bounds
from unirl_pl.loops.diffusion_denoise import sigma_table
from unirl_pl.losses import LossOutput, nft_loss, optimality_probability
from unirl_pl.records import FlowPointsRecord, cond_rows
from unirl_pl.seeding import sample_generators

STREAM_POINTS = 3
"""The seeding stream of a sample's training points (0-2: tokens, noise, Flow-GRPO-Fast's window)."""


class DiffusionNFT(GeneratorAlgorithm):
    """DiffusionNFT: likelihood-free, ODE rollouts of an EMA old policy, implicit positive/negative velocity.

    The KL weight to the adapter-disabled reference is ``model.transformer_loss.beta`` (the reference uses
    1e-4 on the mean squared velocity difference); ``clip_eps`` and ``rollout_correction`` do not apply.
    ``model.rollout.shared_start_noise: true`` is refused when the generator trains (ODE rollouts from one
    noise give the samples of one text the same image).

    Args:
        beta: The NFT step size ``beta`` of the implicit policies (the reference's ``config.beta``: 1.0, or 0.1
            with decay type 2).
        timestep_fraction: Training points per sample as a fraction of the denoising steps (``int(num_steps *
            fraction)``, at least 1), drawn without replacement from the sample's schedule.
        adv_clip_max: Advantages are clipped to ``+-adv_clip_max`` and mapped to ``r = A / adv_clip_max / 2 +
            0.5``; the loss is scaled by it.
        ema_flat: Training steps during which the old policy copies the current one (decay 0).
        ema_rate: Growth of the decay per step after ``ema_flat``.
        ema_max: Largest decay.
    """

    position = "training point"
    likelihood = False

    def __init__(
        self,
        beta: float = 1.0,
        timestep_fraction: float = 0.99,
        adv_clip_max: float = 5.0,
        ema_flat: int = 0,
        ema_rate: float = 0.001,
        ema_max: float = 0.5,
    ) -> None:
        if beta <= 0:
            raise ValueError(f"beta must be > 0, got {beta}")
        if not 0 < timestep_fraction <= 1:
            raise ValueError(f"timestep_fraction must be in (0, 1], got {timestep_fraction}")
        if adv_clip_max <= 0:
            raise ValueError(f"adv_clip_max must be > 0, got {adv_clip_max}")
        if ema_flat < 0 or ema_rate < 0 or not 0 <= ema_max < 1:
            raise ValueError(
                f"need ema_flat >= 0, ema_rate >= 0 and 0 <= ema_max < 1, got {ema_flat}, {ema_rate}, {ema_max}"
            )
        self.beta, self.timestep_fraction, self.adv_clip_max = beta, timestep_fraction, adv_clip_max
        self.ema_flat, self.ema_rate, self.ema_max = ema_flat, ema_rate, ema_max
        self.params: list[Tensor] = []
        self.old: list[Tensor] = []

    # ------------------------------------------------------------------ the old policy
    def bind(self, expert: Any, loop: Any, trained: bool) -> None:
        super().bind(expert, loop, trained)
        self.params = [p for p in expert.parameters() if p.requires_grad] if trained else []
        self.old = [p.detach().clone() for p in self.params]

    def check_rollout(self, config: RolloutConfig, trained: bool) -> None:
        if trained and config.guided:
            raise ValueError(
                "DiffusionNFT samples and trains without classifier-free guidance: set model.rollout.guidance_scale=1.0"
            )
        if trained and config.shared_start_noise:
            # The rollout is the ODE: a group's samples from one start noise differ only by their text, so the
            # samples of one text are one image (zero spread, nothing to learn); the reference draws every
            # sample's noise (NVlabs/DiffusionNFT train_nft_sd3.py: pipeline_with_logprob without latents).
            raise ValueError(
                "DiffusionNFT samples by the ODE from each sample's own initial noise: with "
                "model.rollout.shared_start_noise=true the samples of one text are the same image; set "
                "model.rollout.shared_start_noise=false"
            )

    def check_settings(self, settings: Any) -> None:
        if getattr(settings, "rollout_correction", "off") != "off":
            raise ValueError(
                "DiffusionNFT has no likelihood to reweight: set model.transformer_loss.rollout_correction=off"
            )
        if getattr(settings, "kl_form", "flow_grpo") != "flow_grpo":
            # Its KL term is the squared velocity distance to the reference at forward-process points: no SDE
            # step, so no step variance for PromptRL's form to divide by.
            raise ValueError(
                "DiffusionNFT's KL is the mean squared velocity distance to the reference (no SDE step to take a "
                "variance from): leave model.transformer_loss.kl_form at its default, flow_grpo"
            )

    def decay(self, step: int) -> float:
        """The old policy's decay after ``step`` training steps."""
        return min(max(step - self.ema_flat, 0) * self.ema_rate, self.ema_max)

    def end_step(self, step: int) -> None:
        weight = 1.0 - self.decay(step + 1)
        with torch.no_grad():
            for old, param in zip(self.old, self.params, strict=True):
                old.lerp_(param.detach(), weight)

    @contextmanager
    def old_policy(self) -> Iterator[None]:
        """The expert's trainable weights replaced by the old policy's (restored on exit)."""
        with torch.no_grad():
            current = [p.detach().clone() for p in self.params]
            for p, o in zip(self.params, self.old, strict=True):
                p.copy_(o)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, c in zip(self.params, current, strict=True):
                    p.copy_(c)

    def state_dict(self) -> dict[str, Any]:
        # Full tensors under FSDP2 (a collective on every rank, as the checkpoint's own state dict is).
        return {"old": [o.full_tensor() if isinstance(o, DTensor) else o.detach().clone() for o in self.old]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state.get("old", [])
        if len(saved) != len(self.old):
            raise ValueError(
                f"DiffusionNFT: the checkpoint has {len(saved)} old-policy tensors, the expert {len(self.old)}"
            )
        with torch.no_grad():
            for o, s in zip(self.old, saved, strict=True):
                if isinstance(o, DTensor):  # every rank holds the full tensor; keep this rank's shard
                    s = distribute_tensor(s.to(o.device), o.device_mesh, o.placements)
                o.copy_(s)

    # ------------------------------------------------------------------ what the rollout records
    def num_points(self, config: RolloutConfig) -> int:
        """Training points per sample."""
        return max(1, int(config.num_steps * self.timestep_fraction))

    def least_steps(self, config: RolloutConfig) -> int:
        return self.num_points(config)

    def describe(self, config: RolloutConfig) -> dict[str, Any]:
        return {"sde_steps": [], "sampler": "ode (old policy)", "training_points_per_sample": self.num_points(config)}

    def plan(self, config: RolloutConfig, seed: int, request_ids: list[int], sample_indices: list[int]) -> StepPlan:
        return StepPlan.ode(len(request_ids))

    @torch.no_grad()
    def rollout(self, loop: Any, request: SampleRequest) -> tuple[Tensor, FlowPointsRecord]:
        """ODE samples of the old policy without guidance, and the training points with its velocity there."""
        ids, idx, num_steps = list(request.request_ids), list(request.sample_indices), request.num_steps
        n, points = len(ids), self.num_points(loop.config)
        steps = [loop.config.num_steps] * n if num_steps is None else [int(c) for c in num_steps]
        if len(steps) == n and min(steps) < points:
            raise ValueError(f"every request needs >= {points} steps (DiffusionNFT's training points), got {steps}")
        with self.old_policy():
            latents, _ = loop.run(replace(request, uncond=None), StepPlan.ode(n))
            table = sigma_table(steps, loop.sigmas)
            t = torch.empty(n, points, dtype=torch.float64)
            noise = []
            for i, g in enumerate(sample_generators(request.seed, ids, idx, STREAM_POINTS)):
                order = torch.randperm(steps[i], generator=g)[:points]
                t[i] = table[i, order]
                noise.append(torch.randn(points, *latents.shape[1:], generator=g))
            x0 = latents.float()
            t32 = t.float().to(x0.device)
            shape = (n, points) + (1,) * (x0.ndim - 1)
            xt = (1 - t32.reshape(shape)) * x0[:, None] + t32.reshape(shape) * torch.stack(noise).to(x0.device)
            record = FlowPointsRecord(
                x0=x0,
                xt=xt,
                t=t32,
                old_v=torch.empty_like(xt),
                cond=request.cond,
                chunks=chunk_bounds(n, loop.config.micro_batch_size),
                version=request.version,
            )
            record.old_v.copy_(self.velocities(loop, record))
        return latents, record

    def velocities(self, loop: Any, record: FlowPointsRecord) -> Tensor:
        """The velocity of the weights in place at every recorded point, in the recorded micro-batches."""
        out = torch.empty_like(record.xt)
        for j, (a, b) in record.points():
            out[a:b, j] = self.velocity(loop, record, j, (a, b))
        return out

    def velocity(self, loop: Any, record: FlowPointsRecord, point: int, chunk: tuple[int, int]) -> Tensor:
        """The unguided velocity at point ``point`` of the samples in ``chunk``."""
        a, b = chunk
        return loop.velocity(
            record.xt[a:b, point].contiguous(), record.t[a:b, point], cond_rows(record.cond, slice(a, b)), None
        )

    # ------------------------------------------------------------------ the loss and the gate
    def loss(self, inputs: LossInputs, backward: Backward | None = None) -> LossOutput:
        """The mean over (sample, point) of :func:`nft_loss`, each (point, micro-batch) term backpropagated at once."""
        loop, record, settings = inputs.loop, inputs.record, inputs.settings
        n = record.x0.shape[0]
        parts: list[tuple[float, LossOutput]] = []
        r = optimality_probability(inputs.advantages.float(), self.adv_clip_max)
        for j, (a, b) in record.points():
            v = self.velocity(loop, record, j, (a, b))
            ref = None
            if settings.beta > 0:
                with torch.no_grad(), inputs.reference():
                    ref = self.velocity(loop, record, j, (a, b))
            out = nft_loss(
                v,
                record.old_v[a:b, j],
                record.xt[a:b, j],
                record.x0[a:b],
                record.t[a:b, j],
                r[a:b],
                nft_beta=self.beta,
                clip_max=self.adv_clip_max,
                ref_velocity=ref,
                kl_beta=settings.beta,
            )
            add_part(parts, (b - a) / (n * record.num_points), out, backward)
        merged = weighted_loss(parts, backpropagated=backward is not None)
        extras = {k: sum(w * o.extras[k] for w, o in parts) for k in parts[0][1].extras}
        return replace(merged, extras=extras)

    @torch.no_grad()
    def gate_values(self, loop: Any, record: FlowPointsRecord, out: LossOutput | None) -> GateValues:
        """The old policy's velocity recomputed at every point vs the recorded one, one row per sample."""
        with self.old_policy():
            recomputed = self.velocities(loop, record)
        n = record.x0.shape[0]
        new, old = recomputed.reshape(n, -1), record.old_v.reshape(n, -1)
        return new, old, torch.ones_like(old, dtype=torch.bool)
