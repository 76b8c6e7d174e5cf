"""The LightningModule: Lightning hooks that tie the card's experts, loops and method together.

Where each step goes: the experience source (:mod:`unirl_pl.method.experience`) runs rollout from
``on_after_batch_transfer``; ``training_step`` scores each trained component's records under the
current weights (:mod:`unirl_pl.method.grpo`), backpropagates and steps that expert's optimizer. The
loops are :mod:`unirl_pl.loops`, the conditioning :mod:`unirl_pl.conditioning`, the math
:mod:`unirl_pl.losses` and :mod:`unirl_pl.sampling`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from jsonargparse import lazy_instance
from lightning.pytorch.cli import OptimizerCallable
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor
from torch.distributed.tensor import DTensor

from unirl_pl import timing
from unirl_pl.algorithms import FlowGRPO, GeneratorAlgorithm, RefinerAlgorithm, TokenGRPO
from unirl_pl.callbacks.ema import EMA
from unirl_pl.callbacks.protocol import notify_policy_logprobs
from unirl_pl.card import Card
from unirl_pl.checkpoint import load_run_state, save_run_state
from unirl_pl.conditioning import Conditioner
from unirl_pl.data import PromptBatch
from unirl_pl.distributed import agree_max, shard_experts
from unirl_pl.evaluation import serve, validation_scores
from unirl_pl.experts import CausalLMExpert, TinyCausalLMExpert
from unirl_pl.generators import ComponentGenerator, FlowGenerator
from unirl_pl.loops import ARDecode, DiffusionDenoise, EvalSampler, RolloutConfig, write_schedule
from unirl_pl.losses import LossOutput
from unirl_pl.method import AdvantageConfig, ExpertLoss
from unirl_pl.method.experience import ExperienceSource
from unirl_pl.method.minibatch import minibatch_rows
from unirl_pl.method.policy import PolicyLosses, Rows
from unirl_pl.metrics import log_step, nonfinite_report, rollout_metrics, update_metrics
from unirl_pl.records import Experience
from unirl_pl.rewards import WeightedSum, registered_rewards
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
        rewards: Reward name (registry key or dotted path) -> weight; the weighted sum is the reward. Required.
        reward_args: Reward name -> keyword arguments for rewards that take some.
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
        reward_normalization: ``none``, or ``group``: each reward term is normalized within its prompt's
            group before the weighted sum the advantages come from (``reward/mean`` stays the raw sum).
        ema: An exponential moving average of the trained adapters (:class:`unirl_pl.callbacks.EMA`) that
            validation, predict and export use; the module hands it to the trainer as a callback, so a recipe
            overlay can switch it on (None: off).
    """

    def __init__(
        self,
        generator: ComponentGenerator | FlowGenerator = lazy_instance(ComponentGenerator),
        llm: CausalLMExpert | None = lazy_instance(TinyCausalLMExpert),
        pipeline_path: str | None = None,
        mode: Literal["joint", "prompt_only", "generator_only"] = "joint",
        rollout: RolloutConfig = RolloutConfig(),
        eval_sampler: EvalSampler = EvalSampler(),
        rewards: dict[str, float] | None = None,
        reward_args: dict[str, dict[str, Any]] | None = None,
        advantage: AdvantageConfig = AdvantageConfig(),
        llm_optimizer: OptimizerCallable = _default_llm_optimizer,
        transformer_optimizer: OptimizerCallable = _default_dit_optimizer,
        llm_loss: ExpertLoss = ExpertLoss(),
        transformer_loss: ExpertLoss = ExpertLoss(clip_eps=1e-4, beta=0.004),
        generator_algorithm: GeneratorAlgorithm = lazy_instance(FlowGRPO),
        llm_algorithm: RefinerAlgorithm = lazy_instance(TokenGRPO),
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
                "model.rewards is not set: name at least one reward with its weight, e.g. rewards: {brightness: 1.0}. "
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
        self.reward_fn = WeightedSum(
            rewards,
            reward_args,
            nonfinite="error" if nonfinite_rewards == "error" else "drop",
            normalize=reward_normalization,
        )
        self.nonfinite_rewards = nonfinite_rewards
        self.optimizer_factories = {"llm": llm_optimizer, "transformer": transformer_optimizer}
        self.losses = {"llm": llm_loss, "transformer": transformer_loss}
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
        self.ema = ema

    def configure_callbacks(self) -> list[pl.Callback]:
        return [self.ema] if self.ema is not None else []

    # ------------------------------------------------------------------ building
    def experts(self) -> dict[str, Any]:
        """The card's expert components that are present, by name."""
        parts = {"llm": self.llm, "transformer": self.generator.expert}
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
        runs_lm = self.llm is not None and self.card.runs_loop(self.mode, "ar_decode")
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
        loops = {"diffusion_denoise": self.diffusion_denoise} | ({"ar_decode": self.ar_decode} if runs_lm else {})
        algorithms = {"diffusion_denoise": self.generator_algorithm, "ar_decode": self.llm_algorithm}
        algorithms = {loop: algorithms[loop] for loop in loops}
        experts = self.experts()
        for loop, algorithm in algorithms.items():
            owner = self.card.owner(loop)
            algorithm.bind(experts[owner], loops[loop], owner in self.trained)
            if owner in self.trained:
                algorithm.check_settings(self.losses[owner])
        self.policy = PolicyLosses(self.card, loops, experts, self.loss_settings, algorithms)

    def on_fit_start(self) -> None:
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
        step, the LM's per micro-batch) are scaled by ``weight`` (:meth:`_token_weight`) as the returned loss
        would be."""
        assert self.policy is not None, "configure_model() builds the losses"
        return self.policy.loss(name, exp, backward=lambda term: self.manual_backward(weight * term), rows=rows)

    # Lightning's backward, reported as the ``backward`` phase (:mod:`unirl_pl.timing`).
    manual_backward = timing.timed("backward")(pl.LightningModule.manual_backward)

    def _check_staleness(self, exp: Experience) -> dict[str, float]:
        owners = {loop: self.card.owner(loop) for loop in exp.records}
        return check_staleness(exp.records, owners, self.ledger, self.on_stale)

    @timing.timed("optimizer")
    def _grad_norm(self, name: str) -> Tensor:
        grads = [p.grad for p in self.experts()[name].parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
        if isinstance(norm, DTensor):  # FSDP2: a partial norm; loggers and sync_dist need a plain tensor
            norm = norm.full_tensor()
        return norm.detach()

    @timing.timed("optimizer")
    def _step(self, name: str, opt: Any, counts_as_global_step: bool) -> None:
        clip = self.losses[name].grad_clip
        if clip is not None:
            self.clip_gradients(opt, gradient_clip_val=clip, gradient_clip_algorithm="norm")
        if counts_as_global_step:
            opt.step()
        else:
            # Lightning counts every LightningOptimizer.step() as a global step; one RL step (every expert,
            # every PPO epoch) must count once, so the others step through the strategy directly.
            self.trainer.strategy.optimizer_step(opt.optimizer, closure=lambda: None, model=self)
        self.ledger.bump(name)

    def _all_finite(self, outputs: dict[str, LossOutput], norms: dict[str, Tensor]) -> bool:
        """Whether every loss and gradient norm is finite on every rank (all ranks must agree to skip)."""
        values = [o.loss.detach() for o in outputs.values()] + list(norms.values())
        local_bad = not all(bool(torch.isfinite(v).all()) for v in values)
        return not agree_max(int(local_bad), self.device)

    def _skip(self, opts: dict[str, Any], outputs: dict[str, LossOutput], norms: dict[str, Tensor]) -> None:
        """Leave weights, optimizer state and versions untouched, but still count one global step."""
        self.skipped_steps += 1
        self.consecutive_skips += 1
        if self.consecutive_skips > self.max_consecutive_skips:
            bad = nonfinite_report({n: o.loss for n, o in outputs.items()}, norms)
            raise RuntimeError(
                f"{self.consecutive_skips} consecutive steps had a non-finite loss or gradient norm ({bad}); "
                "stopping. Check the rewards (model.nonfinite_rewards=drop drops bad samples), the learning rates "
                "and the data; raise model.max_consecutive_skips to tolerate more."
            )
        for opt in opts.values():
            opt.zero_grad(set_to_none=True)
        # With no gradients the optimizer leaves every parameter and its state alone; the step through
        # Lightning's wrapper keeps max_steps, the prompt stream and the gates counting RL steps.
        next(iter(opts.values())).step()

    @timing.timed("train_glue")
    def training_step(self, exp: Experience, batch_idx: int) -> None:
        step = self.trainer.global_step  # the row of this RL step in metrics.csv, as the gates log it
        staleness = self._check_staleness(exp)
        opts = self.optimizers()
        opts = dict(zip(self.trained, opts if isinstance(opts, list) else [opts], strict=True))
        assert self.policy is not None
        updates: dict[str, list[tuple[LossOutput, Tensor]]] = {name: [] for name in opts}
        stepped: list[str] = []  # the experts with an update applied this step (none when the step was skipped)
        reported = self._report_before_updates(exp, opts)
        first = True
        for epoch in range(self.ppo_epochs):
            splits = {name: self._mini_batches(name, exp, epoch) for name in opts}
            for u in range(max(len(s) for s in splits.values())):
                active = {n: o for n, o in opts.items() if u < len(splits[n]) and splits[n][u] != {}}
                applied = self._update(exp, active, {n: splits[n][u] for n in active}, first, reported, updates)
                if applied is None:  # not finite: the first update skips the step, a later one ends it
                    break
                if applied:
                    if first:
                        self.consecutive_skips, first = 0, False
                    stepped += [name for name in applied if name not in stepped]
            else:
                continue
            break
        for name in stepped:
            self.policy.end_step(name, step)
        metrics: dict[str, Tensor | float] = {}
        for name, done in updates.items():
            if done and name in stepped:
                metrics.update(update_metrics(name, done))
        versions = self.ledger.as_dict()
        records = self.policy.rollout_metrics(exp)
        metrics.update(rollout_metrics(exp, versions, staleness, self.conditioning.hit_rate(), records))
        metrics["train/skipped_steps"] = float(self.skipped_steps)
        with timing.phase("logging"):
            log_step(self.trainer, metrics, step, self.device)
            self.log(
                "reward/mean",
                exp.rewards.nanmean(),
                prog_bar=True,
                on_step=True,
                batch_size=len(exp.prompts),
                sync_dist=True,
            )

    def _update(
        self,
        exp: Experience,
        opts: dict[str, Any],
        rows: dict[str, Rows | None],
        first: bool,
        reported: bool,
        updates: dict[str, list[tuple[LossOutput, Tensor]]],
    ) -> list[str] | None:
        """One optimizer step of each expert in ``opts`` on its mini-batch ``rows`` (None: the whole record).

        Returns the experts that stepped, or None when a loss or gradient norm was not finite on some rank
        (the first update of a step then skips it: weights, optimizer state and versions untouched).
        """
        for opt in opts.values():
            opt.zero_grad(set_to_none=True)
        # Token-level LM loss: reweight so the ranks' averaged gradient is the global token mean.
        weights = {name: self._token_weight(name, exp, rows[name]) for name in opts}
        outputs = {n: out for n in opts if (out := self._loss(n, exp, weights[n], rows[n])) is not None}
        if not outputs:
            return []
        if first and not reported:
            self._report_policy_logprobs(exp, outputs)
        pending = [weights[n] * o.loss for n, o in outputs.items() if not o.backpropagated]
        if pending:
            self.manual_backward(sum(pending))
        norms = {name: self._grad_norm(name) for name in outputs}
        if not self._all_finite(outputs, norms):
            if first:
                self._skip(opts, outputs, norms)
            return None
        for i, name in enumerate(outputs):
            self._step(name, opts[name], counts_as_global_step=first and i == 0)
            updates[name].append((outputs[name], norms[name]))
        return list(outputs)

    def _mini_batches(self, name: str, exp: Experience, epoch: int) -> list[Rows | None]:
        """Expert ``name``'s mini-batches of this PPO epoch: ``[None]`` (the whole record) for one, else per
        mini-batch its loops' record rows (``{}`` where this rank holds no group of that mini-batch)."""
        count = self.losses[name].mini_batches
        assert self.policy is not None
        loops = self.policy.loops_with_records(name, exp)
        if count == 1 or not loops:
            return [None]
        parts: list[Rows] = [{} for _ in range(count)]
        for loop in loops:
            for j, index in enumerate(minibatch_rows(exp.row_requests[loop], count, exp.seed, epoch)):
                if len(index):
                    parts[j][loop] = index
        if self._trainer is not None and self.trainer.world_size > 1 and any(not part for part in parts):
            raise RuntimeError(
                f"model.{name}_loss.mini_batches={count}: a mini-batch holds none of this rank's prompt groups "
                "(every rank must step alike); use a multiple of mini_batches prompts per rank and keep every group"
            )
        return parts

    def _report_before_updates(self, exp: Experience, opts: dict[str, Any]) -> bool:
        """With mini-batches the first update sees only its own rows: the gates and the rollout correction's
        anchors get one no-grad recompute of every record before any update instead. Returns whether it ran."""
        assert self.policy is not None
        if all(self.losses[name].mini_batches == 1 for name in opts):
            return False
        self.policy.before_updates(exp, list(opts))
        gated = self._trainer is not None and any(hasattr(c, "on_policy_logprobs") for c in self.trainer.callbacks)
        corrected = any(self.losses[name].rollout_correction != "off" for name in opts)
        if not (gated or corrected):
            return True
        values = self.policy.recompute(exp, list(opts))
        self.policy.keep_anchors(exp, values)
        if gated:
            notify_policy_logprobs(self.trainer, self, exp, values)
        return True

    def _report_policy_logprobs(self, exp: Experience, outputs: dict[str, LossOutput]) -> None:
        """Hand the first training forward's log-probs (weights not yet stepped) to the gates that check them:
        the C2 identity's input is the recompute the loss already paid for, not a forward of its own."""
        if self._trainer is None or self.policy is None:
            return
        # A likelihood-free algorithm's gate values cost a forward of their own: only when a gate reads them.
        if any(hasattr(callback, "on_policy_logprobs") for callback in self.trainer.callbacks):
            notify_policy_logprobs(self.trainer, self, exp, self.policy.logprobs(exp, outputs))

    def _token_weight(self, name: str, exp: Experience, rows: Rows | None = None) -> float:
        assert self.policy is not None
        strategy = self._trainer.strategy if self._trainer is not None else None
        return self.policy.loss_weight(name, exp, strategy, rows)

    def position_label(self, name: str) -> str:
        """What a column of expert ``name``'s C2 values is (``token``, ``SDE step``, ``training point``)."""
        assert self.policy is not None, "configure_model() builds the losses"
        return self.policy.position(name)

    def describe_sample(self, name: str, exp: Experience, row: int) -> str:
        """Which sample row ``row`` of expert ``name``'s C2 values is (its prompt), for the gate's messages."""
        assert self.policy is not None, "configure_model() builds the losses"
        return self.policy.describe_row(name, exp, row)

    # ------------------------------------------------------------------ evaluation
    def serve(self, batch: PromptBatch) -> tuple[list[str], Tensor]:
        """Refined prompts and pixels on the deterministic serve path (greedy tokens, ODE), with the evaluation
        sampler's steps and guidance."""
        assert self.eval_denoise is not None, "configure_model() builds the loops"
        guided = self.eval_config.guided
        return serve(self.ar_decode, self.eval_denoise, self.conditioning, batch, guided)

    def validation_step(self, batch: PromptBatch, batch_idx: int) -> dict[str, Any] | None:
        refined, images = self.serve(batch)
        n = batch.real  # shard padding ran (every rank made the same forwards) but is not scored
        prompts, refined, images = batch.prompts[:n], refined[:n], images[:n]
        means, breakdown, total = validation_scores(self.reward_fn, prompts, refined, images)
        for name, value in means.items():
            self.log(f"val/reward_{name}", value, batch_size=n, sync_dist=True, prog_bar=name == "mean")
        # Weighted by each key's count, so the epoch mean is exact however batches mix categories. Keys
        # differ between ranks, so no sync: under DDP this is rank 0's shard.
        for key, mean, count in breakdown:
            self.log(f"val/{key}", mean, batch_size=count, sync_dist=False)
        # The first batch's pictures, for callbacks that show them (ValidationImages).
        pictures = {"prompts": prompts, "refined": refined, "images": images, "rewards": total.tolist()}
        return pictures if batch_idx == 0 else None

    def predict_step(self, batch: PromptBatch, batch_idx: int) -> dict[str, Any]:
        refined, images = self.serve(batch)
        n = batch.real
        prompts, refined, images = batch.prompts[:n], refined[:n], images[:n]
        total, _ = self.reward_fn(prompts, refined, images)
        return {"prompts": prompts, "refined": refined, "images": images, "rewards": total.tolist()}

    # ------------------------------------------------------------------ checkpoints
    def algorithms(self) -> dict[str, Any]:
        """The configured algorithms by their config key (their state is saved with the checkpoint)."""
        return {"generator_algorithm": self.generator_algorithm, "llm_algorithm": self.llm_algorithm}

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        save_run_state(self, checkpoint)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        load_run_state(self, checkpoint)
