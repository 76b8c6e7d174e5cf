"""The method: how rewards become advantages (:mod:`.advantages`), the per-loop policy losses
(:mod:`.grpo`), and the experience source that runs one step's rollout (:mod:`.experience`)."""

from unirl_pl.method.advantages import AdvantageConfig, GroupLayout, check_scheme, compute_advantages
from unirl_pl.method.grpo import ExpertLoss, dit_loss, lm_loss

__all__ = ["AdvantageConfig", "ExpertLoss", "GroupLayout", "check_scheme", "compute_advantages", "dit_loss", "lm_loss"]
