"""Flow-CPS: Flow-GRPO with coefficients-preserving sampling (Flow-GRPO's ``sde_type="cps"``).

The stochastic step is :func:`unirl_pl.sampling.cps_step_with_logprob`: it re-noises the predicted clean sample
so that the coefficients of clean sample and noise keep the schedule's noise level exactly (the SDE step
over-injects noise at large steps), with the reference's log-prob ``-mean((x' - mean)^2)``. The window, the
loss and the gate are Flow-GRPO's; the KL of the step means uses CPS's own ``std``.
"""

from __future__ import annotations

from unirl_pl.algorithms.flow_grpo import FlowGRPO
from unirl_pl.loops.config import RolloutConfig


class FlowCPS(FlowGRPO):
    """Flow-GRPO with the CPS step on its SDE window.

    Args:
        sde_window: ``[start, end)`` denoising steps run as the CPS step, recorded and trained (ending before the
            last step, where CPS is deterministic).
        noise_level: CPS's noise level ``a``: the step's std is ``sigma_next * sin(a pi / 2)``, so ``a`` is in
            [0, 1].
        guard: GRPO-Guard's regulated clipping (see :class:`FlowGRPO`).
    """

    kind = "cps"

    def __init__(self, sde_window: tuple[int, int] = (0, 3), noise_level: float = 0.7, guard: bool = False) -> None:
        if not 0 <= noise_level <= 1:
            raise ValueError(f"CPS noise_level must be in [0, 1] (sin(a pi / 2) <= 1), got {noise_level}")
        super().__init__(sde_window=sde_window, noise_level=noise_level, guard=guard)

    def window(self, config: RolloutConfig) -> tuple[int, int]:
        start, end = super().window(config)
        if end >= config.num_steps:
            # sigma_next = 0 there: std 0, a deterministic step with nothing to train and a KL that divides by 0.
            raise ValueError(
                f"FlowCPS: sde_window {self.sde_window} includes the last step (num_steps={config.num_steps}), "
                "where CPS is deterministic; end the window before it"
            )
        return start, end
