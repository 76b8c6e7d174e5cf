"""Flow-CPS: Flow-GRPO with coefficients-preserving sampling (Flow-GRPO's ``sde_type="cps"``).

The stochastic step is :func:`unirl_pl.sampling.cps_step_with_logprob`: it re-noises the predicted clean sample
so that the coefficients of clean sample and noise keep the schedule's noise level exactly (the SDE step
over-injects noise at large steps), with the reference's log-prob ``-mean((x' - mean)^2)``. The window, the
loss and the gate are Flow-GRPO's; the KL of the step means uses CPS's own ``std``. GRPO-Guard is refused:
its normalization assumes the Gaussian log-prob's scale, which CPS's log-prob drops.
"""

from __future__ import annotations

from unirl_pl.algorithms.flow_grpo import FlowGRPO
from unirl_pl.loops.config import RolloutConfig

GUARD_REFUSED = (
    "{name}: guard (GRPO-Guard's regulated clipping) does not apply to the CPS step: it normalizes the log-ratio "
    "by the Gaussian log-prob's scale std * sqrt(-dt), which CPS's log-prob -mean((x' - mean)^2) drops (with its "
    "1 / (2 std^2)), so the normalized ratio is not centred at 1 (measured: 5 spreads off centre). "
    "Set guard: false, or use unirl_pl.algorithms.FlowGRPO with guard: true (recipes/algorithms/grpo_guard.yaml)"
)
"""The error of a CPS algorithm asked for GRPO-Guard (``{name}``: the class)."""


def check_cps(name: str, noise_level: float, guard: bool) -> None:
    """Refuse what the CPS step does not support: a noise level outside [0, 1], GRPO-Guard."""
    if not 0 <= noise_level <= 1:
        raise ValueError(f"CPS noise_level must be in [0, 1] (sin(a pi / 2) <= 1), got {noise_level}")
    if guard:
        raise ValueError(GUARD_REFUSED.format(name=name))


class FlowCPS(FlowGRPO):
    """Flow-GRPO with the CPS step on its SDE window.

    Args:
        sde_window: ``[start, end)`` denoising steps run as the CPS step, recorded and trained (ending before the
            last step, where CPS is deterministic). None: ``[0, 3)``, or ``timestep_fraction``'s window.
        noise_level: CPS's noise level ``a``: the step's std is ``sigma_next * sin(a pi / 2)``, so ``a`` is in
            [0, 1].
        guard: Refused (true is a ``ValueError``): GRPO-Guard's normalization assumes the Gaussian log-prob's
            scale ``std * sqrt(-dt)``, which CPS's log-prob does not have.
        timestep_fraction: The window ``[0, int(timestep_fraction * num_steps))`` (see :class:`FlowGRPO`);
            it must end before the last step.
    """

    kind = "cps"

    def __init__(
        self,
        sde_window: tuple[int, int] | None = None,
        noise_level: float = 0.7,
        guard: bool = False,
        timestep_fraction: float | None = None,
    ) -> None:
        check_cps(type(self).__name__, noise_level, guard)
        super().__init__(
            sde_window=sde_window, noise_level=noise_level, guard=guard, timestep_fraction=timestep_fraction
        )

    def window(self, config: RolloutConfig) -> tuple[int, int]:
        start, end = super().window(config)
        if end >= config.num_steps:
            # sigma_next = 0 there: std 0, a deterministic step with nothing to train and a KL that divides by 0.
            which = (
                f"sde_window {self.sde_window}"
                if self.sde_window is not None
                else f"timestep_fraction {self.timestep_fraction}'s window [0, {end})"
            )
            raise ValueError(
                f"FlowCPS: {which} includes the last step (num_steps={config.num_steps}), "
                "where CPS is deterministic; end the window before it"
            )
        return start, end
