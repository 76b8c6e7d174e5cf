"""Flow-CPS: Flow-GRPO with coefficients-preserving sampling (Flow-GRPO's ``sde_type="cps"``).

The stochastic step is :func:`unirl_pl.sampling.cps_step_with_logprob`: it re-noises the predicted clean sample
so that the coefficients of clean sample and noise keep the schedule's noise level exactly (the SDE step
over-injects noise at large steps), with the reference's log-prob ``-mean((x' - mean)^2)``. The window, the
loss and the gate are Flow-GRPO's; the KL of the step means uses CPS's own ``std``.
"""

from __future__ import annotations

from typing import Any

from unirl_pl.algorithms.flow_grpo import FlowGRPO
from unirl_pl.loops.config import RolloutConfig


class FlowCPS(FlowGRPO):
    """Flow-GRPO with the CPS step on ``model.rollout.sde_window``.

    Args:
        noise_level: CPS's noise level ``a``: the step's std is ``sigma_next * sin(a pi / 2)`` (None:
            ``model.rollout.noise_level``; MixGRPO's CPS default is 0.8).
        guard: GRPO-Guard's regulated clipping (see :class:`FlowGRPO`).
    """

    kind = "cps"

    def __init__(self, noise_level: float | None = None, guard: bool = False) -> None:
        super().__init__(guard=guard)
        if noise_level is not None and not 0 <= noise_level <= 1:
            raise ValueError(f"CPS noise_level must be in [0, 1] (sin(a pi / 2) <= 1), got {noise_level}")
        self.cps_noise_level = noise_level

    def bind(self, expert: Any, loop: Any, trained: bool) -> None:
        level = self.noise_level(loop.config)
        if not 0 <= level <= 1:
            raise ValueError(f"FlowCPS: noise_level must be in [0, 1] (sin(a pi / 2) <= 1), got {level}")
        self.window(loop.config)

    def noise_level(self, config: RolloutConfig) -> float:
        return config.noise_level if self.cps_noise_level is None else self.cps_noise_level

    def window(self, config: RolloutConfig) -> tuple[int, int]:
        start, end = config.sde_window
        if end >= config.num_steps:
            # sigma_next = 0 there: std 0, a deterministic step with nothing to train and a KL that divides by 0.
            raise ValueError(
                f"FlowCPS: sde_window {config.sde_window} includes the last step (num_steps={config.num_steps}), "
                "where CPS is deterministic; end the window before it"
            )
        return start, end
