"""The method: how rewards become advantages (:mod:`.advantages`), the per-loop policy losses
(:mod:`.grpo`), and the experience source that runs one step's rollout (:mod:`.experience`)."""

from unirl_pl.method.advantages import AdvantageConfig, GroupLayout, compute_advantages
from unirl_pl.method.grpo import ExpertLoss, dit_loss, lm_loss

__all__ = ["AdvantageConfig", "ExpertLoss", "GroupLayout", "compute_advantages", "dit_loss", "lm_loss"]
