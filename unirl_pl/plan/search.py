"""The search of the largest ``micro_batch_size`` that fits, by tracing.

The micro-batch only changes the DiT's rollout chunk and its update; the other phases are traced once
(:mod:`unirl_pl.plan.planner`). For each gradient-checkpointing setting the step is traced at
micro-batches 1 and 2, the largest candidate their straight line allows is traced, and the search steps
up or down by tracing until the largest candidate that fits is found: every verdict comes from a trace.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from unirl_pl.card import Role
from unirl_pl.loops import DiffusionDenoise
from unirl_pl.plan import phases
from unirl_pl.plan.models import FakeExperts
from unirl_pl.plan.recipe import StepRecipe
from unirl_pl.plan.step import PHASES, StepSizes, Tracer, experience, step_cond, train_step
from unirl_pl.plan.tracker import Usage

DIT_PHASES = ("dit_rollout", "dit_update")
"""The phases whose memory depends on the micro-batch."""


@dataclass
class Candidate:
    """One traced setting of the DiT's micro-batch and checkpointing.

    Args:
        micro_batch: ``model.rollout.micro_batch_size``.
        checkpointing: ``model.generator.init_args.gradient_checkpointing``.
        phases: Peak usage per phase at this setting (the micro-batch-independent ones included).
    """

    micro_batch: int
    checkpointing: bool
    phases: dict[str, Usage]

    @property
    def peak(self) -> tuple[str, Usage]:
        """The phase with the highest peak, and its usage."""
        name = max(self.phases, key=lambda n: self.phases[n].total)
        return name, self.phases[name]


def candidates_up_to(n: int, extra: list[int]) -> list[int]:
    """Powers of two up to ``n``, plus ``n`` and ``extra``: the micro-batches a search may trace."""
    values = {1 << i for i in range(int(math.log2(max(n, 1))) + 1)} | {n} | {m for m in extra if 1 <= m <= n}
    return sorted(values)


def set_checkpointing(experts: FakeExperts, on: bool) -> None:
    """Turn gradient checkpointing of every generator transformer on or off (diffusers' own switch)."""
    for model in experts.transformers():
        if on:
            model.enable_gradient_checkpointing()
        else:
            model.disable_gradient_checkpointing()


class MicroBatchSearch:
    """Traces the micro-batch-dependent phases per (micro_batch, checkpointing) and searches the largest
    micro-batch that fits; every traced setting is kept as a :class:`Candidate`."""

    def __init__(
        self,
        tracer: Tracer,
        experts: FakeExperts,
        recipe: StepRecipe,
        sizes: StepSizes,
        trained: list[str],
        fixed: dict[str, Any],
    ) -> None:
        self.tracer, self.experts, self.recipe, self.sizes, self.trained = tracer, experts, recipe, sizes, trained
        self.fixed = fixed
        self.candidates: list[Candidate] = []
        # The refiner's update, traced with the first setting: its graph's bytes and its peak.
        self.held_lm_graph = 0
        self.lm_update: Usage | None = None
        shape, rows = experts.generator.latent_shape, fixed["cond_rows"]
        self.dit_trained = Role.GENERATOR in trained
        base = {"cache", "cond"} | ({"lm_record"} if Role.REFINER in trained else set())
        base |= {"record"} if self.dit_trained else set()
        self.rollout_resident = experience(sizes, shape, rows, None, base)
        self.train_resident = experience(sizes, shape, rows, fixed["pixel_row"], base | {"images"})
        self.guided = recipe.rollout.guided

    def trace(self, micro_batch: int, checkpointing: bool, rollout: bool = False) -> Candidate:
        """Trace (once) the training step at this setting when the DiT trains, and the rollout chunk when
        ``rollout`` or when nothing else depends on the micro-batch. The search leaves the rollout out:
        the update's trace holds the same chunk's forward with gradients (and more resident experience),
        so it peaks above the rollout's; the reported settings are completed with it."""
        found = next(
            (c for c in self.candidates if (c.micro_batch, c.checkpointing) == (micro_batch, checkpointing)), None
        )
        rollout = rollout or not self.dit_trained
        if found is not None and (not rollout or "dit_rollout" in found.phases):
            return found
        set_checkpointing(self.experts, checkpointing)
        loop = DiffusionDenoise(self.experts.generator, self.recipe.rollout, self.recipe.generator_algorithm)
        usage = dict(self.fixed["usage"]) if found is None else dict(found.phases)
        tag = f"micro-batch {micro_batch}, checkpointing {'on' if checkpointing else 'off'}"
        if rollout:
            cond, uncond = step_cond(self.rollout_resident, micro_batch)
            with self.tracer.tracking(f"dit_rollout ({tag})", self.rollout_resident) as t:
                phases.dit_rollout_step(loop, cond, uncond if self.guided else None)
            usage["dit_rollout"] = t.peak()
        if found is not None:
            found.phases = {p: usage[p] for p in PHASES if p in usage}
            return found
        if self.dit_trained:
            resident = self.train_resident
            cond, uncond = step_cond(resident, micro_batch)
            record = phases.dit_record(
                loop,
                resident["prev"][:micro_batch, :1],
                resident["sample"][:micro_batch, :1],
                resident["old_logp"][:micro_batch, :1],
                cond,
                uncond if self.guided else None,
            )
            lm_trained = Role.REFINER in self.trained
            again = self.lm_update is not None
            with self.tracer.tracking(f"train step ({tag})", resident) as t:
                held = train_step(
                    self.tracer,
                    self.experts,
                    self.recipe,
                    resident,
                    (loop, record),
                    lm_trained,
                    t,
                    held_graph=self.held_lm_graph if again else None,
                )
            usage["dit_update"] = t.marks["dit_update"]
            if lm_trained:
                if not again:
                    self.lm_update, self.held_lm_graph = t.marks["lm_update"], held
                usage["lm_update"] = self.lm_update
            del record
        candidate = Candidate(micro_batch, checkpointing, {p: usage[p] for p in PHASES if p in usage})
        self.candidates.append(candidate)
        return candidate

    def largest(self, budget: int, checkpointing: bool, extra: list[int]) -> int | None:
        """The largest candidate micro-batch whose trace fits ``budget`` with this checkpointing setting
        (None when a phase that does not depend on it is over budget). The search follows the DiT phases'
        peak, which the micro-batch moves; the answer's rollout chunk is traced too, and a smaller
        candidate is taken if that does not fit."""
        values = candidates_up_to(self.sizes.images, extra)
        first = self.trace(values[0], checkpointing)
        if max((u.total for n, u in first.phases.items() if n not in DIT_PHASES), default=0) > budget:
            return None

        def dit_peak(m: int) -> int:
            found = self.trace(m, checkpointing)
            return max(u.total for n, u in found.phases.items() if n in DIT_PHASES)

        while values:
            found = largest_fitting(values, dit_peak, budget)
            if found is None or self.trace(found, checkpointing, rollout=True).peak[1].total <= budget:
                return found
            values = [m for m in values if m < found]
        return None


def largest_fitting(values: list[int], peak: Callable[[int], int], budget: int) -> int | None:
    """The largest of the sorted ``values`` whose ``peak`` (a trace, cached by the caller) is within
    ``budget``, assuming the peak grows with the value; None when the smallest does not fit.

    ``peak`` at the two smallest values gives a straight line; the search starts at the largest value the
    line keeps within budget and steps up while the next fits, or down until one fits, so the answer is
    always a traced value that fits next to a traced one that does not (or the end of ``values``).
    """
    if peak(values[0]) > budget:
        return None
    if len(values) == 1:
        return values[0]
    low, high = values[0], values[1]
    slope = (peak(high) - peak(low)) / (high - low)
    i = max(j for j, m in enumerate(values) if j == 0 or peak(low) + slope * (m - low) <= budget)
    if peak(values[i]) <= budget:
        while i + 1 < len(values) and peak(values[i + 1]) <= budget:
            i += 1
        return values[i]
    while i > 0 and peak(values[i - 1]) > budget:
        i -= 1
    return values[i - 1] if i > 0 else None
