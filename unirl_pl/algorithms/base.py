"""What an algorithm is: how one trained expert learns from its loop's records.

An algorithm states what the rollout must record for it (:meth:`GeneratorAlgorithm.plan`: which denoising
steps of each sample are stochastic, with which step, possibly as a function of the training step), its loss
on that record (:meth:`Algorithm.loss`), what the C2 gate checks for it (:meth:`Algorithm.gate_values`: the
recomputed and recorded behavior log-probs of a likelihood method, or the identity a likelihood-free method
has instead) and its schedule over training steps (:meth:`Algorithm.begin_step`, :meth:`Algorithm.end_step`).
The LightningModule, the policy losses and the gates only call these methods; adding an algorithm is one file
in this package, a recipe overlay and its tests.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor

from unirl_pl.algorithms.drivers import LossInputs, add_part, weighted_loss
from unirl_pl.distributed import token_loss_weight
from unirl_pl.loops.config import RolloutConfig, SampleRequest, StepPlan, chunk_bounds
from unirl_pl.losses import LossOutput
from unirl_pl.records import Experience

Backward = Callable[[Tensor], None]
"""Backpropagates one loss term as soon as it is built (the DiT's per-step backward)."""

GateValues = tuple[Tensor, Tensor, Tensor]
"""``(recomputed, recorded, mask)``, each (rows, positions): what the C2 gate compares for one record."""


class Algorithm:
    """The methods every algorithm has; the defaults are those of an on-policy method without state.

    Subclasses set ``position`` (what a column of the gate's values is, for its messages) and implement
    :meth:`loss` and :meth:`gate_values`.
    """

    position = "position"
    likelihood = True
    phase = "loss"  # the unirl_pl.timing phase its loss is reported as (the bench's lm_loss / dit_loss rows)

    def bind(self, expert: Any, loop: Any, trained: bool) -> None:
        """Called once the expert is built and its loop exists; ``trained`` says whether the mode updates it.

        Checks the loop's settings (:meth:`check_rollout`); a subclass that keeps something of the expert
        calls this one too.
        """
        self.check_rollout(loop.config, trained)

    def check_rollout(self, config: RolloutConfig, trained: bool) -> None:
        """Raise ``ValueError`` for rollout settings this algorithm cannot run with (``trained``: whether the mode
        updates its expert). The module calls it when it is built from the recipe, before any model loads, so
        the command line refuses the recipe in one line; :meth:`bind` calls it again."""

    def check_settings(self, settings: Any) -> None:
        """Raise ``ValueError`` if the expert's loss settings (``ExpertLoss``) make no sense for this algorithm."""

    def begin_step(self, step: int) -> None:
        """Called with the trainer's global step before that step's rollout (the schedule hook)."""

    def end_step(self, step: int) -> None:
        """Called after step ``step``'s optimizer updates were applied (not on a skipped step)."""

    def before_updates(self, loop: Any, record: Any) -> None:
        """Called with the whole record before the first update of a step whose expert trains in several
        mini-batches: keep here what the loss needs of the old policy for every row (the loss is then called
        on mini-batches, ``LossInputs.whole`` and ``LossInputs.index`` saying which rows)."""

    def loss(self, inputs: LossInputs, backward: Backward | None = None) -> LossOutput:
        """The loss of ``inputs.record`` under the current weights, with the expert's ``inputs.settings``.

        ``backward``, when given, may be called on each term as soon as it is built (the returned loss is
        then marked ``backpropagated``); ``inputs.anchor`` is the first PPO epoch's recomputed log-probs when
        a rollout correction is on.
        """
        raise NotImplementedError

    def gate_values(self, loop: Any, record: Any, out: LossOutput | None) -> GateValues:
        """What the C2 gate compares: from the loss's first forward ``out`` when it has them, else recomputed."""
        raise NotImplementedError

    def loss_weight(self, record: Any, strategy: Any) -> float:
        """Factor on a not yet backpropagated loss so that the ranks' averaged gradient is the global one."""
        return 1.0

    def metrics(self, name: str, record: Any) -> dict[str, Tensor | float]:
        """Per-step metrics of expert ``name``'s record (logged with the rollout's)."""
        return {}

    def describe_row(self, exp: Experience, record: Any, row: int) -> str:
        """Which sample row ``row`` of the gate's values is, for its messages."""
        return f"prompt {exp.prompts[row]!r}, refined {exp.refined[row]!r}"

    def state_dict(self) -> dict[str, Any]:
        """State that a resumed run needs to continue exactly (saved in the checkpoint)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""


class GeneratorAlgorithm(Algorithm):
    """An algorithm of the generator (the ``diffusion_denoise`` loop).

    A likelihood method returns the :class:`StepPlan` of one rollout from :meth:`plan`; the loop runs it and
    records its stochastic steps (a ``DiTRecord``). A method that records something else overrides
    :meth:`rollout` and runs the loop itself.
    """

    position = "SDE step"
    phase = "dit_loss"

    def plan(self, config: RolloutConfig, seed: int, request_ids: list[int], sample_indices: list[int]) -> StepPlan:
        """The stochastic steps of one rollout of these samples."""
        raise NotImplementedError

    def rollout(self, loop: Any, request: SampleRequest) -> tuple[Tensor, Any]:
        """Latents and the behavior record of one ``rollout``-profile sampling (the loop's ``run`` of :meth:`plan`)."""
        plan = self.plan(loop.config, request.seed, list(request.request_ids), list(request.sample_indices))
        return loop.run(request, plan)

    def describe(self, config: RolloutConfig) -> dict[str, Any]:
        """What ``schedule.json`` says about the algorithm: ``sde_steps``, the trained denoising steps."""
        raise NotImplementedError

    def least_steps(self, config: RolloutConfig) -> int:
        """The fewest denoising steps a rollout request may run."""
        raise NotImplementedError

    def gate_values(self, loop: Any, record: Any, out: LossOutput | None) -> GateValues:
        """The recomputed and recorded log-prob of every recorded step; every step is real."""
        recomputed = out.logp if out is not None and out.logp is not None else loop.score(record)
        return recomputed, record.old_logp, torch.ones_like(record.old_logp, dtype=torch.bool)


class RefinerAlgorithm(Algorithm):
    """An algorithm of the prompt refiner (the ``ar_decode`` loop): the gate compares per-token log-probs.

    Subclasses implement :meth:`chunk_loss` (the loss of some refinements, a mean over their aggregation
    units) and :meth:`units`; :meth:`loss` runs it over ``rollout.lm_micro_batch_size`` refinements at a time
    and, with ``backward``, backpropagates each chunk before the next is built: only one chunk's logits and
    graph are alive, and none is left when the generator's update starts.
    """

    position = "token"
    phase = "lm_loss"

    def check_settings(self, settings: Any) -> None:
        """Refuse a generator-only loss setting: ``kl_form`` picks the form of the DiT's KL of SDE-step means,
        and the refiner's KL is the k3 of its token log-probs whatever it says (accepting it would look like it
        changed something)."""
        form = getattr(settings, "kl_form", "flow_grpo")
        if form != "flow_grpo":
            raise ValueError(
                f"model.llm_loss.kl_form={form!r}: kl_form sets the generator's KL of SDE-step means "
                "(model.transformer_loss.kl_form); the refiner's KL is the k3 of token log-probs: leave it 'flow_grpo'"
            )

    def train_groups(self, text_rewards: Tensor, groups: Tensor) -> Tensor | None:
        """Which prompt groups of the step's rollout the refiner trains on: a (P,) bool mask over the groups
        ``0..P-1``, given every text sample's reward and its group; None (the default) trains on all. Called
        once per step after the rewards, before the record reaches the loss and the gates."""
        return None

    def shape_rewards(self, text_rewards: Tensor, record: Any) -> Tensor | None:
        """The rewards the refiner's advantages come from: given every text sample's (P*K,) reward and the
        step's refiner record (``record.rows`` its text samples), a (P*K,) tensor that replaces them for the
        refiner's advantages only (grouped by prompt as before; the generator's advantages, the logged reward
        and :meth:`train_groups` keep the reward); None (the default) keeps the reward. Called once per step
        after the rewards."""
        return None

    def units(self, record: Any) -> Tensor:
        """The loss's aggregation units per row, as a mask whose sum counts them: (R, T) real tokens for a
        token mean, (R,) refinements with a real token for a mean over refinements."""
        return record.gen_mask

    def chunk_loss(self, inputs: LossInputs) -> LossOutput:
        """The loss of the rows of ``inputs.record`` (its mean over their :meth:`units`), with ``logp`` set to
        the detached recomputed token log-probs."""
        raise NotImplementedError

    def loss(self, inputs: LossInputs, backward: Backward | None = None) -> LossOutput:
        record = inputs.record
        size = inputs.loop.config.lm_micro_batch_size
        if size is None:  # one forward; the caller backpropagates the returned loss
            return self.chunk_loss(inputs)
        bounds = chunk_bounds(record.input_ids.shape[0], size)
        per_row = self.units(record).reshape(record.input_ids.shape[0], -1).sum(1).double()
        # Every chunk's share in one device-to-host copy, not one sync per chunk.
        shares = (torch.stack([per_row[a:b].sum() for a, b in bounds]) / per_row.sum().clamp_min(1)).tolist()
        parts: list[tuple[float, LossOutput]] = []
        for (a, b), share in zip(bounds, shares, strict=True):
            add_part(parts, share, self.chunk_loss(inputs.rows(a, b)), backward)
        logp = torch.cat([out.logp for _, out in parts])
        return replace(weighted_loss(parts, backpropagated=backward is not None), logp=logp)

    def loss_weight(self, record: Any, strategy: Any) -> float:
        # The ranks' averaged gradient is the global mean over the aggregated units.
        return token_loss_weight(self.units(record), strategy)

    def gate_values(self, loop: Any, record: Any, out: LossOutput | None) -> GateValues:
        """The recomputed and recorded log-prob of every generated token, masked to the real ones."""
        recomputed = out.logp if out is not None and out.logp is not None else loop.score(record)
        return recomputed, record.old_logp, record.gen_mask

    def metrics(self, name: str, record: Any) -> dict[str, Tensor | float]:
        """The mean number of generated tokens per refinement."""
        return {f"{name}/response_tokens": record.gen_mask.sum(1).float().mean()}

    def describe_row(self, exp: Experience, record: Any, row: int) -> str:
        """The user prompt of the refinement in row ``row`` (record rows are the refined text samples)."""
        text_row = int(record.rows[row])
        images = (exp.text_index == text_row).nonzero()
        prompt = exp.prompts[int(images[0])] if len(images) else "?"
        return f"prompt {prompt!r}"


def check_algorithms(
    algorithms: dict[str, Algorithm], trained: list[str], rollout: RolloutConfig, losses: dict[str, Any]
) -> None:
    """Raise ``ValueError`` for settings an algorithm cannot run with: each one's :meth:`~Algorithm.check_rollout`
    (``algorithms``: by the expert it trains, each of a loop the mode runs) and, for a trained expert, its
    :meth:`~Algorithm.check_settings` of ``losses[expert]``. The module calls it when it is built from the recipe."""
    for owner, algorithm in algorithms.items():
        algorithm.check_rollout(rollout, owner in trained)
        if owner in trained:
            algorithm.check_settings(losses[owner])
