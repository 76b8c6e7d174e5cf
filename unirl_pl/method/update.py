"""The optimizer updates of one RL step: ``ppo_epochs`` passes, each expert's mini-batches, one step each.

The LightningModule hands its optimizers and the step's experience to :class:`PolicyUpdate`; the losses come
from the module (:meth:`UniRLModule._loss`, which runs :class:`unirl_pl.method.policy.PolicyLosses`), the
backward, gradient clipping and optimizer steps go through Lightning (the module's ``manual_backward``,
``clip_gradients`` and the strategy), so DDP and FSDP2 see what they expect. What is updated when:

- each expert splits its records into ``<expert>_loss.mini_batches`` (:mod:`unirl_pl.method.minibatch`) per
  epoch, and update ``u`` steps every expert that has a mini-batch ``u``;
- the first update is on-policy: with one mini-batch its own forward feeds the C2 gate; with several, a
  no-grad recompute of every record before any update does (and anchors the rollout correction);
- a non-finite loss or gradient norm on any rank skips the whole step at the first update (weights,
  optimizer state and versions untouched, one global step counted) and ends the step's updates later on;
- one RL step is one trainer global step whatever the number of updates.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from unirl_pl import timing
from unirl_pl.card import Loop
from unirl_pl.distributed import agree_max
from unirl_pl.errors import ConfigError
from unirl_pl.losses import LossOutput
from unirl_pl.method.hooks import notify_policy_logprobs, reads_policy_logprobs
from unirl_pl.method.loss_settings import ExpertLoss
from unirl_pl.method.minibatch import minibatch_rows
from unirl_pl.method.policy import Rows
from unirl_pl.metrics import nonfinite_report
from unirl_pl.records import Experience

Updates = dict[str, list[tuple[LossOutput, Tensor]]]


def check_mini_batches(name: str, settings: ExpertLoss, groups: int, samples: int) -> None:
    """Refuse expert ``name``'s ``mini_batches`` when one rank's step cannot fill them: more than its ``groups``
    prompt groups (``group`` split) or its ``samples`` record rows (``sample`` split). Run when the fit starts,
    so the setting is refused before the first rollout, not found out as fewer updates than asked for."""
    count, split = settings.mini_batches, settings.mini_batch_split
    limit, what = (groups, "prompt groups") if split == "group" else (samples, "samples")
    if count > limit:
        raise ConfigError(
            f"model.{name}_loss.mini_batches={count} is more than the {limit} {what} one rank trains per step "
            f"(mini_batch_split: {split}); set it to at most {limit}, or raise data.prompts_per_step"
        )


"""Expert -> (loss output, gradient norm) of each update applied this step."""


def check_split(losses: dict[str, ExpertLoss], trained: list[str], card: Any, data: Any, world: int) -> None:
    """:func:`check_mini_batches` for each trained expert, from the data module's prompts per step and group
    layout (``card.loops_of`` says which record rows an expert trains); nothing to check without them."""
    layout, prompts = getattr(data, "layout", None), getattr(data, "prompts_per_step", None)
    if layout is None or prompts is None:
        return
    groups = prompts // world
    rows = {
        Loop.DECODE: groups * (layout.samples_per_prompt - layout.num_skip_refinement),
        Loop.DENOISE: groups * layout.samples_per_prompt * layout.images_per_refinement,
    }
    for name in trained:
        check_mini_batches(name, losses[name], groups, min(rows[loop] for loop in card.loops_of(name)))


@dataclass
class PolicyUpdate:
    """Runs the updates of one RL step for the module's trained experts (see the module docstring)."""

    module: Any
    metrics: dict[str, float] = field(default_factory=dict)
    """What the split adds to the step's metrics (``<expert>/trained_frac`` with the zero-advantage drop)."""

    def run(self, exp: Experience, opts: dict[str, Any]) -> tuple[Updates, list[str], dict[str, float]]:
        """Every update of ``exp``; returns each expert's applied updates, the experts that stepped and what the
        split adds to the step's metrics."""
        m = self.module
        updates: Updates = {name: [] for name in opts}
        stepped: list[str] = []  # the experts with an update applied this step (none when the step was skipped)
        reported = self.report_before_updates(exp, opts)
        first = True
        for epoch in range(m.ppo_epochs):
            splits = {name: self.mini_batches(name, exp, epoch) for name in opts}
            for u in range(max(len(s) for s in splits.values())):
                active = {n: o for n, o in opts.items() if u < len(splits[n]) and splits[n][u] != {}}
                applied = self.update(exp, active, {n: splits[n][u] for n in active}, first, reported, updates)
                if applied is None:  # not finite: the first update skips the step, a later one ends it
                    return updates, stepped, self.metrics
                if applied:
                    if first:
                        m.consecutive_skips, first = 0, False
                    stepped += [name for name in applied if name not in stepped]
        return updates, stepped, self.metrics

    def update(
        self,
        exp: Experience,
        opts: dict[str, Any],
        rows: dict[str, Rows | None],
        first: bool,
        reported: bool,
        updates: Updates,
    ) -> list[str] | None:
        """One optimizer step of each expert in ``opts`` on its mini-batch ``rows`` (None: the whole record).

        Returns the experts that stepped, or None when a loss or gradient norm was not finite on some rank
        (the first update of a step then skips it: weights, optimizer state and versions untouched).
        """
        m = self.module
        for opt in opts.values():
            opt.zero_grad(set_to_none=True)
        # Token-level LM loss: reweight so the ranks' averaged gradient is the global token mean.
        weights = {name: self.token_weight(name, exp, rows[name]) for name in opts}
        outputs = {n: out for n in opts if (out := m._loss(n, exp, weights[n], rows[n])) is not None}
        if not outputs:
            return []
        if first and not reported:
            self.report_policy_logprobs(exp, outputs)
        pending = [weights[n] * o.loss for n, o in outputs.items() if not o.backpropagated]
        if pending:
            m.manual_backward(sum(pending))
        norms = {name: self.grad_norm(name) for name in outputs}
        if not self.all_finite(outputs, norms):
            if first:
                self.skip(opts, outputs, norms)
            return None
        for i, name in enumerate(outputs):
            self.step(name, opts[name], counts_as_global_step=first and i == 0)
            updates[name].append((outputs[name], norms[name]))
        return list(outputs)

    def mini_batches(self, name: str, exp: Experience, epoch: int) -> list[Rows | None]:
        """Expert ``name``'s mini-batches of this PPO epoch: ``[None]`` (the whole record) for one, else per
        mini-batch its loops' record rows (``{}`` where this rank holds no row of that mini-batch)."""
        m = self.module
        settings = m.losses[name]
        count = settings.mini_batches
        loops = m.policy.loops_with_records(name, exp)
        if not settings.splits_rollout or not loops:
            return [None]
        parts: list[Rows] = [{} for _ in range(count)]
        for loop in loops:
            keep = None
            if settings.drop_zero_advantage:
                advantages = exp.advantages[loop]
                keep = advantages.reshape(len(advantages), -1).abs().sum(dim=1) != 0
            rows = minibatch_rows(exp.row_requests[loop], count, exp.seed, epoch, settings.mini_batch_split, keep)
            if epoch == 0 and keep is not None:
                trained = sum(len(index) for index in rows)
                self.metrics[f"{name}/trained_frac"] = trained / max(len(keep), 1)
            for j, index in enumerate(rows):
                if len(index):
                    parts[j][loop] = index
        if m._trainer is not None and m.trainer.world_size > 1 and any(not part for part in parts):
            raise RuntimeError(
                f"model.{name}_loss.mini_batches={count}: a mini-batch holds none of this rank's prompt groups "
                "(every rank must step alike); use a multiple of mini_batches prompts per rank and keep every group"
            )
        return parts

    def gated(self) -> bool:
        """Whether a callback reads the policy log-probs (the C2 gate)."""
        return reads_policy_logprobs(self.module._trainer)

    def report_before_updates(self, exp: Experience, opts: dict[str, Any]) -> bool:
        """With mini-batches the first update sees only its own rows: the gates and the rollout correction's
        anchors get one no-grad recompute of every record before any update instead. Returns whether it ran."""
        m = self.module
        if not any(m.losses[name].splits_rollout for name in opts):
            return False
        m.policy.before_updates(exp, list(opts))
        gated = self.gated()
        if not (gated or any(m.losses[name].rollout_correction != "off" for name in opts)):
            return True
        values = m.policy.recompute(exp, list(opts))
        m.policy.keep_anchors(exp, values)
        if gated:
            notify_policy_logprobs(m.trainer, m, exp, values)
        return True

    def report_policy_logprobs(self, exp: Experience, outputs: dict[str, LossOutput]) -> None:
        """Hand the first training forward's log-probs (weights not yet stepped) to the gates that check them:
        the C2 identity's input is the recompute the loss already paid for, not a forward of its own."""
        # A likelihood-free algorithm's gate values cost a forward of their own: only when a gate reads them.
        if self.gated():
            m = self.module
            notify_policy_logprobs(m.trainer, m, exp, m.policy.logprobs(exp, outputs))

    def token_weight(self, name: str, exp: Experience, rows: Rows | None = None) -> float:
        """The factor on expert ``name``'s loss that makes the ranks' averaged gradient the global one."""
        m = self.module
        strategy = m._trainer.strategy if m._trainer is not None else None
        return m.policy.loss_weight(name, exp, strategy, rows)

    @timing.timed("optimizer")
    def grad_norm(self, name: str) -> Tensor:
        """Expert ``name``'s gradient norm (whole, under FSDP2 too)."""
        grads = [p.grad for p in self.module.experts()[name].parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
        if isinstance(norm, DTensor):  # FSDP2: a partial norm; loggers and sync_dist need a plain tensor
            norm = norm.full_tensor()
        return norm.detach()

    @timing.timed("optimizer")
    def step(self, name: str, opt: Any, counts_as_global_step: bool) -> None:
        """Clip expert ``name``'s gradient, step its optimizer and bump its weight version."""
        m = self.module
        clip = m.losses[name].grad_clip
        if clip is not None:
            m.clip_gradients(opt, gradient_clip_val=clip, gradient_clip_algorithm="norm")
        if counts_as_global_step:
            opt.step()
        else:
            # Lightning counts every LightningOptimizer.step() as a global step; one RL step (every expert,
            # every update) must count once, so the others step through the strategy directly.
            m.trainer.strategy.optimizer_step(opt.optimizer, closure=lambda: None, model=m)
        m.ledger.bump(name)

    def all_finite(self, outputs: dict[str, LossOutput], norms: dict[str, Tensor]) -> bool:
        """Whether every loss and gradient norm is finite on every rank (all ranks must agree to skip)."""
        values = [o.loss.detach() for o in outputs.values()] + list(norms.values())
        local_bad = not all(bool(torch.isfinite(v).all()) for v in values)
        return not agree_max(int(local_bad), self.module.device)

    def skip(self, opts: dict[str, Any], outputs: dict[str, LossOutput], norms: dict[str, Tensor]) -> None:
        """Leave weights, optimizer state and versions untouched, but still count one global step."""
        m = self.module
        m.skipped_steps += 1
        m.consecutive_skips += 1
        if m.consecutive_skips > m.max_consecutive_skips:
            bad = nonfinite_report({n: o.loss for n, o in outputs.items()}, norms)
            raise RuntimeError(
                f"{m.consecutive_skips} consecutive steps had a non-finite loss or gradient norm ({bad}); "
                "stopping. Check the rewards (model.nonfinite_rewards=drop drops bad samples), the learning rates "
                "and the data; raise model.max_consecutive_skips to tolerate more."
            )
        for opt in opts.values():
            opt.zero_grad(set_to_none=True)
        # With no gradients the optimizer leaves every parameter and its state alone; the step through
        # Lightning's wrapper keeps max_steps, the prompt stream and the gates counting RL steps.
        next(iter(opts.values())).step()
