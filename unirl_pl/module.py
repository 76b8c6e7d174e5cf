"""The LightningModule: builds the experts from the card, runs rollout, computes the losses, steps optimizers.

Orchestration only: sampling math is in :mod:`unirl_pl.sampling`, loss math in :mod:`unirl_pl.losses`,
the loops in :mod:`unirl_pl.rollout`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from jsonargparse import lazy_instance
from lightning.pytorch.cli import OptimizerCallable
from torch import Tensor
from torch.distributed.tensor import DTensor

from unirl_pl.card import Card
from unirl_pl.checkpoint import TRIMMED_KEY, refill_trimmed, rng_states, set_rng_states, trim_frozen
from unirl_pl.data import Experience, PromptBatch, PromptDataModule
from unirl_pl.distributed import shard_experts, token_loss_weight
from unirl_pl.experts import CausalLMExpert, FlowTransformerExpert, TextEncoderExpert, VAEExpert
from unirl_pl.losses import LossOutput, flow_grpo_loss, group_advantages, grpo_token_loss, zero_std_fraction
from unirl_pl.rewards import WeightedSum
from unirl_pl.rollout import DiTRecord, LMRecord, Profile, RolloutConfig, RolloutEngine
from unirl_pl.sampling import flow_kl
from unirl_pl.versioning import FeatureCache, VersionLedger


@dataclass(frozen=True)
class ExpertLoss:
    """Per-expert policy-loss settings.

    Args:
        clip_eps: PPO ratio clip range ``[1-eps, 1+eps]`` (GRPO uses ~0.2, Flow-GRPO ~1e-4).
        beta: Weight of the KL to the adapter-disabled reference policy (0 skips the reference forward).
        grad_clip: Clip this expert's gradient norm to this value (None: no clipping, norm still logged).
    """

    clip_eps: float = 0.2
    beta: float = 0.01
    grad_clip: float | None = 1.0


def _default_llm_optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.0)


def _default_dit_optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=3e-4, weight_decay=0.0)


class UniRLModule(pl.LightningModule):
    """Joint GRPO of a prompt-refiner LM and a flow-matching DiT from one reward.

    Args:
        transformer: The flow DiT expert (trained with Flow-GRPO unless ``mode`` freezes it).
        text_encoder: Frozen text encoder giving the DiT its conditioning.
        llm: The prompt-refiner LM expert (None for a generator-only card).
        vae: Frozen VAE decoding latents to images (None: the DiT works in pixel space, 3 channels in [-1, 1]).
        mode: ``joint`` trains both experts; ``prompt_only`` trains the LM and samples the frozen DiT with
            the ODE; ``generator_only`` never runs (or changes) the LM and trains the DiT on the original prompts.
        rollout: How both loops sample (tokens, steps, SDE window, micro-batches).
        rewards: Reward name (registry key or dotted path) -> weight; the weighted sum is the reward.
        reward_args: Reward name -> keyword arguments for rewards that take some.
        llm_optimizer: Optimizer of the LM's LoRA parameters (its own learning rate).
        transformer_optimizer: Optimizer of the DiT's LoRA parameters (its own learning rate).
        llm_loss: GRPO settings of the LM (token-level clipped ratio, k3 KL).
        transformer_loss: Flow-GRPO settings of the DiT (clipped ratio, KL of step means).
        ppo_epochs: Optimizer steps per experience; after the first, records are stale by design and
            the ratio moves away from 1.
        on_stale: ``error`` (on-policy: a record whose producing version is not current at its first
            update stops the run) or ``log`` (staleness is logged).
        reshard_after_forward: FSDP2 only (``ModelParallelStrategy``): free each block's gathered
            weights after its forward (less memory) or keep them until backward (less communication).
    """

    def __init__(
        self,
        transformer: FlowTransformerExpert = lazy_instance(FlowTransformerExpert),
        text_encoder: TextEncoderExpert = lazy_instance(TextEncoderExpert),
        llm: CausalLMExpert | None = lazy_instance(CausalLMExpert),
        vae: VAEExpert | None = lazy_instance(VAEExpert),
        mode: Literal["joint", "prompt_only", "generator_only"] = "joint",
        rollout: RolloutConfig = RolloutConfig(),
        rewards: dict[str, float] | None = None,
        reward_args: dict[str, dict[str, Any]] | None = None,
        llm_optimizer: OptimizerCallable = _default_llm_optimizer,
        transformer_optimizer: OptimizerCallable = _default_dit_optimizer,
        llm_loss: ExpertLoss = ExpertLoss(),
        transformer_loss: ExpertLoss = ExpertLoss(clip_eps=1e-4, beta=0.004),
        ppo_epochs: int = 1,
        on_stale: Literal["error", "log"] = "error",
        reshard_after_forward: bool = True,
    ) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.card = Card.unified(has_llm=llm is not None, has_vae=vae is not None)
        self.card.validate(mode)
        if ppo_epochs < 1:
            raise ValueError(f"ppo_epochs must be >= 1, got {ppo_epochs}")
        if on_stale not in ("error", "log"):
            raise ValueError(f"on_stale must be 'error' or 'log', got {on_stale!r}")
        self.mode = mode
        self.llm = llm
        self.transformer = transformer
        self.text_encoder = text_encoder
        self.vae = vae
        self.rollout_config = rollout
        self.reward_fn = WeightedSum(rewards or {"refiner_format": 1.0}, reward_args)
        self.optimizer_factories = {"llm": llm_optimizer, "transformer": transformer_optimizer}
        self.losses = {"llm": llm_loss, "transformer": transformer_loss}
        self.ppo_epochs = ppo_epochs
        self.on_stale = on_stale
        self.reshard_after_forward = reshard_after_forward
        self.trained = self.card.trained_components(mode)
        self.ledger = VersionLedger(list(self.card.components))
        self.feature_cache = FeatureCache(self.ledger)
        self.engine: RolloutEngine | None = None

    # ------------------------------------------------------------------ building
    def experts(self) -> dict[str, torch.nn.Module]:
        """The card's components that are present, by name."""
        parts = {"llm": self.llm, "transformer": self.transformer, "text_encoder": self.text_encoder, "vae": self.vae}
        return {k: v for k, v in parts.items() if v is not None}

    def configure_model(self) -> None:
        if self.engine is not None:
            return
        for expert in self.experts().values():
            expert.build()
        for name in ("llm", "transformer"):
            expert = self.experts().get(name)
            if expert is not None and name not in self.trained:
                # A frozen expert gets no gradients, so it can never change and its version never moves.
                expert.requires_grad_(False)
        self._check_pixel_space()
        if self.device_mesh is not None:
            # FSDP2: shard after LoRA is attached so the adapter is sharded with its block.
            shard_experts(self.experts(), self.trained, self.device_mesh["data_parallel"], self.reshard_after_forward)
            # ModelParallelStrategy loads module weights straight from the file, before
            # on_load_checkpoint can refill the trimmed frozen weights that configure_model rebuilt.
            self.strict_loading = False
        self.engine = RolloutEngine(self.llm, self.transformer, self.rollout_config)

    def _check_pixel_space(self) -> None:
        channels = self.transformer.latent_shape[0]
        expected = self.vae.latent_channels if self.vae is not None else 3
        if channels != expected:
            where = "the VAE's latent_channels" if self.vae is not None else "3 (pixel space, no VAE)"
            raise ValueError(f"the transformer has {channels} input channels but {where} is {expected}")

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        opts = []
        for name in self.trained:
            params = [p for p in self.experts()[name].parameters() if p.requires_grad]
            if not params:
                raise ValueError(f"expert {name!r} has no trainable parameters (is its LoRA attached?)")
            opts.append(self.optimizer_factories[name](params))
        return opts

    # ------------------------------------------------------------------ rollout
    def encode(self, texts: Sequence[str]) -> tuple[Tensor, Tensor]:
        """Text features through the versioned cache: each distinct text is encoded once per version."""
        hidden, pooled = self.feature_cache.get_or_compute("text_encoder", texts, self.text_encoder.encode)
        return hidden, pooled

    def decode(self, latents: Tensor) -> Tensor:
        """Images (N, 3, H, W) in [0, 1] from latents (or from pixel-space samples in [-1, 1])."""
        if self.vae is None:
            return ((latents.float().clamp(-1, 1) + 1) / 2).clamp(0, 1)
        return self.vae.decode(latents)

    def _uncond(self) -> tuple[Tensor, Tensor] | None:
        if self.rollout_config.guidance_scale == 1.0:
            return None
        return self.encode([""])

    def refine(
        self, prompts: list[str], request_ids: list[int], sample_indices: list[int], profile: Profile
    ) -> tuple[list[str], LMRecord | None]:
        """Refined prompts for the given samples (empty lists pass through)."""
        if not prompts:
            return [], None
        assert self.engine is not None and self.llm is not None
        texts, record = self.engine.refine(prompts, request_ids, sample_indices, profile, self.ledger["llm"])
        return texts, record

    def draw(
        self, texts: list[str], request_ids: list[int], sample_indices: list[int], profile: Profile
    ) -> tuple[Tensor, DiTRecord | None]:
        """Encode, denoise and decode: (images, DiT record or None)."""
        assert self.engine is not None
        hidden, pooled = self.encode(texts)
        latents, record = self.engine.denoise(
            hidden, pooled, request_ids, sample_indices, profile, self.ledger["transformer"], self._uncond()
        )
        return self.decode(latents), record

    @torch.no_grad()
    def collect_experience(self, batch: PromptBatch, data: PromptDataModule) -> Experience:
        """Rollout for one step (profile ``rollout``): refine, render, score, and compute advantages."""
        assert self.engine is not None
        self.engine.seed = data.seed
        k, m, p = data.samples_per_prompt, data.images_per_refinement, len(batch.prompts)
        runs_lm = self.llm is not None and self.card.runs_loop(self.mode, "ar_decode")
        skip = data.num_skip_refinement if runs_lm else k
        texts = [q for q in batch.prompts for _ in range(k)]
        req = [r for r in batch.request_ids for _ in range(k)]
        idx = [j for _ in range(p) for j in range(k)]
        rows = [i for i in range(p * k) if idx[i] >= skip]
        lm_profile: Profile = "rollout" if "llm" in self.trained else "serve"
        refined_rows, lm_record = self.refine(
            [texts[i] for i in rows], [req[i] for i in rows], [idx[i] for i in rows], lm_profile
        )
        refined = list(texts)
        for i, t in zip(rows, refined_rows, strict=True):
            refined[i] = t
        if lm_record is not None:
            lm_record.rows = torch.as_tensor(rows, dtype=torch.long)
            if "llm" not in self.trained:
                lm_record = None

        img_text = torch.arange(p * k).repeat_interleave(m)
        dit_profile: Profile = "rollout" if "transformer" in self.trained else "serve"
        images, dit_record = self.draw(
            [refined[t] for t in img_text.tolist()],
            [req[t] for t in img_text.tolist()],
            [idx[t] * m + j for t in range(p * k) for j in range(m)],
            dit_profile,
        )
        originals = [texts[t] for t in img_text.tolist()]
        rewards, parts = self.reward_fn(originals, [refined[t] for t in img_text.tolist()], images)
        text_rewards = rewards.view(p * k, m).mean(1)
        prompt_of_text = torch.arange(p).repeat_interleave(k)
        adv_kwargs = {"global_std": data.global_std, "clip_max": data.adv_clip_max}
        text_adv = group_advantages(
            text_rewards, prompt_of_text, batch_std=self._batch_std(text_rewards, data), **adv_kwargs
        )
        groups = prompt_of_text[img_text] if data.advantage_scheme == "shared" else img_text
        dit_adv = group_advantages(rewards, groups, batch_std=self._batch_std(rewards, data), **adv_kwargs)
        if data.advantage_scheme == "shared" and m == 1:
            dit_adv = text_adv  # PromptRL: literally one advantage per sample for both experts.
        device = self.device
        return Experience(
            prompts=originals,
            refined=[refined[t] for t in img_text.tolist()],
            text_index=img_text,
            rewards=rewards.to(device),
            text_rewards=text_rewards.to(device),
            lm_advantages=text_adv[rows].to(device),
            dit_advantages=dit_adv.to(device),
            lm=lm_record,
            dit=dit_record,
            reward_terms={n: float(v.mean()) for n, v in parts.items()},
            zero_std_frac=zero_std_fraction(text_rewards, prompt_of_text),
            images=images,
        )

    def _batch_std(self, rewards: Tensor, data: PromptDataModule) -> Tensor | None:
        """The std of the global batch's rewards (all ranks) for ``global_std``; None on one process."""
        if not data.global_std or self._trainer is None or self.trainer.world_size == 1:
            return None
        gathered = self.all_gather(rewards.to(self.device))
        return gathered.flatten().double().std(unbiased=False).cpu()

    @torch.no_grad()
    def recompute_logprobs(self, exp: Experience) -> dict[str, tuple[Tensor, Tensor, Tensor]]:
        """(recomputed, behavior, mask) log-probs of each captured record under the current weights."""
        assert self.engine is not None
        out = {}
        if exp.lm is not None:
            out["llm"] = (self.engine.lm_logprobs(exp.lm), exp.lm.old_logp, exp.lm.gen_mask)
        if exp.dit is not None:
            old = exp.dit.old_logp
            out["transformer"] = (self.engine.dit_logprobs(exp.dit), old, torch.ones_like(old, dtype=torch.bool))
        return out

    # ------------------------------------------------------------------ training
    def _llm_loss(self, exp: Experience) -> LossOutput:
        assert self.engine is not None and self.llm is not None and exp.lm is not None
        cfg = self.losses["llm"]
        logp = self.engine.lm_logprobs(exp.lm)
        ref = None
        if cfg.beta > 0:
            with torch.no_grad(), self.llm.adapter_disabled():
                ref = self.engine.lm_logprobs(exp.lm)
        return grpo_token_loss(
            logp,
            exp.lm.old_logp,
            exp.lm_advantages,
            exp.lm.gen_mask,
            ref_logp=ref,
            clip_eps=cfg.clip_eps,
            beta=cfg.beta,
        )

    def _dit_loss(self, exp: Experience) -> LossOutput:
        assert self.engine is not None and exp.dit is not None
        cfg, rec = self.losses["transformer"], exp.dit
        logps, kls = [], []
        for step in range(rec.num_steps):
            step_logp, step_kl = [], []
            for chunk in rec.chunks:
                logp, mean, std = self.engine.dit_step_logprob(rec, step, chunk)
                step_logp.append(logp)
                if cfg.beta > 0:
                    with torch.no_grad(), self.transformer.adapter_disabled():
                        _, ref_mean, _ = self.engine.dit_step_logprob(rec, step, chunk)
                    step_kl.append(flow_kl(mean, ref_mean, std))
            logps.append(torch.cat(step_logp))
            if step_kl:
                kls.append(torch.cat(step_kl))
        # Averaging over (sample, step) pairs matches Flow-GRPO's gradient accumulation over timesteps.
        logp = torch.stack(logps, 1).flatten()
        adv = exp.dit_advantages.repeat_interleave(rec.num_steps)
        kl = torch.stack(kls, 1).flatten() if kls else None
        return flow_grpo_loss(logp, rec.old_logp.flatten(), adv, kl=kl, clip_eps=cfg.clip_eps, beta=cfg.beta)

    def _check_staleness(self, exp: Experience) -> dict[str, float]:
        staleness = {}
        for name, rec in (("llm", exp.lm), ("transformer", exp.dit)):
            if rec is None:
                continue
            lag = self.ledger[name] - rec.version
            staleness[name] = float(lag)
            if lag and self.on_stale == "error":
                raise RuntimeError(
                    f"off-policy batch: the {name} record was produced by version {rec.version} but the "
                    f"weights are at version {self.ledger[name]} (set model.on_stale=log to allow stale data)"
                )
        return staleness

    def _strategy(self) -> Any:
        return self._trainer.strategy if self._trainer is not None else None

    def _optimizers_by_name(self) -> dict[str, Any]:
        opts = self.optimizers()
        opts = opts if isinstance(opts, list) else [opts]
        return dict(zip(self.trained, opts, strict=True))

    def _step(self, name: str, opt: Any, first: bool) -> Tensor:
        params = [p for p in self.experts()[name].parameters() if p.grad is not None]
        grad_norm = torch.nn.utils.get_total_norm([p.grad for p in params]) if params else torch.zeros(())
        if isinstance(grad_norm, DTensor):  # FSDP2: a partial norm; loggers and sync_dist need a plain tensor
            grad_norm = grad_norm.full_tensor()
        clip = self.losses[name].grad_clip
        if clip is not None:
            self.clip_gradients(opt, gradient_clip_val=clip, gradient_clip_algorithm="norm")
        if first:
            opt.step()
        else:
            # Lightning counts every LightningOptimizer.step() as a global step; one RL step that
            # updates two experts must count once, so the others step through the strategy directly.
            self.trainer.strategy.optimizer_step(opt.optimizer, closure=lambda: None, model=self)
        self.ledger.bump(name)
        return grad_norm.detach()

    def training_step(self, exp: Experience, batch_idx: int) -> None:
        staleness = self._check_staleness(exp)
        opts = self._optimizers_by_name()
        metrics: dict[str, Tensor | float] = {}
        for epoch in range(self.ppo_epochs):
            for opt in opts.values():
                opt.zero_grad(set_to_none=True)
            outputs: dict[str, LossOutput] = {}
            if "llm" in opts and exp.lm is not None:
                outputs["llm"] = self._llm_loss(exp)
            if "transformer" in opts and exp.dit is not None:
                outputs["transformer"] = self._dit_loss(exp)
            if not outputs:
                continue
            # Token-level LM loss: reweight so the ranks' averaged gradient is the global token mean.
            weights = {n: token_loss_weight(exp.lm.gen_mask, self._strategy()) if n == "llm" else 1.0 for n in outputs}
            self.manual_backward(sum(weights[n] * o.loss for n, o in outputs.items()))
            for i, name in enumerate(outputs):
                # Lightning counts each LightningOptimizer.step() as a global step: exactly one per RL step.
                grad_norm = self._step(name, opts[name], first=epoch == 0 and i == 0)
                if epoch == 0:
                    metrics.update(self._loss_metrics(name, outputs[name], grad_norm))
        metrics.update(self._rollout_metrics(exp, staleness))
        self.log_dict(metrics, on_step=True, on_epoch=False, batch_size=len(exp.prompts), sync_dist=True)
        self.log(
            "reward/mean", exp.rewards.mean(), prog_bar=True, on_step=True, batch_size=len(exp.prompts), sync_dist=True
        )

    def _loss_metrics(self, name: str, out: LossOutput, grad_norm: Tensor) -> dict[str, Tensor]:
        return {
            f"{name}/loss": out.loss.detach(),
            f"{name}/pg_loss": out.pg_loss,
            f"{name}/kl": out.kl,
            f"{name}/ratio_mean": out.ratio_mean,
            f"{name}/ratio_min": out.ratio_min,
            f"{name}/ratio_max": out.ratio_max,
            f"{name}/clip_frac": out.clip_frac,
            f"{name}/clip_frac_high": out.clip_frac_high,
            f"{name}/clip_frac_low": out.clip_frac_low,
            f"{name}/grad_norm": grad_norm,
        }

    def _rollout_metrics(self, exp: Experience, staleness: dict[str, float]) -> dict[str, Tensor | float]:
        metrics: dict[str, Tensor | float] = {
            "reward/std": exp.rewards.std(unbiased=False),
            "advantage/zero_std_frac": exp.zero_std_frac,
            "advantage/abs_mean": exp.dit_advantages.abs().mean(),
            "cache/text_encoder_hit_rate": self.feature_cache.hit_rate(),
        }
        metrics.update({f"reward/{n}": v for n, v in exp.reward_terms.items()})
        metrics.update({f"version/{n}": float(v) for n, v in self.ledger.as_dict().items()})
        metrics.update({f"version/{n}_staleness": v for n, v in staleness.items()})
        if exp.lm is not None:
            metrics["llm/response_tokens"] = exp.lm.gen_mask.sum(1).float().mean()
        return metrics

    # ------------------------------------------------------------------ evaluation
    def _serve(self, batch: PromptBatch) -> tuple[list[str], Tensor]:
        n = len(batch.prompts)
        data = self.trainer.datamodule if self._trainer is not None else None
        if self.engine is not None and isinstance(data, PromptDataModule):
            self.engine.seed = data.seed  # evaluation noise follows the data seed, as training's does
        refined = list(batch.prompts)
        if self.llm is not None and self.card.runs_loop(self.mode, "ar_decode"):
            refined, _ = self.refine(list(batch.prompts), batch.request_ids, [0] * n, "serve")
        images, _ = self.draw(refined, batch.request_ids, [0] * n, "serve")
        return refined, images

    def validation_step(self, batch: PromptBatch, batch_idx: int) -> None:
        refined, images = self._serve(batch)
        # Shard padding ran (so every rank made the same forwards) but is not scored.
        n = batch.real
        prompts, refined, images = batch.prompts[:n], refined[:n], images[:n]
        # A batch of padding only still logs (weight 0): every rank must log the same keys to sync them.
        means = {name: torch.zeros(()) for name in ["mean", *self.reward_fn.terms]}
        if n:
            total, parts = self.reward_fn(prompts, refined, images)
            means = {"mean": total.mean()} | {name: values.mean() for name, values in parts.items()}
        for name, value in means.items():
            self.log(f"val/reward_{name}", value, batch_size=n, sync_dist=True, prog_bar=name == "mean")
        for name in self.reward_fn.terms:
            breakdown = getattr(self.reward_fn.terms[name], "breakdown", None)
            if breakdown is not None and n:
                # Weighted by each key's count, so the epoch mean is exact however batches mix
                # categories. Keys differ between ranks, so no sync: under DDP this is rank 0's shard.
                for key, (mean, count) in breakdown(prompts, images).items():
                    self.log(f"val/{name}/{key}", mean, batch_size=count, sync_dist=False)

    def predict_step(self, batch: PromptBatch, batch_idx: int) -> dict[str, Any]:
        refined, images = self._serve(batch)
        n = batch.real
        prompts, refined, images = batch.prompts[:n], refined[:n], images[:n]
        total, _ = self.reward_fn(prompts, refined, images)
        return {"prompts": prompts, "refined": refined, "images": images, "rewards": total.tolist()}

    # ------------------------------------------------------------------ checkpoints
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["unirl_versions"] = self.ledger.as_dict()
        checkpoint["unirl_rng"] = rng_states()
        # Frozen base weights are rebuilt by configure_model; keeping them would bloat every checkpoint.
        checkpoint["state_dict"], checkpoint[TRIMMED_KEY] = trim_frozen(checkpoint["state_dict"], self)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if "unirl_versions" in checkpoint:
            self.ledger.load(checkpoint["unirl_versions"])
        if "unirl_rng" in checkpoint:
            set_rng_states(checkpoint["unirl_rng"])
        refill_trimmed(checkpoint, self)
