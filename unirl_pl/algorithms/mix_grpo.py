"""MixGRPO (Li et al., 2025): Flow-GRPO on an SDE window that slides over training steps, ODE elsewhere.

MixGRPO's ``progressive`` schedule (its ``GRPOTrainingStates``): a window of ``window_size`` steps starts at
step 0 and moves right by ``stride`` denoising steps every ``steps_per_window`` training steps (its
``iters_per_group``; ``stride`` is its ``prog_overlap_step``, or ``window_size`` without overlap) until it
reaches ``max_start``; with ``roll_back`` it then starts over at 0, otherwise it stays there. Only the window
is stochastic, recorded and trained: the early, high-noise steps first, where Flow-GRPO's own analysis puts
most of the reward's sensitivity. The position is a pure function of the trainer's global step, so a
resumed run is at the same window without saved state. (MixGRPO-Flash's higher-order ODE solver after the
window is not implemented: the ODE steps here are Euler.)
"""

from __future__ import annotations

from typing import Any

from unirl_pl.algorithms.flow_grpo import FlowGRPO
from unirl_pl.loops.config import RolloutConfig


class MixGRPO(FlowGRPO):
    """Flow-GRPO with MixGRPO's sliding SDE window.

    Args:
        window_size: Stochastic (trained) steps per trajectory (MixGRPO: 4 of 25).
        steps_per_window: Training steps the window stays at one position (MixGRPO: 25).
        stride: Denoising steps the window moves each time (MixGRPO: 1, overlapping windows).
        max_start: The last start position (None: ``num_steps - 1 - window_size``, so the window never covers
            the last step, where the SDE's variance degenerates; MixGRPO stops at ``num_steps - 2``).
        roll_back: After the last position start over at 0 (MixGRPO's default); otherwise stay there.
        guard: GRPO-Guard's regulated clipping (see :class:`FlowGRPO`).
    """

    def __init__(
        self,
        window_size: int = 2,
        steps_per_window: int = 10,
        stride: int = 1,
        max_start: int | None = None,
        roll_back: bool = True,
        guard: bool = False,
    ) -> None:
        super().__init__(guard=guard)
        if window_size < 1 or steps_per_window < 1 or stride < 1:
            got = f"{window_size}, {steps_per_window}, {stride}"
            raise ValueError(f"window_size, steps_per_window and stride must be >= 1, got {got}")
        if max_start is not None and max_start < 0:
            raise ValueError(f"max_start must be >= 0 or null, got {max_start}")
        self.window_size, self.steps_per_window, self.stride = window_size, steps_per_window, stride
        self.max_start, self.roll_back = max_start, roll_back
        self.step = 0

    def last_start(self, config: RolloutConfig) -> int:
        """The last window start, checked against ``config.num_steps``."""
        last = config.num_steps - 1 - self.window_size if self.max_start is None else self.max_start
        if last < 0 or last + self.window_size > config.num_steps:
            raise ValueError(
                f"MixGRPO: a window of {self.window_size} steps starting at up to {last} does not fit "
                f"num_steps={config.num_steps}"
            )
        return last

    def start_at(self, step: int, config: RolloutConfig) -> int:
        """The window's first denoising step at training step ``step``."""
        last = self.last_start(config)
        moves = step // self.steps_per_window
        positions = last // self.stride + 1  # starts 0, stride, ..., <= last
        if self.roll_back:
            return (moves % positions) * self.stride
        return min(moves, positions - 1) * self.stride

    def begin_step(self, step: int) -> None:
        self.step = int(step)

    def window(self, config: RolloutConfig) -> tuple[int, int]:
        start = self.start_at(self.step, config)
        return start, start + self.window_size

    def describe(self, config: RolloutConfig) -> dict[str, Any]:
        start, end = self.window(config)
        return {
            "sde_steps": list(range(start, end)) if self.noise_level(config) > 0 else [],
            "sde_window_schedule": {
                "window_size": self.window_size,
                "steps_per_window": self.steps_per_window,
                "stride": self.stride,
                "last_start": self.last_start(config),
                "roll_back": self.roll_back,
            },
        }

    def least_steps(self, config: RolloutConfig) -> int:
        # Any position the schedule reaches must fit: a probe at fit start and the steps after it agree.
        return self.last_start(config) // self.stride * self.stride + self.window_size
