"""The card-driven policy losses of one step: for each trained component, each of its loops' records.

On the unified card every expert trains through one loop (the LM through ``ar_decode``, the generator
through ``diffusion_denoise``); a mixture-of-transformers card binds one component to both loops and its
losses add. Nothing here names an expert: the card says which loop a component trains through.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor

from unirl_pl.card import Card
from unirl_pl.loops import ARDecode, DiffusionDenoise
from unirl_pl.losses import LossOutput
from unirl_pl.method.grpo import ExpertLoss, dit_loss, lm_loss, weighted_loss
from unirl_pl.records import DiTRecord, Experience, LMRecord

LogProbs = dict[str, tuple[Tensor, Tensor, Tensor]]
"""Component -> (recomputed, behavior, mask) log-probs of its record."""


@dataclass
class PolicyLosses:
    """Scores each trained component's records under the current weights and builds its loss.

    Args:
        card: Which loops each component trains through.
        loops: Loop name -> the built loop (``ar_decode`` may be absent when the mode never runs it).
        experts: Component -> the expert (its ``adapter_disabled`` is the KL reference).
        settings: Component name -> its policy-loss settings (read at every step, so a changed setting applies).

    With a rollout correction on, the first loss call on a record (the first PPO epoch, weights not yet
    stepped) keeps its recomputed log-probs as the record's "old" log-probs; later calls on the same record
    (``ppo_epochs > 1``) anchor their ratio and importance weights at them. The record is held by a weak
    reference only, so a finished step's record is freed as usual.
    """

    card: Card
    loops: dict[str, ARDecode | DiffusionDenoise]
    experts: dict[str, Any]
    settings: Callable[[str], ExpertLoss]
    _anchors: dict[str, tuple[weakref.ref, Tensor]] = field(default_factory=dict, init=False, repr=False)

    def loops_with_records(self, name: str, exp: Experience) -> list[str]:
        """The loops component ``name`` trains through that captured a record in ``exp``."""
        return [loop for loop in self.card.loops_of(name) if loop in exp.records]

    def loss(self, name: str, exp: Experience, backward: Callable[[Tensor], None]) -> LossOutput | None:
        """Component ``name``'s loss on ``exp``; the DiT's is backpropagated per denoising step through
        ``backward`` (peak memory holds one step's graph, not the window's)."""
        outputs = []
        for loop in self.loops_with_records(name, exp):
            record, settings = exp.records[loop], self.settings(name)
            args = (self.loops[loop], record, exp.advantages[loop], settings)
            reference = self.experts[name].adapter_disabled
            anchor = self.anchor(loop, record)
            if loop == "diffusion_denoise":
                out = dit_loss(*args, reference, backward=backward, anchor=anchor)
            else:
                out = lm_loss(*args, reference, anchor=anchor)
            if settings.rollout_correction != "off" and anchor is None and out.logp is not None:
                self._anchors[loop] = (weakref.ref(record), out.logp)
            outputs.append(out)
        if not outputs:
            return None
        return outputs[0] if len(outputs) == 1 else sum_losses(outputs)

    def anchor(self, loop: str, record: LMRecord | DiTRecord) -> Tensor | None:
        """The log-probs the first loss call on ``record`` recomputed (None before it, or for another record)."""
        kept = self._anchors.get(loop)
        return kept[1] if kept is not None and kept[0]() is record else None

    def logprobs(self, exp: Experience, outputs: dict[str, LossOutput]) -> LogProbs:
        """The log-probs the losses were built from, with the records' behavior log-probs and masks."""
        found = {}
        for name, out in outputs.items():
            loops = self.loops_with_records(name, exp)
            if out.logp is not None and len(loops) == 1:
                found[name] = (out.logp, *_behavior(exp, loops[0]))
        return found

    @torch.no_grad()
    def recompute(self, exp: Experience, trained: list[str]) -> LogProbs:
        """Every trained component's record re-scored under the current weights (a forward of its own)."""
        found = {}
        for name in trained:
            for loop in self.loops_with_records(name, exp):
                found[name] = (self.loops[loop].score(exp.records[loop]), *_behavior(exp, loop))
        return found


def _behavior(exp: Experience, loop: str) -> tuple[Tensor, Tensor]:
    record = exp.records[loop]
    mask = getattr(record, "gen_mask", None)
    return record.old_logp, torch.ones_like(record.old_logp, dtype=torch.bool) if mask is None else mask


def sum_losses(outputs: list[LossOutput]) -> LossOutput:
    """One expert trained by several loops: the losses add, the statistics are the loops' means."""
    merged = weighted_loss([(1.0 / len(outputs), o) for o in outputs])
    n = float(len(outputs))
    return replace(merged, loss=sum(o.loss for o in outputs), pg_loss=merged.pg_loss * n, kl=merged.kl * n)
