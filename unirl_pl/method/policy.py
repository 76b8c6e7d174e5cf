"""The card-driven policy losses of one step: for each trained component, each of its loops' records.

On the unified card every expert trains through one loop (the LM through ``ar_decode``, the generator
through ``diffusion_denoise``); a mixture-of-transformers card binds one component to both loops and its
losses add. Nothing here names an expert or a loop: the card says which loop a component trains through,
and each loop's algorithm (:mod:`unirl_pl.algorithms`) builds its loss and says what the C2 gate checks.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor

from unirl_pl import timing
from unirl_pl.algorithms.drivers import LossInputs, weighted_loss
from unirl_pl.card import Card
from unirl_pl.losses import LossOutput
from unirl_pl.method.loss_settings import ExpertLoss
from unirl_pl.records import Experience

LogProbs = dict[str, tuple[Tensor, Tensor, Tensor]]
"""Component -> (recomputed, behavior, mask) log-probs of its record."""

Rows = dict[str, Tensor]
"""Loop -> the record rows (1-D long) of one training mini-batch."""


@dataclass
class PolicyLosses:
    """Scores each trained component's records under the current weights and builds its loss.

    Args:
        card: Which loops each component trains through.
        loops: Loop name -> the built loop (``ar_decode`` may be absent when the mode never runs it).
        experts: Component -> the expert (its ``adapter_disabled`` is the KL reference).
        settings: Component name -> its policy-loss settings (read at every step, so a changed setting applies).
        algorithms: Loop name -> the algorithm that trains that loop's records.

    With a rollout correction on, the first loss call on a record (the first PPO epoch, weights not yet
    stepped) keeps its recomputed log-probs as the record's "old" log-probs; later calls on the same record
    (``ppo_epochs > 1``) anchor their ratio and importance weights at them. The record is held by a weak
    reference only, so a finished step's record is freed as usual.
    """

    card: Card
    loops: dict[str, Any]
    experts: dict[str, Any]
    settings: Callable[[str], ExpertLoss]
    algorithms: dict[str, Any]
    _anchors: dict[str, tuple[weakref.ref, Tensor]] = field(default_factory=dict, init=False, repr=False)
    _taken: dict[str, tuple[Any, Tensor, Any]] = field(default_factory=dict, init=False, repr=False)

    def loops_with_records(self, name: str, exp: Experience) -> list[str]:
        """The loops component ``name`` trains through that captured a record in ``exp``."""
        return [loop for loop in self.card.loops_of(name) if loop in exp.records]

    def loss(
        self, name: str, exp: Experience, backward: Callable[[Tensor], None], rows: Rows | None = None
    ) -> LossOutput | None:
        """Component ``name``'s loss on ``exp`` (on the record rows ``rows[loop]`` of a mini-batch, when given);
        the DiT's is backpropagated per denoising step through ``backward`` (peak memory holds one step's
        graph, not the window's)."""
        outputs = []
        for loop in self.loops_with_records(name, exp):
            record, advantages, settings = exp.records[loop], exp.advantages[loop], self.settings(name)
            algorithm = self.algorithms[loop]
            algorithm.check_settings(settings)
            reference = self.experts[name].adapter_disabled
            anchor = self.anchor(loop, record)
            whole, index = record, None
            if rows is not None and loop in rows:
                index = rows[loop]
                record, advantages = (
                    self._take(loop, record, index, keep=False),
                    advantages[index.to(advantages.device)],
                )
                anchor = None if anchor is None else anchor[index.to(anchor.device)]
            inputs = LossInputs(self.loops[loop], record, advantages, settings, reference, anchor, whole, index)
            with timing.phase(getattr(algorithm, "phase", "loss")):
                out = algorithm.loss(inputs, backward)
            if settings.rollout_correction != "off" and anchor is None and out.logp is not None and index is None:
                self._anchors[loop] = (weakref.ref(record), out.logp)
            outputs.append(out)
        if not outputs:
            return None
        return outputs[0] if len(outputs) == 1 else sum_losses(outputs)

    @torch.no_grad()
    def before_updates(self, exp: Experience, names: list[str]) -> None:
        """Each algorithm's look at its whole record before any update of a step split into mini-batches (what
        it keeps of the old policy, such as GRPO-Guard's step means, must come from unchanged weights)."""
        for name in names:
            for loop in self.loops_with_records(name, exp):
                self.algorithms[loop].before_updates(self.loops[loop], exp.records[loop])

    def keep_anchors(self, exp: Experience, values: LogProbs) -> None:
        """Anchor every corrected likelihood record of ``exp`` at ``values`` (a no-grad recompute before any
        update): with mini-batches the first loss call on most rows comes after an update, too late to be the
        "old" policy."""
        for name, (recomputed, _, _) in values.items():
            if self.settings(name).rollout_correction == "off":
                continue
            for loop in self.loops_with_records(name, exp):
                if getattr(self.algorithms[loop], "likelihood", True):
                    self._anchors[loop] = (weakref.ref(exp.records[loop]), recomputed)

    def _take(self, loop: str, record: Any, index: Tensor, keep: bool) -> Any:
        """``record.take(index)``, built once per update: the loss weight (``keep``) and then the loss of the
        same mini-batch share it (a DiT record's rows are whole latents per step); the loss lets it go."""
        kept = self._taken.pop(loop, None)
        sub = kept[2] if kept is not None and kept[0] is record and kept[1] is index else record.take(index)
        if keep:
            self._taken[loop] = (record, index, sub)
        return sub

    def anchor(self, loop: str, record: Any) -> Tensor | None:
        """The log-probs the first loss call on ``record`` recomputed (None before it, or for another record)."""
        kept = self._anchors.get(loop)
        return kept[1] if kept is not None and kept[0]() is record else None

    def logprobs(self, exp: Experience, outputs: dict[str, LossOutput]) -> LogProbs:
        """What the C2 gate compares per component: the log-probs the losses were built from with the records'
        behavior log-probs and masks (or, for a likelihood-free algorithm, its own identity)."""
        found = {}
        for name, out in outputs.items():
            loops = self.loops_with_records(name, exp)
            if len(loops) == 1:
                found[name] = self.algorithms[loops[0]].gate_values(self.loops[loops[0]], exp.records[loops[0]], out)
        return found

    @torch.no_grad()
    def recompute(self, exp: Experience, trained: list[str]) -> LogProbs:
        """Every trained component's gate values recomputed under the current weights (a forward of its own)."""
        found = {}
        for name in trained:
            for loop in self.loops_with_records(name, exp):
                found[name] = self.algorithms[loop].gate_values(self.loops[loop], exp.records[loop], None)
        return found

    def loss_weight(self, name: str, exp: Experience, strategy: Any, rows: Rows | None = None) -> float:
        """The factor on component ``name``'s not yet backpropagated loss (of the mini-batch ``rows``, when
        given) that makes the ranks' averaged gradient the global one (the LM's tokens); 1 on one process."""
        weights = []
        for loop in self.loops_with_records(name, exp):
            record = exp.records[loop]
            if rows is not None and loop in rows:
                record = self._take(loop, record, rows[loop], keep=True)
            weights.append(self.algorithms[loop].loss_weight(record, strategy))
        return math.prod(weights)

    def rollout_metrics(self, exp: Experience) -> dict[str, Tensor | float]:
        """Each recorded loop's algorithm's metrics of its record, named by the loop's owner."""
        metrics: dict[str, Tensor | float] = {}
        for loop, record in exp.records.items():
            metrics.update(self.algorithms[loop].metrics(self.card.owner(loop), record))
        return metrics

    def position(self, name: str) -> str:
        """What a column of component ``name``'s gate values is (``token``, ``SDE step``, ...)."""
        return " / ".join(dict.fromkeys(self.algorithms[loop].position for loop in self.card.loops_of(name)))

    def describe_row(self, name: str, exp: Experience, row: int) -> str:
        """Which sample row ``row`` of component ``name``'s gate values is."""
        loops = self.loops_with_records(name, exp)
        if not loops:
            return "?"
        return self.algorithms[loops[0]].describe_row(exp, exp.records[loops[0]], row)

    def begin_step(self, step: int) -> None:
        """Every algorithm's schedule hook, before step ``step``'s rollout."""
        for algorithm in self.algorithms.values():
            algorithm.begin_step(step)

    def end_step(self, name: str, step: int) -> None:
        """The algorithms of component ``name``'s loops, after its update of step ``step`` was applied."""
        for loop in self.card.loops_of(name):
            if loop in self.algorithms:
                self.algorithms[loop].end_step(step)


def sum_losses(outputs: list[LossOutput]) -> LossOutput:
    """One expert trained by several loops: the losses add, the statistics are the loops' means."""
    merged = weighted_loss([(1.0 / len(outputs), o) for o in outputs])
    n = float(len(outputs))
    return replace(merged, loss=sum(o.loss for o in outputs), pg_loss=merged.pg_loss * n, kl=merged.kl * n)
