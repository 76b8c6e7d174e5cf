"""The method: how rewards become advantages (:mod:`.advantages`), each expert's loss settings
(:mod:`.loss_settings`; the losses are :mod:`unirl_pl.algorithms`'), the experience source that runs one
step's rollout (:mod:`.experience`) and the policy updates of one RL step (:mod:`.policy`, :mod:`.update`)."""

from unirl_pl.method.advantages import AdvantageConfig, GroupLayout, check_scheme, compute_advantages
from unirl_pl.method.loss_settings import ExpertLoss

__all__ = ["AdvantageConfig", "ExpertLoss", "GroupLayout", "check_scheme", "compute_advantages"]
