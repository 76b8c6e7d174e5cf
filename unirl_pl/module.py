"""The LightningModule: Lightning hooks that tie the card's experts, loops and method together.

Where each step goes: the experience source (:mod:`unirl_pl.method.experience`) runs rollout from
``on_after_batch_transfer``; ``training_step`` scores each trained component's records under the
current weights (:mod:`unirl_pl.algorithms.drivers`), backpropagates and steps that expert's optimizer. The
loops are :mod:`unirl_pl.loops`, the conditioning :mod:`unirl_pl.conditioning`, the math
:mod:`unirl_pl.losses` and :mod:`unirl_pl.sampling`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.cli import OptimizerCallable
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor

from unirl_pl import timing
from unirl_pl.algorithms import FlowGRPO, GeneratorAlgorithm, RefinerAlgorithm, TokenGRPO
from unirl_pl.algorithms.base import check_algorithms
from unirl_pl.callbacks.ema import EMA
from unirl_pl.card import Card, Loop, Role
from unirl_pl.checkpoint import load_run_state, save_run_state
from unirl_pl.conditioning import Conditioner
from unirl_pl.data import PromptBatch
from unirl_pl.distributed import shard_experts
from unirl_pl.evaluation import ValidationMetrics, serve, validation_keys, validation_scores
from unirl_pl.experts import CausalLMExpert, TinyCausalLMExpert
from unirl_pl.generators import ComponentGenerator, FlowGenerator
from unirl_pl.lazy_defaults import lazy_default
from unirl_pl.loops import ARDecode, DiffusionDenoise, EvalSampler, RolloutConfig, write_schedule
from unirl_pl.losses import LossOutput
from unirl_pl.method import AdvantageConfig, ExpertLoss
from unirl_pl.method.experience import ExperienceSource
from unirl_pl.method.policy import PolicyLosses, Rows
from unirl_pl.method.update import PolicyUpdate, check_split
from unirl_pl.metrics import RewardStatistics, log_step, rollout_metrics, update_metrics
from unirl_pl.records import Experience
from unirl_pl.rewards import RewardTerm, WeightedSum, registered_rewards
from unirl_pl.rewards.metadata import WithMetadata
from unirl_pl.source_images import check_edit_setup
from unirl_pl.versioning import VersionLedger, check_staleness


def _default_llm_optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.0)


def _default_dit_optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=3e-4, weight_decay=0.0)


class UniRLModule(pl.LightningModule):
    """Joint GRPO of a prompt-refiner LM and a flow-matching generator from one reward.

    Args:
        generator: The flow generator: the project's configured parts (``ComponentGenerator``) or a
            family loaded from a diffusers pipeline folder (``SD3Generator``, ``FluxGenerator``,
            ``WanGenerator``). Its transformer is the ``transformer`` expert.
        llm: The prompt-refiner LM expert (None for a generator-only card).
        pipeline_path: A diffusers pipeline folder for a family generator (overrides its ``pipeline_path``).
        mode: Which experts learn; every configured expert runs. ``joint`` trains both; ``prompt_only``
            trains the LM and samples the frozen generator with the ODE; ``generator_only`` trains the
            generator behind the frozen LM (greedy rewrites, exactly as served), or on the user's prompts
            when ``llm`` is null (Flow-GRPO without a refiner).
        rollout: How both loops sample (tokens, steps, shift, micro-batches, guidance); the stochastic steps
            and their noise are the generator algorithm's.
        eval_sampler: What validation and predict sample with where it differs from ``rollout`` (steps,
            guidance), as the references evaluate.
        rewards: The reward's terms; their weighted sum is the reward. Required. Each term a component:
            ``{reward: {class_path, init_args}, weight, name}`` (:class:`~unirl_pl.rewards.RewardTerm`; arguments
            checked when the recipe is parsed), or the short form: reward name (registry key or dotted path) ->
            weight.
        reward_args: Short form only: reward name -> keyword arguments for rewards that take some.
        advantage: How rewards become advantages (scheme, global std, clipping).
        llm_optimizer: Optimizer of the LM's LoRA parameters (its own learning rate).
        transformer_optimizer: Optimizer of the generator's LoRA parameters (its own learning rate).
        llm_loss: Policy-loss settings of the LM shared by its algorithms (clip range, KL weight, gradient
            clip, rollout correction).
        transformer_loss: Policy-loss settings of the generator shared by its algorithms (clip range, KL
            weight, gradient clip, rollout correction).
        generator_algorithm: How the generator learns (:mod:`unirl_pl.algorithms`): what its rollout records,
            its loss, what C2 checks, its schedule. ``FlowGRPO`` (default; its ``sde_window`` and ``noise_level``),
            ``FlowGRPOFast``, ``MixGRPO``, ``FlowCPS``, ``DiffusionNFT``; overlays in ``recipes/algorithms/``.
        llm_algorithm: How the refiner learns: ``TokenGRPO`` (default), ``DAPO``, ``GSPO``.
        ppo_epochs: Passes over each experience; each pass makes one optimizer step per mini-batch of each
            expert (``llm_loss.mini_batches``, ``transformer_loss.mini_batches``). After the first update
            records are stale by design and the ratio moves away from 1. One RL step is one trainer global step
            whatever the count.
        on_stale: ``error`` (on-policy: a record whose producing version is not current at its first
            update stops the run) or ``log`` (staleness is logged).
        reshard_after_forward: FSDP2 only (``ModelParallelStrategy``): free each block's gathered
            weights after its forward (less memory) or keep them until backward (less communication).
        max_consecutive_skips: A step whose loss or gradient norm is not finite is skipped (weights,
            optimizer state and versions untouched; ``train/skipped_steps`` counts them); more than this
            many in a row stop the run with an error.
        nonfinite_rewards: A reward that is NaN or infinite: ``error`` stops the run naming the reward and
            the sample; ``drop`` removes that sample from its group (advantage 0, counted in
            ``reward/dropped``); ``skip`` skips the whole step (weights untouched, ``train/skipped_steps``).
        reward_normalization: ``none``, or ``group``: each reward term is centred within its prompt's group and
            scaled by its std over the whole batch (every rank) before the weighted sum the advantages come
            from (``reward/mean`` stays the raw sum).
        ema: An exponential moving average of the trained adapters (:class:`unirl_pl.callbacks.EMA`) that
            validation, predict and export use; the module hands it to the trainer as a callback, so a recipe
            overlay can switch it on (None: off).
    """

    def __init__(
        self,
        generator: ComponentGenerator | FlowGenerator = lazy_default(ComponentGenerator),
        llm: CausalLMExpert | None = lazy_default(TinyCausalLMExpert),
        pipeline_path: str | None = None,
        mode: Literal["joint", "prompt_only", "generator_only"] = "joint",
        rollout: RolloutConfig = RolloutConfig(),
        eval_sampler: EvalSampler = EvalSampler(),
        rewards: list[RewardTerm] | dict[str, float] | None = None,
        reward_args: dict[str, dict[str, Any]] | None = None,
        advantage: AdvantageConfig = AdvantageConfig(),
        llm_optimizer: OptimizerCallable = _default_llm_optimizer,
        transformer_optimizer: OptimizerCallable = _default_dit_optimizer,
        llm_loss: ExpertLoss = ExpertLoss(),
        transformer_loss: ExpertLoss = ExpertLoss(clip_eps=1e-4, beta=0.004),
        generator_algorithm: GeneratorAlgorithm = lazy_default(FlowGRPO),
        llm_algorithm: RefinerAlgorithm = lazy_default(TokenGRPO),
        ppo_epochs: int = 1,
        on_stale: Literal["error", "log"] = "error",
        reshard_after_forward: bool = True,
        max_consecutive_skips: int = 3,
        nonfinite_rewards: Literal["error", "drop", "skip"] = "error",
        reward_normalization: Literal["none", "group"] = "none",
        ema: EMA | None = None,
    ) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.card = Card.unified(has_llm=llm is not None, has_vae=generator.has_vae)
        self.card.validate(mode)
        if ppo_epochs < 1:
            raise ValueError(f"ppo_epochs must be >= 1, got {ppo_epochs}")
        if on_stale not in ("error", "log"):
            raise ValueError(f"on_stale must be 'error' or 'log', got {on_stale!r}")
        if nonfinite_rewards not in ("error", "drop", "skip"):
            raise ValueError(f"nonfinite_rewards must be 'error', 'drop' or 'skip', got {nonfinite_rewards!r}")
        if max_consecutive_skips < 0:
            raise ValueError(f"max_consecutive_skips must be >= 0, got {max_consecutive_skips}")
        if not rewards:
            raise ValueError(
                "model.rewards is not set: give at least one term, e.g. rewards: [{reward: {class_path: "
                "unirl_pl.rewards.Brightness}, weight: 1.0}], or in the short form rewards: {brightness: 1.0}. "
                f"Registered rewards: {', '.join(registered_rewards())} (or a dotted path to your own callable)."
            )
        if pipeline_path is not None:
            if not isinstance(generator, FlowGenerator):
                raise ValueError(
                    "model.pipeline_path needs a family generator (model.generator: SD3Generator, FluxGenerator "
                    "or WanGenerator); the default ComponentGenerator is configured part by part"
                )
            generator.pipeline_path = pipeline_path
        self.mode, self.llm, self.generator = mode, llm, generator
        self.rollout_config, self.advantage = rollout, advantage
        self.eval_config = eval_sampler.apply(rollout)
        # A family whose checkpoint samples without guidance (step-distilled FLUX.2 [klein]) refuses it, unloaded.
        if (check_guidance := getattr(generator, "check_guidance", None)) is not None:
            check_guidance(rollout.guidance_scale, "model.rollout.guidance_scale")
            check_guidance(self.eval_config.guidance_scale, "model.eval_sampler.guidance_scale")
        self.reward_fn = WeightedSum(
            rewards,
            reward_args,
            nonfinite="error" if nonfinite_rewards == "error" else "drop",
            normalize=reward_normalization,
        )
        self.nonfinite_rewards = nonfinite_rewards
        self.val_metrics = ValidationMetrics(validation_keys(self.reward_fn))  # the val/* scores, summed over ranks
        self.reward_stats = RewardStatistics()  # the training rewards' reward/* statistics, pooled over ranks
        self.optimizer_factories = {Role.REFINER: llm_optimizer, Role.GENERATOR: transformer_optimizer}
        self.losses = {Role.REFINER: llm_loss, Role.GENERATOR: transformer_loss}
        self.generator_algorithm, self.llm_algorithm = generator_algorithm, llm_algorithm
        self.ppo_epochs, self.on_stale, self.reshard_after_forward = ppo_epochs, on_stale, reshard_after_forward
        self.max_consecutive_skips, self.skipped_steps, self.consecutive_skips = max_consecutive_skips, 0, 0
        self.trained = self.card.trained_components(mode)
        self.ledger = VersionLedger(list(self.card.components))
        self.ar_decode: ARDecode | None = None
        self.diffusion_denoise: DiffusionDenoise | None = None
        self.eval_denoise: DiffusionDenoise | None = None
        self.conditioning = Conditioner(
            generator, self.ledger, cache_size=rollout.feature_cache_size, offload=rollout.feature_cache_offload
        )
        self.source: ExperienceSource | None = None
        self.policy: PolicyLosses | None = None
        # Refused while the recipe is parsed: in configure_model (inside fit) a ValueError is a traceback.
        runs_lm = llm is not None and self.card.runs_loop(mode, Loop.DECODE)
        loops = {Loop.DENOISE: generator_algorithm} | ({Loop.DECODE: llm_algorithm} if runs_lm else {})
        check_algorithms({self.card.owner(loop): a for loop, a in loops.items()}, self.trained, rollout, self.losses)
        if ema is not None:
            experts = [name for name, role in self.card.components.items() if role == "expert"]
            ema.check_components(experts, self.trained, mode, "model.ema.init_args.components")
        self.ema = ema

    def configure_callbacks(self) -> list[pl.Callback]:
        return [self.ema] if self.ema is not None else []

    # ------------------------------------------------------------------ building
    def experts(self) -> dict[str, Any]:
        """The card's expert components that are present, by name."""
        parts = {Role.REFINER: self.llm, Role.GENERATOR: self.generator.expert}
        return {name: part for name, part in parts.items() if part is not None}

    def configure_model(self) -> None:
        if self.source is not None:
            return
        self.generator.build()
        if self.llm is not None:
            self.llm.build()
        for name, expert in self.experts().items():
            if name not in self.trained:
                # A frozen expert gets no gradients, so it can never change and its version never moves.
                expert.requires_grad_(False)
        if self.device_mesh is not None:
            # FSDP2: shard after LoRA is attached so the adapter is sharded with its block.
            shard_experts(self.experts(), self.trained, self.device_mesh["data_parallel"], self.reshard_after_forward)
            # ModelParallelStrategy loads module weights straight from the file, before
            # on_load_checkpoint can refill the trimmed frozen weights that configure_model rebuilt.
            self.strict_loading = False
        runs_lm = self.llm is not None and self.card.runs_loop(self.mode, Loop.DECODE)
        self.ar_decode = ARDecode(self.llm, self.rollout_config) if runs_lm else None
        self.diffusion_denoise = DiffusionDenoise(self.generator, self.rollout_config, self.generator_algorithm)
        self.eval_denoise = (
            self.diffusion_denoise
            if self.eval_config == self.rollout_config
            else DiffusionDenoise(self.generator, self.eval_config, self.generator_algorithm)
        )
        self.source = ExperienceSource(
            ar_decode=self.ar_decode,
            diffusion_denoise=self.diffusion_denoise,
            conditioning=self.conditioning,
            reward=self.reward_fn,
            advantages=self.advantage,
            ledger=self.ledger,
            trained={loop: self.card.owner(loop) in self.trained for loop in self.card.loops},
            owners={loop: self.card.owner(loop) for loop in self.card.loops},
            batch_std=self._global_std,
            drop_nonfinite=self.nonfinite_rewards == "drop",
            refiner_groups=self.llm_algorithm.train_groups,
            refiner_rewards=self.llm_algorithm.shape_rewards,
        )
        loops = {Loop.DENOISE: self.diffusion_denoise} | ({Loop.DECODE: self.ar_decode} if runs_lm else {})
        algorithms = {Loop.DENOISE: self.generator_algorithm, Loop.DECODE: self.llm_algorithm}
        algorithms = {loop: algorithms[loop] for loop in loops}
        experts = self.experts()
        for loop, algorithm in algorithms.items():
            owner = self.card.owner(loop)
            algorithm.bind(experts[owner], loops[loop], owner in self.trained)
            if owner in self.trained:
                algorithm.check_settings(self.losses[owner])
        self.policy = PolicyLosses(self.card, loops, experts, self.loss_settings, algorithms)
        check_edit_setup(self._trainer and getattr(self._trainer, "datamodule", None), self.generator, self.llm)

    def on_fit_start(self) -> None:
        data, world = getattr(self.trainer, "datamodule", None), self.trainer.world_size
        check_split(self.losses, self.trained, self.card, data, world)  # before the first rollout, not after it
        # trainer.log_dir is a collective (a broadcast): read it on every rank, write on rank 0 only.
        assert self.diffusion_denoise is not None, "configure_model() builds the loops"
        run_dir = Path(self.trainer.log_dir or self.trainer.default_root_dir)
        described = write_schedule(self.diffusion_denoise, run_dir, self.trainer.is_global_zero)
        sigmas = ", ".join(f"{s:.4g}" for s in described["sigmas"])
        message = f"Sampling schedule: {described['source']}; sigmas [{sigmas}]; SDE steps {described['sde_steps']}"
        # A recipe's shift that replaces the pipeline's own schedule is worth a warning, not a footnote.
        (rank_zero_warn if "overriding" in described["source"] else rank_zero_info)(message)

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        opts = []
        for name in self.trained:
            params = [p for p in self.experts()[name].parameters() if p.requires_grad]
            if not params:
                raise ValueError(f"expert {name!r} has no trainable parameters (is its LoRA attached?)")
            opts.append(self.optimizer_factories[name](params))
        return opts

    def loss_settings(self, name: str) -> ExpertLoss:
        """The policy-loss settings of expert ``name`` (gates read its clip range)."""
        return self.losses[name]

    # ------------------------------------------------------------------ rollout
    def _global_std(self, rewards: Tensor) -> Tensor | None:
        """The std of the global batch's rewards (all ranks); None on one process."""
        if self._trainer is None or self.trainer.world_size == 1:
            return None
        gathered = self.all_gather(rewards.to(self.device))
        return gathered.flatten().double().std(unbiased=False).cpu()

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        if self._trainer is not None and self.trainer.training and isinstance(batch, PromptBatch):
            assert self.source is not None and self.policy is not None, "configure_model() builds the experience source"
            # The algorithms' schedule (a sliding SDE window) must be in place before this step's rollout,
            # which runs here, ahead of every callback hook of the step.
            self.policy.begin_step(self.trainer.global_step)
            return self.source.collect(batch, self.device)
        return batch

    @torch.no_grad()
    def recompute_logprobs(self, exp: Experience) -> dict[str, tuple[Tensor, Tensor, Tensor]]:
        """(recomputed, behavior, mask) log-probs of each trained component's record under the current weights."""
        assert self.policy is not None, "configure_model() builds the losses"
        return self.policy.recompute(exp, self.trained)

    # ------------------------------------------------------------------ training
    def _loss(self, name: str, exp: Experience, weight: float = 1.0, rows: Rows | None = None) -> LossOutput | None:
        """Expert ``name``'s loss (of the mini-batch ``rows``); the terms it backpropagates itself (the DiT's per
        step, the LM's per micro-batch) are scaled by ``weight`` (``PolicyUpdate.token_weight``) as the returned
        loss would be."""
        assert self.policy is not None, "configure_model() builds the losses"
        return self.policy.loss(name, exp, backward=lambda term: self.manual_backward(weight * term), rows=rows)

    # Lightning's backward, reported as the ``backward`` phase (:mod:`unirl_pl.timing`).
    manual_backward = timing.timed("backward")(pl.LightningModule.manual_backward)

    def _check_staleness(self, exp: Experience) -> dict[str, float]:
        owners = {loop: self.card.owner(loop) for loop in exp.records}
        return check_staleness(exp.records, owners, self.ledger, self.on_stale)

    @timing.timed("train_glue")
    def training_step(self, exp: Experience, batch_idx: int) -> None:
        step = self.trainer.global_step  # the row of this RL step in metrics.csv, as the gates log it
        staleness = self._check_staleness(exp)
        opts = self.optimizers()
        opts = dict(zip(self.trained, opts if isinstance(opts, list) else [opts], strict=True))
        assert self.policy is not None
        updates, stepped, metrics = PolicyUpdate(self).run(exp, opts)
        for name in stepped:
            self.policy.end_step(name, step)
            metrics.update(update_metrics(name, updates[name]) if updates[name] else {})
        versions = self.ledger.as_dict()
        records = self.policy.rollout_metrics(exp)
        with timing.phase("logging"):
            self.reward_stats.update(exp)
            rewards = self.reward_stats.compute()  # the same on every rank: gathered and pooled
            self.reward_stats.reset()
            metrics.update(rollout_metrics(exp, versions, staleness, self.conditioning.hit_rate(), rewards, records))
            metrics["train/skipped_steps"] = float(self.skipped_steps)
            log_step(self.trainer, metrics, step, self.device, pooled=rewards)
            mean = torch.tensor(rewards["reward/mean"], dtype=torch.float32)
            self.log("reward/mean", mean, prog_bar=True, on_step=True, batch_size=len(exp.prompts))

    def position_label(self, name: str) -> str:
        """What a column of expert ``name``'s C2 values is (``token``, ``SDE step``, ``training point``)."""
        assert self.policy is not None, "configure_model() builds the losses"
        return self.policy.position(name)

    def describe_sample(self, name: str, exp: Experience, row: int) -> str:
        """Which sample row ``row`` of expert ``name``'s C2 values is (its prompt), for the gate's messages."""
        assert self.policy is not None, "configure_model() builds the losses"
        return self.policy.describe_row(name, exp, row)

    # ------------------------------------------------------------------ evaluation
    def serve(self, batch: PromptBatch) -> tuple[list[str], Tensor, list[str | None]]:
        """Refined prompts, pixels and raw replies on the deterministic serve path (greedy tokens, ODE), with the
        evaluation sampler's steps and guidance."""
        assert self.eval_denoise is not None, "configure_model() builds the loops"
        guided = self.eval_config.guided
        return serve(self.ar_decode, self.eval_denoise, self.conditioning, batch, guided)

    def _served(self, batch: PromptBatch) -> tuple[list[str], list[str], Tensor, WeightedSum]:
        """The real prompts (shard padding ran, every rank made the same forwards, but is not scored), their
        refinements and images, and the reward with their metadata and the refiner's replies bound to it."""
        refined, images, replies = self.serve(batch)
        n, metadata = batch.real, None if batch.metadata is None else batch.metadata[: batch.real]
        sources = None if batch.sources is None else [source.pixels for source in batch.real_sources]
        reward = WithMetadata(self.reward_fn, metadata, replies[:n], sources=sources)
        return batch.prompts[:n], refined[:n], images[:n], reward  # type: ignore[return-value]

    def validation_step(self, batch: PromptBatch, batch_idx: int) -> dict[str, Any] | None:
        prompts, refined, images, reward = self._served(batch)
        scores, total = validation_scores(reward, prompts, refined, images)
        self.val_metrics.update(scores)
        # Every rank logs every key, its shard's missing categories too: each metric's sum and count are summed
        # over ranks when the epoch's values are first read, so the all-gathers line up and N ranks equal one.
        for key, metric in self.val_metrics.items():
            self.log(f"val/{key}", metric, prog_bar=key == "reward_mean")
        # The first batch's pictures, for callbacks that show them (ValidationImages).
        pictures = {"prompts": prompts, "refined": refined, "images": images, "rewards": total.tolist()}
        return {**pictures, "sources": batch.real_sources} if batch_idx == 0 else None

    def predict_step(self, batch: PromptBatch, batch_idx: int) -> dict[str, Any]:
        prompts, refined, images, reward = self._served(batch)
        total, _ = reward(prompts, refined, images)
        out = {"prompts": prompts, "refined": refined, "images": images, "rewards": total.tolist()}
        return {**out, "sources": batch.real_sources}

    # ------------------------------------------------------------------ checkpoints
    def algorithms(self) -> dict[str, Any]:
        """The configured algorithms by their config key (their state is saved with the checkpoint)."""
        return {"generator_algorithm": self.generator_algorithm, "llm_algorithm": self.llm_algorithm}

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        save_run_state(self, checkpoint)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        load_run_state(self, checkpoint)
